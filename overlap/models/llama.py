"""Llama-family decoder (Llama, SmolLM, Qwen2) over ragged, flattened batches with paged KV.

Input is one flat token stream for the whole batch (`input_ids [T]`, `positions [T]`); the
attention metadata says which tokens belong to which sequence and where their KV lives.
Returns the final hidden states of every token (drafters read them) and logits only for the
rows asked for (the lm_head is the single largest matrix: never run it on prompt tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overlap.attention.base import AttentionBackend
from overlap.attention.cpu import CpuMetadata
from overlap.config import ModelConfig
from overlap import kernels
from overlap.kernels import linear_bf16, linear_int8
from overlap.kv import KVPool
from overlap.models import fused
from overlap.models.rope import RotaryTable, rotate

MATMULS = ("exact", "fast")  # a target's: both keep its bf16 weights
DRAFTER_MATMULS = MATMULS + ("int8",)  # a drafter's may also quantize its own


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant F.linear: x [T, in] → [T, out]; row t depends on x[t] only.

    bf16 on the CPU runs overlap's own kernel (overlap/kernels): oneDNN changes its reduction
    order with the row count in ways that differ per ISA (AMX, AVX512_CORE_BF16, ...), so a
    verify pass and a decode step would round a token's logits differently. float32 (the
    dtype compared with transformers) and CUDA keep F.linear."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear as oneDNN chooses (matmul = "fast"): NOT batch-invariant in bf16 on the CPU;
    greedy speculation may then part from plain decoding at near-ties."""
    return F.linear(x, weight, bias)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only int8 (matmul = "int8", drafters only: heads and draft models): bf16 rows on
    the CPU read an int8 copy of the weight (overlap/kernels/linear_int8.cpp), half the bytes
    of a bandwidth-bound drafter step. Batch-invariant like `linear`; other dtypes and devices
    never reach it (the proposer refuses them at start-up)."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu":
        return linear_int8(x, weight, bias)
    return linear(x, weight, bias)


def logits_linear(hidden: torch.Tensor, weight: torch.Tensor, linear_fn=linear) -> torch.Tensor:
    """hidden [N, hidden] @ an lm_head [V, hidden] → logits [N, V] f32. The exact kernel hands
    back its f32 sums unrounded; every model, drafter and head scores tokens through this, so a
    drafter that is the target itself ranks tokens exactly as the target does."""
    if hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu":
        if linear_fn is linear:
            return linear_bf16(hidden, weight, out_float=True)
        if linear_fn is int8_linear:
            return linear_int8(hidden, weight, out_float=True)
    return linear_fn(hidden, weight).float()


