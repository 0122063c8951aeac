"""build_proposer: the configured drafter (SpecConfig.method) around a loaded target.

Its own module so the executor knows only the Proposer interface, not every drafter's
constructor and files.
"""

from __future__ import annotations

import torch

from overlap import kernels
from overlap.attention import make_backend
from overlap.config import BRANCHED_METHODS, HEAD_METHODS, EngineConfig, lookup_match, tree_tokens
from overlap.models.heads import load_head
from overlap.models.llama import LlamaModel
from overlap.speculative.base import Proposer
from overlap.speculative.draft_target import DraftTargetProposer, load_draft
from overlap.speculative.eagle import DynamicEagleProposer, EagleProposer
from overlap.speculative.lookup_branch import LookupBranch
from overlap.speculative.mtp import MTPProposer
from overlap.speculative.ngram import NgramProposer
from overlap.speculative.tree import TreeShape


def drafter_matmul(config: EngineConfig, model: LlamaModel) -> str | None:
    """The drafter's matmul (llama.matmul_fn) for spec.drafter_weights: "int8", which needs
    the CPU kernel's case (a bf16 target on the CPU), or None for bf16 (each drafter's own
    default). "auto" takes int8 wherever overlap's int8 kernel has a SIMD build (any x86 CPU
    with AVX2): a drafter step at batch 1 is bound by its weight reads, and int8 halves them.
    Measured in the engine on the integer (AVX512-VNNI) path of a Zen 4 (mtp:3 1.34x -> 1.52x)
    and on the f32-widening AVX2 path of a Zen 3 (1.31x -> 1.43x: its 15 GB/s leaves the
    widening's extra work hidden under the weight stream); the AVX512F build is the AVX2
    arithmetic in wider vectors (not measured on such a machine). The scalar build keeps bf16."""
    weights = config.spec.drafter_weights
    if weights not in ("auto", "bf16", "int8"):
        raise ValueError(f"spec.drafter_weights must be auto, bf16 or int8, got {weights!r}")
    runs = model.dtype == torch.bfloat16 and model.embed_tokens.device.type == "cpu"
    if weights == "int8" and not runs:
        raise ValueError("drafter_weights int8 runs on the CPU with bf16 models (overlap's int8 kernel); "
                         f"this target is {str(model.dtype).removeprefix('torch.')} on "
                         f"{model.embed_tokens.device.type}: use bf16 or auto")
    return "int8" if weights == "int8" or (weights == "auto" and runs and kernels.variant() >= 0) else None


def build_proposer(config: EngineConfig, model: LlamaModel, scratch_page: int | None = None) -> Proposer | None:
    spec = config.spec
    if spec.lookup_branch < 0 or (spec.lookup_branch and spec.method not in BRANCHED_METHODS):
        raise ValueError(f"spec.lookup_branch {spec.lookup_branch}: a lookup branch is verified beside a model "
                         f"drafter's drafts (draft, mtp or eagle), not with {spec.method!r}; 0 turns it off")
    if spec.lookup_branch > 16 or (spec.method == "eagle" and spec.tree_depth > 16):
        # The CPU attention kernel sums a tree row's older values on AMX tiles only up to 16
        # tokens off the row's leading path (attention.cpp, VALUE_MARGIN), and refuses more.
        raise ValueError(f"spec.lookup_branch {spec.lookup_branch} / tree_depth {spec.tree_depth}: "
                         "branches and trees are verified at most 16 tokens deep")
    if spec.lookup_min_match < 1:
        raise ValueError(f"spec.lookup_min_match {spec.lookup_min_match}: the branch needs a match of >= 1 token")
    if not 1 <= spec.ngram_min <= spec.ngram_max:
        # An empty suffix "matches" one token back: every lookup would copy the last token.
        raise ValueError(f"spec.ngram_min {spec.ngram_min} / ngram_max {spec.ngram_max}: lookups match "
                         "1 <= ngram_min <= ngram_max tokens")
    if spec.method == "none":
        return None
    if spec.method == "ngram":
        return NgramProposer(model.cfg.vocab_size, config.device, spec.ngram_min, spec.ngram_max)
    if spec.method == "draft":
        if not spec.draft_model:
            raise ValueError("spec method 'draft' needs spec.draft_model (a draft directory)")
        draft = load_draft(spec.draft_model, model, drafter_matmul(config, model))
        return _with_branch(spec, DraftTargetProposer(draft, make_backend(config.attention_backend, config.device),
                                                      config.cache.num_pages, config.cache.page_size, scratch_page))
    if spec.method in HEAD_METHODS:
        return _with_branch(spec, _head_proposer(config, model, scratch_page))
    raise ValueError(f"unknown spec method {spec.method!r} (none | draft | ngram | mtp | eagle)")


def _with_branch(spec, proposer: Proposer) -> Proposer:
    """The proposer with its lookup branch (spec.lookup_branch tokens; 0: none)."""
    if not spec.lookup_branch:
        return proposer
    return LookupBranch(proposer, spec.lookup_branch, *lookup_match(spec))


def _head_proposer(config: EngineConfig, model: LlamaModel, scratch_page: int | None) -> Proposer:
    spec = config.spec
    if not spec.head:
        raise ValueError(f"spec method {spec.method!r} needs spec.head (an MTP head directory)")
    head = load_head(spec.head, model, draft_vocab=spec.draft_vocab, matmul=drafter_matmul(config, model) or "exact")
    # A multi-layer (EAGLE-3) head reads several target layers: the target's forward returns
    # them from the same pass (no extra pass, no host copy), in place of its final hidden.
    model.feature_layers = head.feature_layers
    backend = make_backend(config.attention_backend, config.device)
    pages = (config.cache.num_pages, config.cache.page_size)
    if spec.method == "mtp":
        return MTPProposer(head, backend, *pages, scratch_page)
    if spec.tree == "dynamic":
        return DynamicEagleProposer(head, backend, *pages, spec.tree_depth, spec.tree_topk, tree_tokens(config),
                                    scratch_page)
    shape = TreeShape.default(spec.tree_depth, spec.tree_topk, tree_tokens(config))
    return EagleProposer(head, backend, *pages, shape, scratch_page)
