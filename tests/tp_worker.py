"""Rank entry points for the tensor-parallel tests (spawned processes import this module)."""

import torch
import torch.distributed as dist

from overlap.attention import ReferenceBackend, SeqAttention
from overlap.config import ModelConfig
from overlap.models.loading import read_model_config
from overlap.models.tp import Collectives, Shard, load_sharded

PROMPTS = [[5, 17, 3, 9, 40, 2], [11, 7, 23], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def sharded_logits(rank: int, world: int, model_dir: str, rendezvous: str, out: str) -> None:
    """Prefill three prompts with the rank's shard, then one decode step; rank 0 saves logits."""
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cfg = ModelConfig.from_hf(read_model_config(model_dir))
        shard = Shard.of(cfg, rank, world)
        model = load_sharded(model_dir, shard, Collectives(world), torch.float32)
        logits = run_prompts(model)
        if rank == 0:
            torch.save({"logits": logits, "kv_heads": len(shard.kv_heads), "vocab": len(shard.vocab),
                        "params": sum(p.numel() for p in model.parameters())}, out)
    finally:
        dist.destroy_process_group()


def run_prompts(model) -> torch.Tensor:
    backend, page = ReferenceBackend(), 4
    kv = model.new_kv_pool(32, page)
    tables, start = [], 0
    for p in PROMPTS:
        n = -(-(len(p) + 1) // page)
        tables.append(list(range(start, start + n)))
        start += n
    ids = torch.tensor([t for p in PROMPTS for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    meta = backend.plan([SeqAttention(len(p), len(p), t) for p, t in zip(PROMPTS, tables)], page)
    _, prefill = model(ids, pos, backend, kv, meta, torch.arange(len(ids)))
    nxt = torch.tensor([p[-1] for p in PROMPTS])
    meta = backend.plan([SeqAttention(1, len(p) + 1, t) for p, t in zip(PROMPTS, tables)], page)
    _, decode = model(nxt, torch.tensor([len(p) for p in PROMPTS]), backend, kv, meta, torch.arange(len(PROMPTS)))
    return torch.cat([prefill, decode])