def spread_vocabulary(sub: torch.Tensor, vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A trimmed drafter's logits [N, len(vocab_ids)] f32 → [N, vocab_size], -inf outside
    vocab_ids (ascending): what samplers and verifiers read. On the CPU one kernel pass."""
    if sub.device.type == "cpu" and sub.dtype == torch.float32:
        return kernels.spread_columns(sub, vocab_ids, vocab_size)
    full = torch.full((sub.shape[0], vocab_size), float("-inf"), device=sub.device)
    full[:, vocab_ids] = sub
    return full


def matmul_fn(name: str):
    if name not in DRAFTER_MATMULS:
        raise ValueError(f"matmul must be one of {DRAFTER_MATMULS}, got {name!r}")
    return {"exact": linear, "fast": fast_linear, "int8": int8_linear}[name]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers' LlamaRMSNorm (normalise in f32, scale in x's dtype);
        # one fused call for bf16 rows on the CPU (overlap/kernels/layer_ops.cpp).
        if kernels.fusable(x) and self.weight.dtype == torch.bfloat16:
            return kernels.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, matmul: str = "exact"):
        super().__init__()
        self.index = index
        self.linear = matmul_fn(matmul)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        h = cfg.hidden_size
        # q, k, v (and gate, up) fused into one matmul each: fewer calls, one weight read.
        self.qkv_proj = nn.Parameter(torch.empty(sum(self.split), h))
        self.qkv_bias = nn.Parameter(torch.zeros(sum(self.split))) if cfg.attention_bias else None
        self.o_proj = nn.Parameter(torch.empty(h, q_size))
        self.gate_up_proj = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h))
        self.down_proj = nn.Parameter(torch.empty(h, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        # Tensor parallelism (models/tp.py): the sum of the ranks' partial outputs of the
        # row-parallel o_proj and down_proj; None on a single device.
        self.reduce = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                backend: AttentionBackend, kv: KVPool, meta: Any) -> torch.Tensor:
        t = x.shape[0]
        # 1. attention: project, rotate q and k together, store the new K/V in their pages, attend.
        qkv = self.linear(self.input_layernorm(x), self.qkv_proj, self.qkv_bias)
        q_size, kv_size, _ = self.split
        rot_heads = self.num_heads + self.num_kv_heads
        if kernels.fusable(qkv):  # one in-place call instead of a cat and four elementwise ops
            kernels.rotary_(qkv, rope[0].squeeze(1), rope[1].squeeze(1), rot_heads, self.head_dim)
            qk = qkv[:, : q_size + kv_size].view(t, rot_heads, self.head_dim)
        else:
            qk = rotate(qkv[:, : q_size + kv_size].view(t, rot_heads, self.head_dim), *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        kv.write(self.index, meta.slots, k, v)
        attn = backend.run(self.index, q, kv, meta).view(t, -1)
        out = self.linear(attn, self.o_proj)
        x = x + (out if self.reduce is None else self.reduce(out))
        # 2. SwiGLU MLP.
        gate_up = self.linear(self.post_attention_layernorm(x), self.gate_up_proj)
        if kernels.fusable(gate_up):
            act = kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, -1)
            act = F.silu(gate) * up
        out = self.linear(act, self.down_proj)
        return x + (out if self.reduce is None else self.reduce(out))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", shared_embeddings: "LlamaModel | None" = None,
                 matmul: str = "exact"):
        """shared_embeddings: take embed_tokens and lm_head from that model (drafters).
        matmul: "exact" (batch-invariant, the default), "fast" (oneDNN as it chooses) or, for a
        draft model, "int8" (weight-only int8 on the CPU: int8_linear)."""
        super().__init__()
        self.cfg = cfg
        self.matmul = matmul
        self.linear = matmul_fn(matmul)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, matmul) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.shares_embeddings = shared_embeddings is not None
        if shared_embeddings is None:
            self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
            self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size)))
        # Inference only (forward runs under inference_mode); training tools use their own modules.
        self.requires_grad_(False)
        self.to(dtype=dtype, device=device)
        if shared_embeddings is not None:
            # Plain attributes, not registered parameters: the drafter neither owns nor saves them.
            object.__setattr__(self, "embed_tokens", shared_embeddings.embed_tokens)
            object.__setattr__(self, "lm_head", shared_embeddings.lm_head)
        self.rope = RotaryTable(cfg, dtype, device)
        # Decoder layers whose outputs forward returns instead of the final hidden (set by a
        # multi-layer MTP / EAGLE-3 head's proposer; empty: the final hidden).
        self.feature_layers: tuple[int, ...] = ()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                kv: KVPool, meta: Any, logits_indices: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions [T] i64 → (hidden [T, hidden] after the final norm, or the
        concatenated outputs of `feature_layers` when a head asked for them, and logits
        [len(logits_indices), vocab] f32 or None)."""
        step = self._fused_step(meta, kv)
        if step is not None:  # the same ops in one kernel call
            out = step.forward(input_ids, positions, *fused.caches(kv), meta.slots, meta.q_start, meta.q_len,
                               meta.kv_len, meta.page_table, meta.page_size, fused.tree(meta.tree), logits_indices,
                               list(self.feature_layers))
            return out[0], (out[1] if len(out) > 1 else None)
        hidden, taps = self.forward_states(input_ids, positions, backend, kv, meta, self.feature_layers)
        # A head that reads several layers (EAGLE-3) gets them from this same pass: the
        # returned states are its features, the logits still come from the final hidden.
        states = torch.cat(taps, dim=-1) if taps else hidden
        if logits_indices is None:
            return states, None
        return states, self.compute_logits(hidden[logits_indices])

    def _fused_step(self, meta: Any, kv: KVPool):
        """The whole pass as one kernel call (kernels.model_step: the same kernels in the same
        order, so the same bits, without ~13 Python dispatches a layer, the GIL released
        throughout), where it applies: bf16 on the CPU backend, the exact or int8 matmuls, a
        single device's model with its own embedding and logits (not a tensor-parallel shard);
        made once and again when a weight changes; else None."""
        if (type(meta) is not CpuMetadata or type(kv) is not KVPool or self.linear not in (linear, int8_linear)
                or type(self) is not LlamaModel or "compute_logits" in self.__dict__ or "embed" in self.__dict__):
            return None

        def make():
            layers = self.layers
            if any(type(layer) is not DecoderLayer or layer.reduce is not None or layer.linear is not self.linear
                   for layer in layers):
                return None
            int8 = self.linear is int8_linear
            return kernels.model_step(self.embed_tokens, [kernels.layer_step(layer, int8) for layer in layers],
                                      self.norm.weight, kernels.packed_matmul(self.lm_head, int8), self.rope.cos,
                                      self.rope.sin, self.norm.eps)

        # A drafter's embedding and lm_head are the target's, which may be replaced: their ids.
        return fused.kept_step(self, (id(self.embed_tokens), id(self.lm_head)), self._fused_tensors, make)

    def _fused_tensors(self) -> list[torch.Tensor]:
        """Every tensor the fused pass reads (the weights, a drafter's shared embedding and
        lm_head, the rotary table)."""
        return list(self.parameters()) + [self.embed_tokens, self.lm_head, self.rope.cos, self.rope.sin]

    def forward_states(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                       kv: KVPool, meta: Any, layers: tuple[int, ...] = ()
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(hidden [T, hidden] after the final norm, [output of decoder layer i, for i in layers])."""
        x = self.embed(input_ids)
        rope = self.rope.lookup(positions)
        taps = []
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, backend, kv, meta)
            if i in layers:
                taps.append(x)
        return self.norm(x), taps

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] i64 → [T, hidden]."""
        return self.embed_tokens[input_ids]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] f32."""
        return logits_linear(hidden, self.lm_head, self.linear)

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        c = self.cfg
        return KVPool(c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim,
                      self.dtype, self.embed_tokens.device)

    # -- weights -------------------------------------------------------------------------

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' LlamaForCausalLM / Qwen2ForCausalLM."""
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        with torch.no_grad():
            if not self.shares_embeddings:
                self.embed_tokens.copy_(sd["embed_tokens.weight"])
                if not self.cfg.tie_word_embeddings:
                    self.lm_head.copy_(sd["lm_head.weight"])
            self.norm.weight.copy_(sd["norm.weight"])
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                attn = [sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
                layer.qkv_proj.copy_(torch.cat(attn))
                if layer.qkv_bias is not None:
                    layer.qkv_bias.copy_(torch.cat([sd[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
                layer.o_proj.copy_(sd[p + "self_attn.o_proj.weight"])
                layer.gate_up_proj.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                    sd[p + "mlp.up_proj.weight"]]))
                layer.down_proj.copy_(sd[p + "mlp.down_proj.weight"])
                layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
                layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers (outputs of layers 2, L/2 and L-3)."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


def load_llama(model_dir, dtype: torch.dtype, device: torch.device | str = "cpu",
               matmul: str = "exact") -> LlamaModel:
    """Build a LlamaModel from a Hugging Face style directory (config.json + safetensors)."""
    from overlap.models.loading import load_state_dict, read_model_config

    if matmul not in MATMULS:  # the target's weights decide the output: never quantized
        raise ValueError(f"a target's matmul must be one of {MATMULS}, got {matmul!r} "
                         "(int8 is for drafters: spec.drafter_weights)")
    model = LlamaModel(ModelConfig.from_hf(read_model_config(model_dir)), dtype, device, matmul=matmul)
    model.load_hf_state_dict(load_state_dict(model_dir, dtype))
    return model.eval()
