"""MTP speculation through the engine: greedy exactness (k = 1 no-sync and k = 3 chains, batch
1/4/16, preemption), the target distribution under sampling (chi-square), the head's KV
after re-runs equal to a from-scratch run, and no host sync between verification and the
head's re-run on the k = 1 schedule."""

import threading
import time

import pytest
import torch

from overlap.attention import SeqAttention
from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.kv import slot_mapping
from runtime.engine import Engine
from runtime.messages import SamplingParams
from speculative.engine_stats import check_engine_law
from speculative.test_spec_engine import prompts


def engine(tiny_dirs, heads, method="mtp", k=1, target="target", page_size=16, num_pages=512, controller=None,
           **sched):
    spec = SpecConfig(controller="off", method=method, num_spec_tokens=k, head=str(heads[target]) if method == "mtp" else None)
    return Engine(EngineConfig(model=str(tiny_dirs[target]), spec=spec,
                               cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                               scheduler=SchedulerConfig(**{"max_num_seqs": 64, "max_batched_tokens": 512,
                                                            **sched})),
                  progress=False, controller=controller)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 4, pytest.param(16, marks=pytest.mark.slow)])  # 16: in the full suite
def test_greedy_mtp_equals_plain(tiny_dirs, heads, greedy_reference, k, batch):
    ps = prompts(batch, seed=20 + batch)
    eng = engine(tiny_dirs, heads, k=k)
    results = eng.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in results] == greedy_reference(ps, 24)
    assert sum(r.stats.get("draft_tokens", 0) for r in results) > 0
    assert eng.stats()["free_pages"] == eng.stats()["total_pages"]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_mtp_with_preemption_and_chunked_prefill(tiny_dirs, heads, greedy_reference, k):
    ps = [p * 3 for p in prompts(8, seed=31)]  # longer prompts: several prefill chunks each
    eng = engine(tiny_dirs, heads, k=k, page_size=4, num_pages=48, max_batched_tokens=32)
    results = eng.generate(ps, SamplingParams(max_tokens=30, ignore_eos=True))
    assert eng.scheduler.num_preemptions > 0
    assert [r.token_ids for r in results] == greedy_reference(ps, 30)


def test_greedy_mtp_with_graph_padding(tiny_dirs, heads, greedy_reference):
    ps = prompts(5, seed=41)
    spec = SpecConfig(controller="off", method="mtp", num_spec_tokens=1, head=str(heads["target"]))
    eng = Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=spec, graphs="on"), progress=False)
    assert [r.token_ids for r in eng.generate(ps, SamplingParams(max_tokens=20, ignore_eos=True))] == greedy_reference(ps, 20)


