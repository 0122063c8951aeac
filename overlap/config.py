"""Frozen configuration, loaded from TOML once; each component receives only its part."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one Llama-family model (Llama, SmolLM, Qwen2), read from config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        arch = hf.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {arch!r}: overlap runs Llama-family models")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        scaling = hf.get("rope_scaling")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0),
            max_position=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # Qwen2 has q/k/v biases without saying so in config.json.
            attention_bias=hf.get("attention_bias", arch == "qwen2"),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int = 1024  # shared by every sequence; the draft pool uses the same page ids
    # Full pages stay cached after their request ends and are shared by requests with the same
    # prefix (runtime/prefix_cache.py); evicted least-recently-used when pages run out.
    prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_batched_tokens: int = 512  # prefill chunks are cut to fit this budget
    max_model_len: int = 4096  # prompt + output; capped by the model's max_position


# The drafters a lookup branch rides with (spec.lookup_branch): the model drafters
# (overlap/speculative/lookup_branch.py); n-gram is itself a lookup.
BRANCHED_METHODS = ("draft", "mtp", "eagle")
# The drafters that are the MTP head (a chain) or its EAGLE trees: a head directory, a draft
# vocabulary, rows that read the target's hidden states.
HEAD_METHODS = ("mtp", "eagle")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "none"  # none | draft | ngram | mtp | eagle
    num_spec_tokens: int = 4
    draft_model: str | None = None  # draft-target: the draft model's directory
    head: str | None = None  # mtp / eagle: the MTP head's directory (tools/train_mtp.py)
    tree_depth: int = 3  # eagle: levels below the root
    tree_topk: int = 2  # eagle: children per node at most
    # eagle: nodes verified per step; None: the size measured best where the tree is verified
    # (default_tree_tokens: 7 on AMX CPUs and GPUs, 5 on the other CPUs).
    tree_tokens: int | None = None
    tree: str = "static"  # eagle: static (fixed shape) | dynamic (EAGLE-2)
    # mtp / eagle: the head scores only the N most frequent tokens (0: the full vocabulary;
    # None: the head's own choice, its config's `draft_vocab`, 4,096 for the shipped head);
    # verification stays over the full vocabulary, so outputs do not change.
    draft_vocab: int | None = None
    # draft / mtp / eagle: the drafter's own weights (decoder layers, fusion matmuls, its
    # lm_head rows) as they are (bf16), or int8 (one scale per output row: steps read half the
    # bytes; CPU only); auto = int8 where it was measured to pay (a bf16 target on an
    # AVX512_BF16 or AMX CPU), else bf16. The target is never quantized: outputs do not change.
    drafter_weights: str = "auto"  # auto | bf16 | int8
    ngram_min: int = 1
    ngram_max: int = 3
    # draft / mtp / eagle: up to this many tokens of prompt lookup (a suffix match of lookup_min_match..ngram_max
    # tokens) verified beside the drafter's drafts as one more branch of the step's tree (0: none;
    # overlap/speculative/lookup_branch.py). Outputs do not change.
    lookup_branch: int = 0
    # ... taken only where the context's last lookup_min_match tokens (or more, up to
    # ngram_max) occurred before: 1-token matches are found on twice as many steps and add
    # little (dev replay: code 3.15 -> 3.14, chat 2.26 -> 2.22 tokens a step at n >= 2, with
    # branches on 0.49 / 0.26 of the steps instead of 0.73 / 0.49), and every branch costs rows.
    lookup_min_match: int = 2
    # on: a cost-model controller chooses each sequence's drafts (or tree) per step, never
    # more than its cap (overlap/speculative/controller.py); off: every step verifies the cap.
    controller: str = "on"  # on | off
    # The controller's step-cost curve: a JSON from `overlap bench --step-costs --json` (None:
    # measured at start-up with a few forwards and cached under ~/.cache/overlap/step_costs).
    step_costs: str | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the shipped SmolLM2-135M-Instruct GGUF
    dtype: str = "bfloat16"
    device: str = "cpu"
    attention_backend: str = "auto"  # auto | cpu | reference | torch | flashinfer
    # bf16 matmuls on the CPU: exact = overlap's batch-invariant kernel (the contract of
    # docs/architecture.md); fast = oneDNN as it chooses, NOT batch-invariant (a named
    # option for throughput comparisons, never the default).
    matmul: str = "exact"  # exact | fast
    overlap: bool = True  # plan step N+1 while the device runs step N's drafter catch-up
    tensor_parallel: int = 1  # ranks the target is sharded over (torch.distributed; gloo on CPU)
    tp_timeout_s: float = 60.0  # a collective waiting longer than this fails (a rank died)
    # Decode, draft and verify steps padded to batch-size buckets and replayed as CUDA graphs:
    # auto = on CUDA only; on = also pad on the CPU (eager: what the graphs replay, for tests).
    graphs: str = "auto"  # auto | on | off
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    @property
    def use_graphs(self) -> bool:
        if self.graphs not in ("auto", "on", "off"):
            raise ValueError(f"graphs must be auto, on or off, got {self.graphs!r}")
        return self.graphs == "on" or (self.graphs == "auto" and self.device.startswith("cuda"))

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def default_tree_tokens(device: str) -> int:
    """EAGLE's tree size where spec.tree_tokens is unset, by what verifies the tree.

    7 nodes on an AMX CPU: with the root and an 8-token lookup branch, 16 rows, one AMX row
    tile of the bf16 matmuls, and since attention sums old values on tiles 7 ran 1.2-1.4%
    faster than 5 at batch 1, paired (docs/mtp_eagle.md, "Session 26"). On a GPU too, which
    verifies 9-16 rows at about one row's cost. 5 on the other CPUs: their matmuls tile 6
    rows (overlap/kernels/linear_bf16.cpp), which 5 nodes and the root fill, where 7 take a
    second tile; on an AMD EPYC Zen 5 (avx512bf16) 5 nodes ran 4% faster than 7 fixed in two
    runs and 1.00-1.03x with the controller (docs/mtp_eagle.md, "Session 32")."""
    if device.startswith("cuda"):
        return 7
    from overlap.kernels import VARIANTS, machine_variant

    return 7 if VARIANTS[machine_variant()][0] == "amx" else 5


def tree_tokens(config: EngineConfig) -> int:
    """The EAGLE tree's nodes this engine verifies: spec.tree_tokens, else the device's default."""
    if config.spec.tree_tokens is not None and config.spec.tree_tokens < 1:
        raise ValueError(f"spec.tree_tokens must be at least 1, got {config.spec.tree_tokens}")
    return config.spec.tree_tokens or default_tree_tokens(config.device)


def lookup_match(spec: SpecConfig) -> tuple[int, int]:
    """The shortest and longest suffix n-gram a lookup branch matches (lookup_min_match ..
    ngram_max, never below the shortest): the drafter's lookup and the scheduler's, which
    prices the branch before the drafter verifies it, must find the same tokens."""
    return spec.lookup_min_match, max(spec.ngram_max, spec.lookup_min_match)


def check_device(device: str, attention_backend: str = "auto") -> None:
    """Fail with one clear sentence, before any model loads, when the device or the attention
    backend asked for cannot run here (else torch fails mid-load, or FlashInfer at the first step)."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if attention_backend not in ("auto", "cpu", "reference", "torch", "flashinfer"):
        raise ValueError("attention backend must be auto, cpu, reference, torch or flashinfer, "
                         f"got {attention_backend!r}")
    if attention_backend == "cpu" and kind == "cuda":
        raise ValueError("the cpu attention backend runs on the CPU only (use flashinfer or torch on cuda)")
    if kind == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device {device}: no CUDA device is available (torch {torch.__version__}, {build}); "
                             "install a CUDA build of torch, or use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    if attention_backend == "flashinfer":
        if kind != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device (--device cuda)")
        import importlib.util

        if importlib.util.find_spec("flashinfer") is None:
            raise ValueError("the flashinfer attention backend needs FlashInfer: pip install -e \".[gpu]\"")


