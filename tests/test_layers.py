"""The layers at run time: importing the pure core and the simulator loads no runtime.

``make lint`` checks the import contracts statically (import-linter); this checks what a fresh
interpreter actually loads, so a runtime import slipped into a core module (or pulled in
through a package ``__init__``) fails here too, whichever tool runs."""

from __future__ import annotations

import importlib.util
import json
import pkgutil
import subprocess
import sys

PURE_MODULES = (
    "sluice.dispatcher",
    "sluice.dispatcher.scheduler",
    "sluice.dispatcher.cacheaware",
    "sluice.dispatcher.feed",
    "sluice.agent.reports",
    "sluice.agent.acceptance",
    "sluice.sim.replay",
    "sluice.sim.policies",
)

FORBIDDEN = (
    "nats",
    "pydantic_settings",
    "prometheus_client",
    "uvloop",
    "sluice.dispatcher.runtime",
    "sluice.agent.runtime",
    "sluice.common",
    "sluice.client",
    "sluice.testing",
    "sluice.cli",
)


def _loaded_after_importing(modules: tuple[str, ...]) -> list[str]:
    """Every module in ``sys.modules`` of a fresh interpreter after importing ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def _offending(loaded: list[str]) -> list[str]:
    return [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


def test_the_pure_core_and_the_simulator_load_no_runtime() -> None:
    loaded = _loaded_after_importing(PURE_MODULES)
    assert set(PURE_MODULES) <= set(loaded)  # the check ran on what it names
    assert _offending(loaded) == []


def test_each_pure_module_alone_loads_no_runtime() -> None:
    """One interpreter per module: a runtime import hidden behind another module's import
    order (or only in one module) is still found, and the message names the module."""
    for module in PURE_MODULES:
        assert _offending(_loaded_after_importing((module,))) == [], module


def _modules_of(package: str) -> list[str]:
    """Every module of ``package`` (recursively), without its ``runtime`` subpackage."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations is not None
    out = [package]
    for info in pkgutil.walk_packages(spec.submodule_search_locations, package + "."):
        if info.name.split(".")[2:3] != ["runtime"]:
            out.append(info.name)
    return out


def test_every_module_of_the_core_and_the_simulator_loads_no_runtime() -> None:
    """Not only the modules above: every module of the wire, the core (outside the runtime
    subpackages) and the simulator, so a core module nothing above imports (the lease table,
    say) is covered too. The core loads no asyncio either."""
    core = [
        m for p in ("sluice.schemas", "sluice.dispatcher", "sluice.agent") for m in _modules_of(p)
    ]
    assert "sluice.dispatcher.leases" in core and "sluice.agent.outbox" in core
    assert not any(".runtime" in m for m in core)
    loaded = _loaded_after_importing(tuple(core))
    assert _offending(loaded) == []
    assert "asyncio" not in loaded, "the pure core imports asyncio"
    sim = tuple(_modules_of("sluice.sim"))
    assert "sluice.sim.plots" in sim
    assert _offending(_loaded_after_importing(sim)) == []


def test_the_check_sees_a_runtime_import() -> None:
    """The guard itself: importing a runtime module is reported."""
    loaded = _loaded_after_importing(("sluice.dispatcher.runtime",))
    assert "nats" in _offending(loaded) and "sluice.dispatcher.runtime" in _offending(loaded)


def test_the_command_line_loads_no_broker_client_until_a_command_needs_one() -> None:
    """`sluice replay`, `sluice --help` and the other offline commands start without nats.py
    and aiohttp (a third of a second on this machine): the commands that talk to a broker
    import them when they run."""
    loaded = _loaded_after_importing(("sluice.cli.app",))
    assert "sluice.cli.app" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("nats", "aiohttp")] == []
