"""``sluice gateway``: an OpenAI-compatible HTTP face over the Sluice client library.

async with GatewayServer(GatewaySettings(nats_url=url, port=0)) as server:
    ...  # POST {server.url}/v1/chat/completions with any OpenAI client

See docs/gateway.md: routes, API keys and bands, sessions, errors, metrics, settings.
"""

from sluice.gateway.app import Gateway, build_app, gateway_of, guarded
from sluice.gateway.errors import ApiError, BindError, GatewayError
from sluice.gateway.keys import KeyTable, Principal
from sluice.gateway.server import GatewayServer, serve
from sluice.gateway.settings import ApiKey, GatewaySettings

__all__ = [
    "ApiError",
    "ApiKey",
    "BindError",
    "Gateway",
    "GatewayError",
    "GatewayServer",
    "GatewaySettings",
    "KeyTable",
    "Principal",
    "build_app",
    "gateway_of",
    "guarded",
    "serve",
]