_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}


def config_from_dict(raw: dict) -> EngineConfig:
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"unknown config keys: {sorted(unknown)}")
    values = dict(raw)
    for name, cls in _SECTIONS.items():
        section = values.get(name, {})
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = set(section) - fields
        if bad:
            raise ValueError(f"unknown keys in [{name}]: {sorted(bad)}")
        values[name] = cls(**section)
    return EngineConfig(**values)


def default_draft_dir() -> Path:
    """The distilled draft shipped for the default model (built by tools/distill_draft.py)."""
    return Path(__file__).parent / "assets" / "smollm2-135m-draft"


def default_head_dir() -> Path:
    """The MTP head shipped for the default model (built by tools/train_mtp.py)."""
    return Path(__file__).parent / "assets" / "smollm2-135m-mtp"


def load_config(path: str | Path) -> EngineConfig:
    """An EngineConfig from a TOML file. Relative paths in it (`model`, `spec.draft_model`,
    `spec.head`) are relative to the file itself, as in a Makefile or pyproject.toml, so a
    config means the same files whatever directory the command runs from."""
    path = Path(path)
    with path.open("rb") as f:
        raw = tomllib.load(f)
    spec = raw.get("spec", {})
    if spec.get("method") == "eagle" and "num_spec_tokens" in spec:
        # A tree step verifies tree_tokens nodes; a chain length would be silently ignored.
        raise ValueError(f"{path}: [spec] num_spec_tokens does not apply to method \"eagle\"; "
                         "shape the tree with tree_depth, tree_topk and tree_tokens")
    base = path.resolve().parent
    for section, key in ((raw, "model"), (spec, "draft_model"), (spec, "head"), (spec, "step_costs")):
        if section.get(key):  # an absolute (or ~) path stays what it is
            section[key] = str((base / Path(section[key]).expanduser()).resolve())
    return config_from_dict(raw)
