"""Our forward equals transformers' LlamaForCausalLM / Qwen2ForCausalLM on the same weights."""

import pytest
import torch

from helpers import dense_forward, hf_model, our_model, tiny_hf_config


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("tie", [True, False])
def test_matches_transformers_fp32(heads, kv_heads, tie):
    cfg = tiny_hf_config(heads=heads, kv_heads=kv_heads, tie=tie)
    hf = hf_model(cfg)
    ours = our_model(hf, cfg)
    ids = torch.randint(0, cfg["vocab_size"], (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    _, logits = dense_forward(ours, ids, page_size=16)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["qwen2_bias", "llama3_rope", "linear_rope"])
def test_matches_transformers_variants(variant):
    if variant == "qwen2_bias":
        cfg = tiny_hf_config(model_type="qwen2", tie=False)
    elif variant == "llama3_rope":
        cfg = tiny_hf_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    else:
        cfg = tiny_hf_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf = hf_model(cfg)
    if variant == "qwen2_bias":
        assert any("q_proj.bias" in k for k in hf.state_dict())
    ours = our_model(hf, cfg)
    ids = list(range(3, 103))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    _, logits = dense_forward(ours, ids, page_size=7)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_bf16_close_to_fp32():
    cfg = tiny_hf_config()
    hf = hf_model(cfg)
    ids = list(range(5, 60))
    _, ref = dense_forward(our_model(hf, cfg), ids)
    _, low = dense_forward(our_model(hf, cfg, torch.bfloat16), ids)
    assert (low - ref).abs().max() < 0.1 * ref.abs().max()