@pytest.mark.parametrize("k", [1, 3])
def test_head_kv_equals_running_the_head_from_scratch(tiny_dirs, heads, k):
    eng = engine(tiny_dirs, heads, k=k, page_size=4)
    ps = prompts(3, seed=7)
    ids = [eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in ps]
    for _ in range(8):
        eng.step()
    eng.executor.synchronize()
    proposer, model = eng.executor.proposer, eng.model
    backend = eng.executor.backend  # the engine's own kernels: KV must match bit for bit
    for rid in ids:
        seq = eng.scheduler.by_request[rid]
        tokens = seq.tokens
        n = len(tokens)
        # The target's hidden states H_0..H_{n-2} over the known tokens (x_{n-1} is the last
        # produced one: its H is not computed yet), then head rows j = 0..n-2 = (x_{j+1}, H_j).
        table = list(range(-(-n // 4)))
        kv = model.new_kv_pool(len(table), 4)
        meta = backend.plan([SeqAttention(n - 1, n - 1, table)], 4)
        hidden, _ = model(torch.tensor(tokens[:-1]), torch.arange(n - 1), backend, kv, meta)
        head_kv = proposer.head.new_kv_pool(len(table), 4)
        g, logits = proposer.head(torch.tensor(tokens[1:]), hidden, torch.arange(n - 1), backend, head_kv, meta,
                                  torch.tensor([n - 2]))
        ours = torch.tensor(slot_mapping(seq.pages, 0, n - 1, 4))
        ref = torch.tensor(slot_mapping(table, 0, n - 1, 4))
        for a, b in zip(proposer.kv.gather(0, ours), head_kv.gather(0, ref)):
            assert torch.equal(a, b), "head KV differs from the from-scratch run"
        carried_logits, carried_hidden = proposer.carried[seq.seq_id]
        assert torch.equal(carried_logits, logits[0]) and torch.equal(carried_hidden, g[-1])


@pytest.mark.parametrize("k,params", [
    (1, SamplingParams(temperature=1.0)),  # the no-sync k = 1 schedule
    (3, SamplingParams(temperature=1.0)),  # chains of 3 drafts from the head's own hidden states
    pytest.param(3, SamplingParams(temperature=0.7, top_k=4), marks=pytest.mark.slow),
])
def test_mtp_sampling_keeps_the_target_distribution(tiny_dirs, heads, k, params):
    """The first k+2 tokens against their exact law: the first decode step verifies drafts at
    depths 1..k (the stats say so) and its bonus token is the last one checked."""
    eng = engine(tiny_dirs, heads, k=k, target="target_v6", max_num_seqs=1000, max_batched_tokens=8192,
                 num_pages=4096)
    check_engine_law(eng, params, 4000, length=k + 2, depth=k)


def test_k1_reruns_the_head_behind_verification_without_a_host_sync(tiny_dirs, heads):
    """A sync-detecting wrapper around the device: log every host wait on an event and every
    head re-run. Each step's re-run must run on the forward stream inside the launch (no host
    round trip after verification), and the host must get the step's ids while that re-run is
    still running (the ids travel on the copy stream)."""
    eng = engine(tiny_dirs, heads, k=1)
    executor, proposer = eng.executor, eng.executor.proposer
    log, lock = [], threading.Lock()

    def note(what):
        with lock:
            log.append((time.perf_counter(), threading.current_thread().name, what))

    real_rerun, real_catch_up = proposer.rerun_fixed, proposer.catch_up

    def slow_rerun(*args, **kwargs):
        note("rerun start")
        time.sleep(0.03)  # a head that takes a while: the host must not wait for it
        real_rerun(*args, **kwargs)
        note("rerun end")

    def catch_up(updates):
        note("catch_up")
        real_catch_up(updates)

    proposer.rerun_fixed, proposer.catch_up = slow_rerun, catch_up
    real_submit = executor.submit

    def submit(plan):
        step = real_submit(plan)
        real_result = step.output.result

        def result(timeout=None):
            note("host wait")
            out = real_result(timeout)
            note("host has ids")
            return out

        step.output.result = result
        return step

    executor.submit = submit
    eng.generate(prompts(4, seed=3), SamplingParams(max_tokens=16, ignore_eos=True))
    executor.synchronize()
    reruns = [t for t in log if t[2] == "rerun start"]
    assert reruns and all(name == "overlap-forward" for _, name, _ in reruns)
    # Decode steps never fell back to the catch-up path (that one waits for the host).
    decode_catch_ups = [e for e in log if e[2] == "catch_up"]
    assert len(decode_catch_ups) <= 4  # prefill steps only
    # The host had the ids of a step while its re-run was still running.
    overlapped = 0
    for i, (t, _, what) in enumerate(log):
        if what == "rerun start":
            end = next(u for u, _, w in log[i:] if w == "rerun end")
            overlapped += any(w == "host has ids" and t < u < end for u, _, w in log)
    assert overlapped > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_k1_schedule_has_no_cuda_sync_between_verify_and_rerun(tiny_dirs, heads):
    eng = Engine(EngineConfig(model=str(tiny_dirs["target"]), device="cuda", dtype="bfloat16",
                              spec=SpecConfig(controller="off", method="mtp", num_spec_tokens=1, head=str(heads["target"]))),
                 progress=False)
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # warm-up
    proposer, executor = eng.executor.proposer, eng.executor
    real_launch = executor._launch_speculative

    def strict_launch(step, into, copy):
        torch.cuda.set_sync_debug_mode("error")  # any implicit sync in verify + re-run raises
        try:
            return real_launch(step, into, copy)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    executor._launch_speculative = strict_launch
    assert proposer is not None
    eng.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=12, ignore_eos=True))


@pytest.mark.slow  # starts the daemon's processes
def test_greedy_mtp_through_the_daemon(tiny_dirs, heads, greedy_reference):
    from runtime.client import Client
    from runtime.daemon import Daemon

    ps = prompts(6, seed=51)
    config = EngineConfig(model=str(tiny_dirs["target"]), cache=CacheConfig(page_size=16, num_pages=256),
                          spec=SpecConfig(controller="off", method="mtp", num_spec_tokens=3, head=str(heads["target"])))
    with Daemon(config, "tcp://127.0.0.1:*", ready_timeout_s=300) as d, Client(d.endpoint, timeout=120) as c:
        for k in (1, 3):
            ids = [c.submit(p, max_tokens=20, ignore_eos=True, num_spec_tokens=k) for p in ps]
            got, done = {}, set()
            while len(done) < len(ids):
                for delta in c.next_deltas():
                    got.setdefault(delta.request_id, []).extend(delta.token_ids)
                    if delta.finish_reason:
                        done.add(delta.request_id)
            assert [got[i] for i in ids] == greedy_reference(ps, 20)
