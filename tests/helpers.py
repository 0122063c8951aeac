"""Shared helpers for tests: tiny random Llama-family models and one-shot forwards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from overlap.attention import ReferenceBackend, SeqAttention
from overlap.config import ModelConfig
from overlap.models.llama import LlamaModel


def tiny_hf_config(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, tie=True, bias=False,
                   model_type="llama", intermediate=128, rope_scaling=None, max_pos=1024) -> dict:
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": max_pos, "tie_word_embeddings": tie,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }
    if model_type == "llama":
        cfg["attention_bias"] = bias
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    return cfg


def hf_model(cfg: dict, seed: int = 0):
    """A transformers model with random weights for this config (float32)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random init makes near-uniform logits; scale up so argmax is well separated.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    return model.eval()


def save_hf_dir(model, cfg: dict, out: Path, tokenizer_dir: Path | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
                (out / f.name).write_bytes(f.read_bytes())
    return out


def our_model(hf, cfg: dict, dtype=torch.float32) -> LlamaModel:
    model = LlamaModel(ModelConfig.from_hf(cfg), dtype)
    model.load_hf_state_dict(hf.state_dict())
    return model.eval()


def dense_forward(model: LlamaModel, ids: list[int], page_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one sequence as a single prefill; returns (hidden [T, H], logits [T, V])."""
    pages = -(-len(ids) // page_size)
    kv = model.new_kv_pool(pages + 1, page_size)
    backend = ReferenceBackend()
    table = list(range(1, pages + 1))  # page 0 unused: catches off-by-one page indexing
    meta = backend.plan([SeqAttention(len(ids), len(ids), table)], page_size)
    t = torch.tensor(ids)
    return model(t, torch.arange(len(ids)), backend, kv, meta, torch.arange(len(ids)))


def random_head(target_dir, out, seed=0, norms=True):
    """An MTP head with random weights for this target, saved to `out` (greedy tests only
    need a head that drafts something; the statistical ones need it to be anything)."""
    from overlap.models.heads import MTPHead, save_head
    from overlap.models.llama import load_llama
    from overlap.models.loading import read_model_config

    target = load_llama(target_dir, torch.float32)
    head = MTPHead(ModelConfig.from_hf(read_model_config(target_dir)), target, norms=norms)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    return save_head(head, out)


def flashinfer_on_fakes(monkeypatch, decode_cls, prefill_cls, name: str):
    """overlap/attention/flashinfer.py loaded under `name` against stand-in wrapper classes
    (the real module and sys.modules["flashinfer"] are restored after the test), with
    unpinned host tensors: its planning code runs on a CPU-only torch."""
    import importlib.util
    import sys

    import numpy as np

    fake = type(sys)("flashinfer")
    fake.__version__ = "0.7.4"  # the version the module was written against
    fake.BatchDecodeWithPagedKVCacheWrapper = decode_cls
    fake.BatchPrefillWithPagedKVCacheWrapper = prefill_cls
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    path = Path(__file__).parents[1] / "overlap" / "attention" / "flashinfer.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # @dataclass looks its module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_pinned", lambda values, dtype: torch.from_numpy(
        np.asarray(values, dtype=module._NP_DTYPES[dtype])))
    return module
