"""RequestLimits: the per-request speculation a server grants (no model needed)."""

from overlap.config import EngineConfig, ModelConfig, SpecConfig
from runtime.frontend import RequestLimits
from runtime.messages import SamplingParams

MODEL = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, max_position=64,
                    tie_word_embeddings=True)


def limits(**spec) -> RequestLimits:
    return RequestLimits.of(EngineConfig(spec=SpecConfig(**spec)), MODEL)


def test_fields_are_declared_before_the_methods_that_build_them():
    names = list(RequestLimits.__dataclass_fields__)
    assert names == ["vocab_size", "max_model_len", "num_pages", "page_size", "default_num_spec_tokens", "tree"]


def test_chain_drafters_use_the_request_k_or_the_default():
    lim = limits(method="mtp", num_spec_tokens=3)
    assert not lim.tree and lim.max_model_len == 64
    assert lim.num_spec_tokens(SamplingParams()) == 3
    assert lim.num_spec_tokens(SamplingParams(num_spec_tokens=1)) == 1
    assert lim.num_spec_tokens(SamplingParams(spec=False)) == 0


def test_eagle_verifies_the_whole_tree_unless_a_request_turns_it_off():
    lim = limits(method="eagle", tree_tokens=6)
    assert lim.tree and lim.default_num_spec_tokens == 6
    assert lim.num_spec_tokens(SamplingParams()) == 6
    assert lim.num_spec_tokens(SamplingParams(num_spec_tokens=2)) == 6
    assert lim.num_spec_tokens(SamplingParams(num_spec_tokens=0)) == 0


def test_no_speculation_grants_nothing():
    assert limits(method="none").num_spec_tokens(SamplingParams(num_spec_tokens=4)) == 0
