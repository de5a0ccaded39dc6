"""The run-time admission configuration: dispatchers watch one JSON document in a KV bucket
(``sluice quota set`` writes it) and apply it within a second; an invalid one is ignored."""

from __future__ import annotations

import logging

from nats.js.kv import KeyValue

from sluice.dispatcher.runtime import metrics
from sluice.dispatcher.runtime.state import State
from sluice.dispatcher.runtime.streams import config_bucket
from sluice.schemas import names
from sluice.schemas.models import AdmissionOverrides

log = logging.getLogger("sluice.dispatcher")


class ConfigWatch:
    """Applies the operators' overrides as they change."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._watch: KeyValue.KeyWatcher | None = None

    async def start(self) -> None:
        kv = await config_bucket(self.state.js, self.state.settings)
        self._watch = await kv.watch(names.ADMISSION_KEY)

    async def stop(self) -> None:
        if self._watch is not None:
            await self._watch.stop()  # type: ignore[no-untyped-call]  # ends loop() at once

    async def loop(self) -> None:
        assert self._watch is not None, "start() first"
        async for entry in self._watch:
            if entry is None:
                continue  # the end of the initial value(s)
            deleted = entry.operation is not None  # a delete or purge: back to the settings
            self.apply(None if deleted else entry.value)

    def apply(self, data: bytes | None) -> bool:
        """Apply a run-time configuration (JSON of ``AdmissionOverrides``; None: back to this
        dispatcher's settings). An invalid one is logged and ignored; returns whether it took."""
        st = self.state
        try:
            if data is None:
                config = st.settings.admission()
            else:
                overrides = AdmissionOverrides.model_validate_json(data)
                config = st.settings.with_overrides(overrides)
            st.scheduler.reconfigure(config)
            st.admission = config
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            metrics.CONFIG_UPDATES.labels("rejected").inc()
            log.error("run-time admission configuration ignored: %s", exc)
            return False
        metrics.CONFIG_UPDATES.labels("applied").inc()
        log.info("run-time admission configuration applied")
        st.kick.set()
        return True
