"""The in-process engine: continuous batching, chunked prefill, preemption, stop conditions."""

import random

import pytest

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig
from runtime.engine import Engine
from runtime.messages import RequestError, SamplingParams


def make_engine(model_dir, **kw) -> Engine:
    cache = CacheConfig(page_size=kw.pop("page_size", 16), num_pages=kw.pop("num_pages", 256))
    sched = SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 64),
                            max_batched_tokens=kw.pop("max_batched_tokens", 512))
    return Engine(EngineConfig(model=str(model_dir), cache=cache, scheduler=sched, **kw), progress=False)


def random_prompts(n, seed=0, lo=3, hi=90):
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_engine(tiny_dirs):
    return make_engine(tiny_dirs["target"])


def test_alone_equals_in_batch(tiny_dirs, tiny_engine):
    prompts = random_prompts(12)
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(12)]
    alone = [tiny_engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    # Small token budget: long prompts are chunked and mixed with other sequences' decodes.
    batched = make_engine(tiny_dirs["target"], max_batched_tokens=40).generate(prompts, params)
    assert [r.token_ids for r in batched] == alone
    assert all(len(r.token_ids) == sp.max_tokens for r, sp in zip(batched, params))


@pytest.mark.parametrize("page_size", [1, 16])
def test_preemption_keeps_greedy_output(tiny_dirs, tiny_engine, page_size):
    prompts = random_prompts(8, seed=1, lo=20, hi=40)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ample = [r.token_ids for r in tiny_engine.generate(prompts, params)]
    # 8 sequences of up to 70 tokens need ~560 slots; give far fewer so they preempt.
    tight = make_engine(tiny_dirs["target"], page_size=page_size, num_pages=160 // page_size + 8)
    results = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == ample
    assert tight.stats()["free_pages"] == tight.stats()["total_pages"]


def test_sampling_is_reproducible_with_seed_and_batch_invariant(tiny_engine):
    prompts = random_prompts(4, seed=2)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(4)]
    together = [r.token_ids for r in tiny_engine.generate(prompts, params)]
    alone = [tiny_engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
    other_seed = tiny_engine.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=1.0, seed=7,
                                                                   ignore_eos=True))[0]
    assert other_seed.token_ids != together[0]


def test_stop_conditions(tiny_engine):
    prompt = random_prompts(1, seed=3)[0]
    free = tiny_engine.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    # A stop token id ends the request on that token.
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    r = tiny_engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=[stop_id], ignore_eos=True))[0]
    assert r.finish_reason == "stop" and r.token_ids == free.token_ids[: first + 1]
    # A stop string cuts the text before it and ends the request.
    text = free.text
    needle = text[len(text) // 2: len(text) // 2 + 3]
    if needle.strip():
        r = tiny_engine.generate([prompt], SamplingParams(max_tokens=20, stop=[needle], ignore_eos=True))[0]
        assert r.finish_reason == "stop"
        assert r.text == text[: text.index(needle)]


def test_streaming_deltas_add_up(tiny_engine):
    prompt = random_prompts(1, seed=4)[0]
    deltas = list(tiny_engine.stream(prompt, SamplingParams(max_tokens=15, ignore_eos=True)))
    assert deltas[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in deltas[:-1])
    ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert len(ids) == 15
    assert text == tiny_engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_abort_frees_pages(tiny_engine):
    before = tiny_engine.stats()["free_pages"]
    ids = [tiny_engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
           for p in random_prompts(5, seed=5)]
    for _ in range(3):
        tiny_engine.step()
    assert tiny_engine.stats()["free_pages"] < before
    for i in ids:
        tiny_engine.abort(i)
        assert tiny_engine.pop_result(i).finish_reason == "abort"
    assert tiny_engine.stats()["free_pages"] == before
    assert not tiny_engine.has_work()


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ("hi", SamplingParams(max_tokens=0), "max_tokens"),
    ("hi", SamplingParams(temperature=-1.0), "temperature"),
    ("hi", SamplingParams(top_p=0.0), "top_p"),
    ([1, 2, 10**9], SamplingParams(), "prompt"),
    ("word " * 5000, SamplingParams(), "prompt"),
])
def test_bad_requests_are_refused_clearly(tiny_engine, prompt, params, field):
    with pytest.raises(RequestError) as err:
        tiny_engine.add_request(prompt, params)
    assert err.value.field == field
    assert not tiny_engine.has_work()
