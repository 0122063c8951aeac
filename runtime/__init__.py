"""overlap's runtime: the scheduler core, the in-process engine, processes, client and CLI."""
