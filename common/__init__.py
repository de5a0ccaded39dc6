"""Helpers shared by the runtimes (dispatcher, agent, client, gateway): asyncio helpers, the NATS
connection, the settings base and the base errors. Never imported by the pure core or the
simulator."""
