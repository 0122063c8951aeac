"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU).

Each rank holds a shard of the target (Megatron-style):
  attention  q/k/v column-parallel by KV-head groups (a rank's query heads are the ones that
             read its KV heads, so GQA stays local), o_proj row-parallel + all-reduce; the
             rank's KV pool holds only its KV heads;
  MLP        gate/up column-parallel, down row-parallel + all-reduce;
  embedding  vocab-parallel: a rank looks up the ids in its vocabulary range (zeros
             elsewhere) and the ranks all-reduce; the tied / untied lm_head uses the same
             row ranges and the ranks all-gather the logits.
Head and vocabulary counts need not divide by the world size: shards are contiguous ranges
as even as possible (SmolLM2-135M has 3 KV heads; at TP=2 the ranks get 2 and 1).

Weights are read shard by shard from the safetensors files (`safe_open(...).get_slice`):
no rank materialises the full model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from overlap.config import ModelConfig
from overlap.models.llama import LlamaModel, logits_linear


def _split(n: int, world: int, rank: int) -> range:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    kv_heads: range
    heads: range
    intermediate: range
    vocab: range

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, world: int) -> "Shard":
        if cfg.num_kv_heads < world:
            raise ValueError(f"tensor parallelism {world} needs at least {world} KV heads; the model has "
                             f"{cfg.num_kv_heads}")
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        kv = _split(cfg.num_kv_heads, world, rank)
        return cls(rank, world, kv, range(kv.start * group, kv.stop * group),
                   _split(cfg.intermediate_size, world, rank), _split(cfg.vocab_size, world, rank))


class Collectives:
    """The two collectives the sharded forward needs, on a process group."""

    def __init__(self, world: int, group=None):
        self.world = world
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # Summed in float32: gloo's bf16 sum rounds after every addition, and the partial
        # outputs of a row-parallel matmul deserve one rounding, like the unsharded matmul.
        y = x.float()
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's [N, size_r] along the last dim (sizes may differ)."""
        width = max(sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p[..., :s] for p, s in zip(parts, sizes)], dim=-1)


