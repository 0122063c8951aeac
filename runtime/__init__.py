"""overlap's runtime: the scheduler core, the in-process engine, processes, client and CLI."""

import overlap  # noqa: F401  (first: sets the OpenMP wait policy before torch loads)
