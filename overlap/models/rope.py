"""Rotary position embeddings (HF's rotate-half layout), with Llama-3 and linear scaling."""

from __future__ import annotations

import math

import torch

from overlap.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] f32 rotation frequencies, scaled as config.json's rope_scaling says."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.rope_scaling is None:
        return inv
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (default | linear | llama3)")


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


class RotaryTable:
    """cos/sin for every position up to max_position, computed once."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
        inv = inv_frequencies(cfg)
        pos = torch.arange(cfg.max_position, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_pos, head_dim] f32
        # Cast to the model dtype as HF does, so bf16 runs round like the reference.
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] i64 → (cos, sin) [T, 1, head_dim]: gathered once per forward."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] → rotated x (HF's rotate_half layout), same shape and dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
