"""Attention backends behind one protocol (see base.py). The FlashInfer backend is imported
only by `make_backend` when a CUDA device is in use, so the CPU path never imports it.

Which backend runs (`make_backend`):
  cpu         the compiled CPU kernel (overlap/attention/cpu.py); the CPU default.
  reference   pure torch, float64 inside: the ReferenceBackend on the CPU; on CUDA the same
              math with its metadata staged on the device (TorchBackend).
  torch       TorchBackend on any device: the CUDA fallback when FlashInfer is missing.
  flashinfer  FlashInfer (CUDA; the `gpu` extra).
  auto        flashinfer on CUDA when it imports (torch otherwise, with a warning), cpu on the CPU.
"""

from __future__ import annotations

import logging

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.attention.reference import ReferenceBackend

BACKENDS = ("auto", "cpu", "reference", "torch", "flashinfer")
log = logging.getLogger("overlap.attention")


def flashinfer_problem() -> str | None:
    """Why the flashinfer backend cannot be used here (None when it can)."""
    try:
        import overlap.attention.flashinfer  # noqa: F401  (imports flashinfer, checks its version)
    except ImportError as exc:
        return f"flashinfer is not usable ({exc})"
    return None


def make_backend(name: str, device: str) -> AttentionBackend:
    device = str(device)
    cuda = device.startswith("cuda")
    if name == "auto":
        if not cuda:
            name = "cpu"
        else:
            problem = flashinfer_problem()
            name = "flashinfer" if problem is None else "torch"
            if problem is not None:
                log.warning("attention: %s; using the torch-only backend on %s (slower, exact)", problem, device)
    if name == "reference":
        if cuda:
            from overlap.attention.torch_paged import TorchBackend

            return TorchBackend(device)  # the reference math, its metadata on the device
        return ReferenceBackend()
    if name == "torch":
        from overlap.attention.torch_paged import TorchBackend

        return TorchBackend(device)
    if name == "cpu":
        if cuda:
            raise ValueError("the cpu attention backend runs on the CPU only")
        from overlap.attention.cpu import CpuBackend

        return CpuBackend()
    if name == "flashinfer":
        if not cuda:
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        from overlap.attention.flashinfer import FlashInferBackend  # GPU only; checks the version

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r} ({' | '.join(BACKENDS)})")


__all__ = ["AttentionBackend", "SeqAttention", "ReferenceBackend", "make_backend", "BACKENDS"]
