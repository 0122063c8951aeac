"""overlap: a speculative-decoding LLM inference engine (the part that runs in the GPU process)."""

import os

# torch's OpenMP threads spin for milliseconds after every large op by default (libgomp's
# GOMP_SPINCOUNT): on a small CPU that spinning takes the core our kernels' own worker
# threads need (overlap/kernels/pool.h), and a batch of 64 rows slowed 3-6x. Passive
# waiting must be chosen before libgomp loads, i.e. before torch is first imported; set
# OMP_WAIT_POLICY yourself to override it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
