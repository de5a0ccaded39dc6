"""The runtime helpers' errors, and the one counter of internal errors.

A long-running part (the dispatcher, an agent, the local cluster) counts an error it had to
swallow to keep serving in :data:`INTERNAL_ERRORS`, labelled by the ``site`` that swallowed it,
and logs it: nothing vanishes silently. Errors that are expected (a broker that is briefly away) are
caught by their type where they happen and are not internal errors.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter


class CommonError(Exception):
    """Base class of the errors raised by :mod:`sluice.common`."""


class TransportError(CommonError):
    """NATS could not be reached."""


class ConfigError(CommonError, ValueError):
    """Settings that do not validate, or a config file that cannot be read."""


INTERNAL_ERRORS = Counter(
    "sluice_internal_errors_total",
    "Unexpected errors a process caught to keep serving, by the site that caught them",
    ["site"],
)


def internal_error(
    log: logging.Logger,
    site: str,
    message: str,
    *args: object,
    exc: BaseException | None = None,
) -> None:
    """Log an exception with its traceback and count it at ``site``: ``exc``, or (from an
    ``except`` block) the one being handled."""
    INTERNAL_ERRORS.labels(site).inc()
    log.error("[%s] " + message, site, *args, exc_info=exc if exc is not None else True)
