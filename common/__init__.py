"""Helpers shared by the runtimes (dispatcher, agent, client): asyncio helpers, the NATS
connection, the settings base, the base errors and the internal-errors counter. Never imported
by the pure core or the simulator."""