class ShardedLlamaModel(LlamaModel):
    """A LlamaModel holding one rank's shard; forward has the unsharded model's interface."""

    def __init__(self, cfg: ModelConfig, shard: Shard, comm: Collectives, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        local = dataclasses.replace(cfg, num_heads=len(shard.heads), num_kv_heads=len(shard.kv_heads),
                                    intermediate_size=len(shard.intermediate), vocab_size=len(shard.vocab))
        super().__init__(local, dtype, device)
        self.full_cfg, self.shard, self.comm = cfg, shard, comm
        self._vocab_sizes = [len(Shard.of(cfg, r, shard.world).vocab) for r in range(shard.world)]
        for layer in self.layers:
            layer.reduce = comm.all_reduce

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        v = self.shard.vocab
        mine = (input_ids >= v.start) & (input_ids < v.stop)
        local = self.embed_tokens[(input_ids - v.start).clamp(0, len(v) - 1)] * mine[:, None]
        return self.comm.all_reduce(local)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather_last(logits_linear(hidden, self.lm_head, self.linear), self._vocab_sizes)


def load_sharded(model_dir, shard: Shard, comm: Collectives, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> ShardedLlamaModel:
    """Read only this rank's slices of every weight."""
    from safetensors import safe_open

    from overlap.models.loading import read_model_config

    cfg = ModelConfig.from_hf(read_model_config(model_dir))
    model = ShardedLlamaModel(cfg, shard, comm, dtype, device)
    d = cfg.head_dim
    files = sorted(Path(model_dir).glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def rows(name: str, r: range, per: int = 1) -> torch.Tensor:
        return where[name].get_slice(name)[r.start * per: r.stop * per].to(dtype)

    def cols(name: str, r: range, per: int = 1) -> torch.Tensor:
        return where[name].get_slice(name)[:, r.start * per: r.stop * per].to(dtype)

    def full(name: str) -> torch.Tensor:
        return where[name].get_tensor(name).to(dtype)

    p = "model."
    with torch.no_grad():
        model.embed_tokens.copy_(rows(p + "embed_tokens.weight", shard.vocab))
        if not cfg.tie_word_embeddings:
            model.lm_head.copy_(rows("lm_head.weight", shard.vocab))
        model.norm.weight.copy_(full(p + "norm.weight"))
        for i, layer in enumerate(model.layers):
            a = f"{p}layers.{i}."
            layer.qkv_proj.copy_(torch.cat([rows(a + "self_attn.q_proj.weight", shard.heads, d),
                                            rows(a + "self_attn.k_proj.weight", shard.kv_heads, d),
                                            rows(a + "self_attn.v_proj.weight", shard.kv_heads, d)]))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([rows(a + "self_attn.q_proj.bias", shard.heads, d),
                                                rows(a + "self_attn.k_proj.bias", shard.kv_heads, d),
                                                rows(a + "self_attn.v_proj.bias", shard.kv_heads, d)]))
            layer.o_proj.copy_(cols(a + "self_attn.o_proj.weight", shard.heads, d))
            layer.gate_up_proj.copy_(torch.cat([rows(a + "mlp.gate_proj.weight", shard.intermediate),
                                                rows(a + "mlp.up_proj.weight", shard.intermediate)]))
            layer.down_proj.copy_(cols(a + "mlp.down_proj.weight", shard.intermediate))
            layer.input_layernorm.weight.copy_(full(a + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(full(a + "post_attention_layernorm.weight"))
    return model.eval()


class _VocabParallelLookup:
    """Stands in for an embedding matrix: `lookup[ids]` is the sharded model's embedding."""

    def __init__(self, model: ShardedLlamaModel):
        self.model = model

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids)


def load_head_sharded(head_dir, target: ShardedLlamaModel):
    """The MTP head sharded like the target's layers (it reads the target's hidden states on
    every rank): its layer's heads and MLP split by the same ranges, the fuse replicated, the
    embedding lookup and the logits through the target's vocab-parallel ones."""
    import json

    from safetensors import safe_open

    from overlap.models.heads import HEAD_TYPE, MTPHead

    head_dir = Path(head_dir)
    raw = json.loads((head_dir / "config.json").read_text())
    if raw.get("head_type") != HEAD_TYPE:
        raise ValueError(f"{head_dir} is not an MTP head")
    shard, cfg, dtype = target.shard, target.full_cfg, target.dtype
    head = MTPHead(target.cfg, target, norms=bool(raw.get("norms", True)), dtype=dtype)
    object.__setattr__(head, "embed_tokens", _VocabParallelLookup(target))
    head.compute_logits = lambda hidden: target.compute_logits(hidden.to(dtype))
    head.layer.reduce = target.comm.all_reduce
    d, nq, nkv, inter = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f, torch.no_grad():
        def rows(name: str, start: int, r: range, per: int = 1) -> torch.Tensor:
            return f.get_slice(name)[start + r.start * per: start + r.stop * per].to(dtype)

        layer = head.layer
        qkv = "layer.qkv_proj"
        layer.qkv_proj.copy_(torch.cat([rows(qkv, 0, shard.heads, d), rows(qkv, nq, shard.kv_heads, d),
                                        rows(qkv, nq + nkv, shard.kv_heads, d)]))
        if layer.qkv_bias is not None:
            b = "layer.qkv_bias"
            layer.qkv_bias.copy_(torch.cat([rows(b, 0, shard.heads, d), rows(b, nq, shard.kv_heads, d),
                                            rows(b, nq + nkv, shard.kv_heads, d)]))
        layer.o_proj.copy_(f.get_slice("layer.o_proj")[:, shard.heads.start * d: shard.heads.stop * d].to(dtype))
        gu = "layer.gate_up_proj"
        layer.gate_up_proj.copy_(torch.cat([rows(gu, 0, shard.intermediate), rows(gu, inter, shard.intermediate)]))
        layer.down_proj.copy_(f.get_slice("layer.down_proj")[:, shard.intermediate.start: shard.intermediate.stop]
                              .to(dtype))
        for name, param in head.named_parameters():
            if not name.startswith("layer.") or "layernorm" in name:
                param.copy_(f.get_tensor(name).to(dtype))
    head.requires_grad_(False)
    return head.eval()
