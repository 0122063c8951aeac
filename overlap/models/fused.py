"""What the fused CPU calls (overlap/kernels: model_step.cpp for a target or draft model's
pass, head_step.cpp for an MTP / EAGLE head's) share on the Python side: a pool's caches and
a plan's tree as the calls take them, and the call kept on its model until a tensor it reads
changes."""

from __future__ import annotations

from typing import Callable

import torch

from overlap import kernels
from overlap.kv import KVPool

EMPTY = torch.empty(0, dtype=torch.bfloat16)  # a fused call's "none" for its optional tensors
NO_TREE = torch.empty(0, dtype=torch.bool)  # a causal plan's tree


def caches(kv: KVPool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A KV pool as the fused calls take it (model_step.h, KvCaches): K and V of every layer as
    flat slot arrays, then V's key-pair copy, or an empty tensor where the pool keeps none."""
    k, v, pairs = kv.slot_arrays()
    return k, v, EMPTY if pairs is None else pairs


def tree(plan_tree: torch.Tensor | None) -> torch.Tensor:
    return NO_TREE if plan_tree is None else plan_tree


class Kept:
    """A fused call kept on its model: it holds the packed weights, so it is made again when a
    tensor it reads changes in place (version counters only grow, so their sum moves) or a
    shared one is replaced (`identity`: the ids of what may be swapped)."""

    def __init__(self, tensors: list[torch.Tensor], identity: tuple, step):
        self.watch, self.identity, self.step = kernels.version_watch(tensors), identity, step
        self.version = self.watch.sum()

    def current(self, identity: tuple) -> bool:
        return identity == self.identity and self.watch.sum() == self.version


def kept_step(owner, identity: tuple, tensors: Callable[[], list[torch.Tensor]], make: Callable[[], object]):
    """owner's fused call (None where it does not apply: make returned None, or a tensor it
    would read is not bf16 on the CPU), made by make() when there is none or it is no longer
    current; `tensors` lists what it reads."""
    kept = owner.__dict__.get("_fused")
    if kept is not None and kept.current(identity):
        return kept.step
    read = tensors()
    bf16_cpu = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in read)
    kept = Kept(read, identity, make() if bf16_cpu else None)
    owner.__dict__["_fused"] = kept
    return kept.step
