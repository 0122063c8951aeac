"""The fixed cost of a step does not creep back: count the aten ops one decode step dispatches.

Each dispatched op costs microseconds of host time whatever its size; at batch 1 that is the
step's fixed overhead. The fused CPU path dispatches 6 ops per decoder layer (its views; its
K/V stores, residual adds and outputs' allocations skip the dispatcher), ~15 before session 38
and ~45 in the eager graph. The bound fails on a regression to per-op code, not on one op.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import hf_model, our_model, tiny_hf_config
from overlap.attention import SeqAttention, make_backend

OPS_PER_LAYER = 8  # measured 6 (30 ops for 4 layers, 54 for 8): see the assertion message
FIXED_OPS = 20


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_a_decode_step_dispatches_a_bounded_number_of_ops():
    layers = 4
    cfg = tiny_hf_config(hidden=128, heads=4, kv_heads=2, layers=layers)
    model = our_model(hf_model(cfg), cfg, torch.bfloat16)
    backend = make_backend("auto", "cpu")
    kv = model.new_kv_pool(16, 16)
    meta = backend.plan([SeqAttention(1, 40, [0, 1, 2])], 16)
    ids, pos, rows = torch.tensor([5]), torch.tensor([39]), torch.tensor([0])
    model(ids, pos, backend, kv, meta, rows)  # warm-up (lazy kernel load)
    with CountOps() as counter:
        model(ids, pos, backend, kv, meta, rows)
    total = sum(counter.ops.values())
    top = sorted(counter.ops.items(), key=lambda kv_: -kv_[1])[:8]
    assert total <= OPS_PER_LAYER * layers + FIXED_OPS, f"{total} ops for {layers} layers; most: {top}"
    assert total >= layers  # the mode does see the step's ops
