"""MTP head: one decoder layer that drafts the next token from a token AND the target's hidden
state (DeepSeek-V3's multi-token prediction module; EAGLE's feature-level drafter).

Alignment (what the runtime relies on). Let x_0 x_1 ... be a sequence's tokens and H_j the
target's output at position j: the `hidden` LlamaModel.forward returns, AFTER the target's
final norm (so lm_head(H_j) are the target's logits for x_{j+1}).

    head row j:  input token x_{j+1}, input hidden H_j, position j, KV slot of position j
                 → logits for x_{j+2}, head hidden g_j

The token stream is shifted one left relative to the hidden states (docs/architecture.md §5). The head's
KV pool is indexed by the target's page table: its KV for row j lives in the slot of
position j. A chain of k > 1 drafts feeds g_j back in place of the missing target hidden:
row j+1 pairs the first draft with g_j, and so on. The KV-fill run after verification goes
over the accepted tokens with the target's own (more exact) hidden states.

Layout (norms=True, the default; names are the state-dict keys):

    e = norm_embed(embed(x))           target's embedding, shared and frozen
    h = norm_hidden(H)
    z = fuse @ cat[e, h]               fuse [hidden, 2*hidden], no bias
    g = norm(layer(z))                 one DecoderLayer of the target's architecture
    logits = lm_head(g)                target's lm_head, shared and frozen

norms=False is the original EAGLE-1 layout for the ablation: no norm on e and h before the
fuse and no final norm (g is the layer output; the layer keeps its own input norms).
The head hidden g is what the chain feeds back: like H, it is the vector the lm_head reads,
and training regresses g_j onto H_{j+1}.

One module serves both sides. `forward` is the inference path (paged KV, attention through
the backend, batch-invariant `linear`, under inference_mode). `forward_dense` is the training
path over [B, L] windows with dense causal attention (and the extra keys of a chained
evaluation); it reads the same parameters, so a trained state dict is the inference head.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from overlap import kernels
from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.attention.cpu import CpuBackend, CpuMetadata
from overlap.config import ModelConfig
from overlap.device import upload
from overlap.kv import KVPool
from overlap.models import fused
from overlap.models.llama import (DecoderLayer, LlamaModel, RMSNorm, int8_linear, linear, logits_linear, matmul_fn,
                                  spread_vocabulary)
from overlap.models.rope import RotaryTable, rotate

HEAD_TYPE = "mtp"


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, target: LlamaModel, norms: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 feature_layers: tuple[int, ...] = (), matmul: str = "exact"):
        """cfg: the target's architecture (any num_layers: the head has one layer).
        target: lends its embed_tokens and lm_head (plain attributes: neither owned nor saved).
        dtype/device default to the target's. feature_layers: read those target layers'
        outputs (EAGLE-3) through `reduce` instead of the target's final hidden state.
        matmul: the inference matmuls (llama.matmul_fn), "int8" for weight-only int8."""
        super().__init__()
        if cfg.hidden_size != target.cfg.hidden_size or cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(f"head (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not fit the "
                             f"target (hidden {target.cfg.hidden_size}, vocab {target.cfg.vocab_size})")
        self.cfg = dataclasses.replace(cfg, num_layers=1)
        self.norms = norms
        h = cfg.hidden_size
        dtype = dtype or target.dtype
        device = device or target.embed_tokens.device
        if norms:
            self.norm_embed = RMSNorm(h, cfg.rms_norm_eps)
            self.norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.feature_layers = tuple(feature_layers)
        if self.feature_layers:
            # EAGLE-3: low, middle and high layers' outputs, concatenated, down to one vector.
            self.reduce = nn.Parameter(torch.empty(h, len(self.feature_layers) * h))
        self.fuse = nn.Parameter(torch.empty(h, 2 * h))
        self.linear = matmul_fn(matmul)
        self.layer = DecoderLayer(self.cfg, 0, matmul)  # layer 0 of the head's own one-layer KV pool
        if norms:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.to(dtype=dtype, device=device)
        # Plain attributes, not registered: the target owns (and saves) them; the head shares them frozen.
        object.__setattr__(self, "embed_tokens", target.embed_tokens)
        object.__setattr__(self, "lm_head", target.lm_head)
        self.rope = RotaryTable(self.cfg, dtype, device)
        self.vocab_ids = None  # [N] i64: a trimmed draft vocabulary (trim_vocabulary), or None

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.dtype

    def target_input(self, states: torch.Tensor) -> torch.Tensor:
        """The target's states as the target's forward returned them ([T, F * hidden] layer
        features for a multi-layer head, else [T, hidden] H) → the [T, hidden] vector the head
        reads in place of H. A chain's own head hidden g needs no such step."""
        if not self.feature_layers:
            return states
        return self.linear(states.to(self.dtype), self.reduce)

    def trim_vocabulary(self, vocab_ids: torch.Tensor) -> None:
        """Score only these tokens when drafting (FR-Spec): the lm_head read per draft step
        shrinks from V to N rows, the largest part of a head step. Other tokens get -inf, so
        the head never drafts them; the target still verifies over the full vocabulary, so
        the output does not change, only how often drafts are accepted."""
        self.vocab_ids = vocab_ids.to(torch.long).sort().values.to(self.lm_head.device)
        # A gathered copy of the shared lm_head's rows: [N, hidden], a few MB.
        object.__setattr__(self, "lm_rows", self.lm_head[self.vocab_ids].contiguous())

    # -- inference ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, kv: KVPool, meta: Any,
                logits_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [T] i64 (x_{j+1}), target_hidden [T, hidden] (H_j, or the head hidden of the
        previous chain step), positions [T] i64 (j) → (head hidden [T, hidden] in the head's
        dtype, logits [len(logits_indices), vocab] f32 or None). meta.slots are the slots of j."""
        step = self._fused_step(isinstance(meta, CpuMetadata))
        if step is not None:
            return self._forward_fused(step, input_ids, target_hidden, positions, kv, meta, logits_indices)
        e = self.embed_tokens[input_ids].to(self.dtype)
        h = target_hidden.to(self.dtype)
        if self.norms:
            e, h = self.norm_embed(e), self.norm_hidden(h)
        x = self.linear(torch.cat([e, h], dim=-1), self.fuse)
        x = self.layer(x, self.rope.lookup(positions), backend, kv, meta)
        hidden = self.norm(x) if self.norms else x
        if logits_indices is None:
            return hidden, None
        return hidden, self.compute_logits(hidden[logits_indices])

    def forward_rows(self, input_ids: torch.Tensor | list[int], target_hidden: list[torch.Tensor],
                     positions: list[int], seqs: list[SeqAttention], rows: list[int], backend: AttentionBackend,
                     kv: KVPool, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` from the step's lists, as the proposers hold them: input_ids [T] (a tensor
        or a list), target_hidden in parts ([n, hidden] or one row [hidden], in the rows'
        order) → (head hidden at `rows` [R, hidden], logits there [R, vocab] f32). On the CPU
        backend the fused call plans the attention itself: no plan object, no uploads, no
        concatenation in Python, one call without the GIL."""
        step = self._fused_step(isinstance(backend, CpuBackend))
        if step is not None:
            hidden = [h if h.dtype == self.dtype else h.to(self.dtype) for h in target_hidden]
            g, logits = step.forward_seqs(input_ids, hidden, positions, *fused.caches(kv),
                                           [s.q_len for s in seqs], [s.kv_len for s in seqs],
                                           [s.page_table for s in seqs], [s.tree_mask for s in seqs], page_size, rows)
            return g, logits
        c = self.cfg
        device = target_hidden[0].device
        if not isinstance(input_ids, torch.Tensor):
            input_ids = upload(device, (input_ids, torch.long))[0]
        hidden = torch.cat([h.view(-1, h.shape[-1]) for h in target_hidden])
        meta = backend.plan(seqs, page_size, c.num_heads, c.num_kv_heads, c.head_dim, self.dtype)
        pos, picked = upload(device, (positions, torch.long), (rows, torch.long))
        g, logits = self(input_ids, hidden, pos, backend, kv, meta, picked)
        return g[picked], logits

    def expand_tree(self, plan, root_logits: torch.Tensor, root_hidden: torch.Tensor, start_pos: list[int],
                    page_tables: list[list[int]], backend: AttentionBackend, kv: KVPool,
                    page_size: int) -> torch.Tensor | None:
        """An EAGLE tree's expansion (EagleProposer.propose_tree) in one call where the fused
        call applies: its levels' top-ranked tokens and head calls in C++ (head_step.cpp,
        expand_tree: the same calls in the same order, so the same tokens), without ~20 torch
        calls and their Python a step. plan: () → kernels.tree_plan, asked for only here.
        → node tokens [B, N] i64, or None where the fused call does not apply."""
        step = self._fused_step(isinstance(backend, CpuBackend))
        if step is None:
            return None
        return step.expand_tree(plan(), root_logits, root_hidden, start_pos, page_tables, *fused.caches(kv),
                                page_size)

    def _fused_step(self, cpu_attention: bool):
        """The whole forward as one kernel call (kernels.head_step: the same kernels in the same
        order, so the same bits, without ~25 Python dispatches, the GIL released throughout),
        where it applies: bf16 on the CPU backend, the exact or int8 matmuls, a single device's
        head. Made once and made again when a weight changes in place (its version counter
        moves); else None."""
        if not cpu_attention or self.linear not in (linear, int8_linear) or self._sharded():
            return None

        def make():
            int8 = self.linear is int8_linear
            lm = self.lm_head if self.vocab_ids is None else self.lm_rows
            norm = (lambda name: getattr(self, name).weight) if self.norms else (lambda name: None)
            return kernels.head_step(self.embed_tokens, norm("norm_embed"), norm("norm_hidden"),
                                     kernels.packed_matmul(self.fuse, int8), kernels.layer_step(self.layer, int8),
                                     kernels.packed_matmul(lm, int8), norm("norm"), self.rope.cos, self.rope.sin,
                                     self.vocab_ids, self.cfg.vocab_size, self.cfg.rms_norm_eps)

        # The shared tensors and the trimmed vocabulary may be replaced: their ids.
        identity = (id(self.embed_tokens), id(self.lm_head), id(self.vocab_ids))
        return fused.kept_step(self, identity, self._fused_tensors, make)

    def _sharded(self) -> bool:
        """A tensor-parallel rank's head (models/tp.py, load_head_sharded): its layer's outputs
        are all-reduced across the ranks and its embedding and logits are vocab-parallel, which
        the single-device fused call does not do."""
        return (self.layer.reduce is not None or not isinstance(self.embed_tokens, torch.Tensor)
                or "compute_logits" in self.__dict__)

    def _fused_tensors(self) -> list[torch.Tensor]:
        """Every tensor the fused call reads from the head (its weights, the shared embedding
        and lm_head, the rotary table)."""
        out = list(self.parameters()) + [self.embed_tokens, self.lm_head, self.rope.cos, self.rope.sin]
        return out if self.vocab_ids is None else out + [self.lm_rows]

    def _forward_fused(self, step, input_ids: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                       kv: KVPool, meta: CpuMetadata, logits_indices: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = step.forward(input_ids, target_hidden.to(self.dtype), positions, *fused.caches(kv), meta.slots,
                            meta.q_start, meta.q_len, meta.kv_len, meta.page_table, meta.page_size, fused.tree(meta.tree),
                            logits_indices)
        return out[0], (out[1] if len(out) > 1 else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → logits [N, vocab] f32 (through the target's lm_head; -inf
        outside a trimmed vocabulary)."""
        hidden = hidden.to(self.lm_head.dtype)
        if self.vocab_ids is None:
            return logits_linear(hidden, self.lm_head, self.linear)
        return spread_vocabulary(logits_linear(hidden, self.lm_rows, self.linear), self.vocab_ids,
                                 self.cfg.vocab_size)

    def new_kv_pool(self, num_pages: int, page_size: int) -> KVPool:
        c = self.cfg
        return KVPool(1, num_pages, page_size, c.num_kv_heads, c.head_dim, self.dtype, self.fuse.device)

    # -- training -------------------------------------------------------------------------

    def forward_dense(self, input_ids: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
                      past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Training / evaluation forward over windows, with autograd.

        input_ids [B, L] i64, hidden_in [B, L, hidden] (H or a chain's g) or [B, L, F * hidden]
        (a multi-layer head's target features, reduced here), positions [B, L] or [L] i64
        → (head hidden [B, L, hidden], this step's (k, v) [B, L, kv_heads, head_dim]).

        past=None: one causal pass (row j sees rows 0..j), the same as a paged prefill.
        past=[(k1, v1), ..., (k_{s-1}, v_{s-1})]: step s of a chain evaluated for every start at
        once. Row j of step s is the chain that started at row j; it sees step 1's keys of rows
        0..j and its own chain's keys of steps 2..s (column j of each later step): exactly the
        KV a paged chain would hold.
        """
        e = self.embed_tokens[input_ids]
        h = hidden_in
        if self.feature_layers and h.shape[-1] != self.cfg.hidden_size:  # target features, not g
            h = _dense_linear(h, self.reduce)
        if self.norms:
            e, h = self.norm_embed(e), self.norm_hidden(h)
        x = _dense_linear(torch.cat([e.to(h.dtype), h], dim=-1), self.fuse)
        x, kv = _dense_layer(self.layer, x, self.rope, positions, past)
        return (self.norm(x) if self.norms else x), kv

    def dense_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] → logits [..., vocab] (autograd flows to hidden, not lm_head)."""
        weight = self.lm_head
        if not torch.is_autocast_enabled(hidden.device.type) and hidden.dtype != weight.dtype:
            # f32 training / evaluation: one f32 copy of the frozen lm_head, kept (casting it per
            # call copied 113 MB for SmolLM2 every time: most of an evaluation's time).
            cached = getattr(self, "_lm_head_cast", None)
            if cached is None or cached[0] is not weight or cached[1].dtype != hidden.dtype:
                cached = (weight, weight.detach().to(hidden.dtype))
                self._lm_head_cast = cached
            weight = cached[1]
        return _dense_linear(hidden, weight)


def _dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Under autocast F.linear casts both sides itself; casting the (bf16) shared lm_head to an
    # f32 x first would copy 100+ MB per call for nothing.
    if torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight)
    return F.linear(x, weight.to(x.dtype))


def _dense_layer(layer: DecoderLayer, x: torch.Tensor, rope: RotaryTable, positions: torch.Tensor,
                 past: list[tuple[torch.Tensor, torch.Tensor]] | None):
    """DecoderLayer.forward over [B, L, hidden] with dense attention (same weights and op order)."""
    b, n, _ = x.shape
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q_size, kv_size, _ = layer.split
    cos, sin = rope.cos[positions], rope.sin[positions]  # [B, L, D] or [L, D]
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    qkv = F.linear(layer.input_layernorm(x), layer.qkv_proj.to(x.dtype),
                   None if layer.qkv_bias is None else layer.qkv_bias.to(x.dtype))
    qk = rotate(qkv[..., : q_size + kv_size].reshape(b, n, heads + kv_heads, dim), cos, sin)
    q, k = qk[..., :heads, :], qk[..., heads:, :]
    v = qkv[..., q_size + kv_size:].reshape(b, n, kv_heads, dim)
    keys, values = [k], [v]
    if past:
        keys, values = [p[0] for p in past] + keys, [p[1] for p in past] + values
    # Mask [L, steps * L]: causal over step 1's keys, the diagonal over each later step's keys.
    rows = torch.arange(n, device=x.device)
    causal = rows[None, :] <= rows[:, None]
    diagonal = rows[None, :] == rows[:, None]
    mask = torch.cat([causal] + [diagonal] * (len(keys) - 1), dim=1)
    group = heads // kv_heads
    kk = torch.cat(keys, dim=1).repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, S, D]
    vv = torch.cat(values, dim=1).repeat_interleave(group, dim=2).transpose(1, 2)
    attn = F.scaled_dot_product_attention(q.transpose(1, 2), kk.to(q.dtype), vv.to(q.dtype), attn_mask=mask)
    x = x + F.linear(attn.transpose(1, 2).reshape(b, n, heads * dim), layer.o_proj.to(x.dtype))
    gate, up = F.linear(layer.post_attention_layernorm(x), layer.gate_up_proj.to(x.dtype)).chunk(2, -1)
    return x + F.linear(F.silu(gate) * up, layer.down_proj.to(x.dtype)), (k, v)


# ---------------------------------------------------------------------------- persistence

def head_config_dict(cfg: ModelConfig, norms: bool, feature_layers: tuple[int, ...] = ()) -> dict:
    """config.json of a head: the target's architecture (HF field names, one layer) + head fields."""
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "head_type": HEAD_TYPE, "norms": norms, "feature_layers": list(feature_layers),
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    return out


def save_head(head: MTPHead, out_dir, extra: dict | None = None) -> Path:
    """Write config.json and model.safetensors (the head's own weights only, bf16)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"))
    cfg = {**head_config_dict(head.cfg, head.norms, head.feature_layers), **(extra or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def load_head(head_dir, target: LlamaModel, dtype: torch.dtype | None = None,
              draft_vocab: int | None = None, matmul: str = "exact") -> MTPHead:
    """An inference head for this target (its dtype and device unless dtype is given), its
    matmuls `matmul` (llama.matmul_fn: "int8" for weight-only int8).
    draft_vocab N > 0: the head scores only the N most frequent tokens of its training text
    (token_ranks.safetensors in head_dir, from tools/token_ranks.py); 0: every token; None:
    what the head's config.json says (`draft_vocab`, chosen by measurement for that head),
    else every token."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    raw = json.loads((head_dir / "config.json").read_text())
    if raw.get("head_type") != HEAD_TYPE:
        raise ValueError(f"{head_dir} is not an MTP head (head_type={raw.get('head_type')!r})")
    cfg = ModelConfig.from_hf(raw)
    if cfg.hidden_size != target.cfg.hidden_size or cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"MTP head {head_dir} (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) was "
                         f"trained for another target (hidden {target.cfg.hidden_size}, "
                         f"vocab {target.cfg.vocab_size})")
    layers = tuple(raw.get("feature_layers") or ())
    if layers and max(layers) >= target.cfg.num_layers:
        raise ValueError(f"MTP head {head_dir} reads target layers {list(layers)}; the target has "
                         f"{target.cfg.num_layers}")
    head = MTPHead(cfg, target, norms=bool(raw.get("norms", True)), dtype=dtype, feature_layers=layers,
                   matmul=matmul)
    sd = load_file(str(head_dir / "model.safetensors"))
    missing, unexpected = head.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"MTP head {head_dir}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    head.requires_grad_(False)
    if draft_vocab is None:
        draft_vocab = configured_draft_vocab(raw)
    if draft_vocab:
        head.trim_vocabulary(load_token_ranks(head_dir, cfg.vocab_size)[:draft_vocab])
    return head.eval()


def configured_draft_vocab(raw: dict) -> int:
    """The draft vocabulary a head's config.json names for runs that name none (0: every
    token): what load_head uses, and what the step-cost cache is keyed by."""
    return int(raw.get("draft_vocab") or 0)


def load_token_ranks(head_dir, vocab_size: int) -> torch.Tensor:
    """[V] i64 token ids, most frequent first (tools/token_ranks.py wrote them)."""
    from safetensors.torch import load_file

    path = Path(head_dir) / "token_ranks.safetensors"
    if not path.exists():
        raise ValueError(f"draft_vocab needs {path}: make it with `python tools/token_ranks.py --out {head_dir}`")
    ranked = load_file(str(path))["ranked_ids"].long()
    if ranked.numel() != vocab_size:
        raise ValueError(f"{path} ranks {ranked.numel()} tokens, the target has {vocab_size}")
    return ranked
