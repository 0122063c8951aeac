"""Attention backends behind one protocol (see base.py). The FlashInfer backend is imported
only by `make_backend` when a CUDA device is in use, so the CPU path never imports it."""

from __future__ import annotations

from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.attention.reference import ReferenceBackend


def make_backend(name: str, device: str) -> AttentionBackend:
    if name == "auto":
        name = "flashinfer" if device.startswith("cuda") else "cpu"
    if name == "reference":
        return ReferenceBackend()
    if name == "cpu":
        if device.startswith("cuda"):
            raise ValueError("the cpu attention backend runs on the CPU only")
        from overlap.attention.cpu import CpuBackend

        return CpuBackend()
    if name == "flashinfer":
        if not device.startswith("cuda"):
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        from overlap.attention.flashinfer import FlashInferBackend  # GPU only

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r} (auto | cpu | reference | flashinfer)")


__all__ = ["AttentionBackend", "SeqAttention", "ReferenceBackend", "make_backend"]
