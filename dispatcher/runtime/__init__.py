"""The live dispatcher: the pure core wrapped in an asyncio/NATS runtime."""

from sluice.dispatcher.runtime.app import Dispatcher
from sluice.dispatcher.runtime.settings import DispatcherSettings

__all__ = ["Dispatcher", "DispatcherSettings"]
