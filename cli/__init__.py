"""The face: the ``sluice`` command line, its console output, the demo and the replay, quota
and bench commands. Nothing imports it; it imports everything."""
