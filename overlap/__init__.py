"""overlap: a speculative-decoding LLM inference engine (the part that runs in the GPU process)."""

__version__ = "0.1.0"
