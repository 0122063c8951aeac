"""The launch path creates no device tensor from Python data and reads nothing back to the
host outside the documented points (the staging copy, overlap.device.upload, and the
executor's collect): on CUDA each such call is a blocking copy or a stream sync, which
would serialize the pipeline (docs/architecture.md §6, the hot-path rule).

On the CPU there is no device to catch it, so the calls themselves are checked: every step
runs under a TorchFunctionMode (on the main thread and on the stream worker threads) that
records torch.tensor / as_tensor / asarray, indexing with Python lists, and
.item() / .tolist() / .cpu() / .numpy() / bool() / int() / float() on tensors, unless
called inside `overlap.device.host_io()`. (torch.from_numpy does not reach a
TorchFunctionMode, so it is listed but never seen; only the CPU staging uses it, for host
arrays.) The torch-only backend is used: its planning
stages through the same point as the executor's (FlashInfer's plan reads pinned host
arrays by design and is checked by its own tests)."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from overlap.device import in_host_io, upload
from runtime.engine import Engine
from runtime.messages import SamplingParams

CREATE = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy}
READ = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
        torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
INDEX = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _python_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


class HostIOGuard(TorchFunctionMode):
    def __init__(self, violations: list[str]):
        super().__init__()
        self.violations = violations

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not in_host_io():
            what = None
            if func in CREATE:
                what = f"{func.__name__}(Python data)"
            elif func in READ:
                what = f"Tensor.{func.__name__}()"
            elif func in INDEX and len(args) > 1 and _python_index(args[1]):
                what = f"Tensor.{func.__name__} with a Python list index"
            if what is not None:
                site = next((f"{f.filename}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack()[:-1])
                             if "/overlap/" in f.filename or "/runtime/" in f.filename), "?")
                self.violations.append(f"{what} at {site}")
        return func(*args, **kwargs)


def guarded(executor, violations):
    """Run every closure of the executor's streams under the guard (modes are per thread)."""
    for stream in (s for s in (executor.streams.forward, executor.streams.copy) if s is not None):
        submit = stream.submit

        def wrapped(fn, submit=submit):
            def run():
                with HostIOGuard(violations):
                    return fn()
            submit(run)

        stream.submit = wrapped


def engine(tiny_dirs, heads, method, k=3, **spec):
    cfg = SpecConfig(controller="off", method=method, num_spec_tokens=k if method != "eagle" else None,
                     draft_model=str(tiny_dirs["draft"]) if method == "draft" else None,
                     head=str(heads["target"]) if method in ("mtp", "eagle") else None, **spec)
    return Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=cfg, attention_backend="torch",
                               cache=CacheConfig(page_size=16, num_pages=256),
                               scheduler=SchedulerConfig(max_num_seqs=8)), progress=False)


@pytest.fixture(scope="module")
def spec_heads(tiny_dirs, tmp_path_factory):
    from helpers import random_head

    return {"target": random_head(tiny_dirs["target"], tmp_path_factory.mktemp("heads") / "h")}


CASES = [("none", {}), ("draft", {}), ("ngram", {}), ("mtp", {"k": 1}), ("mtp", {"k": 3}), ("eagle", {})]


@pytest.mark.parametrize("method,kw", CASES, ids=[f"{m}{kw.get('k', '')}" for m, kw in CASES])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_steps_stage_inputs_and_read_back_only_at_collect(tiny_dirs, spec_heads, method, kw, temperature):
    eng = engine(tiny_dirs, spec_heads, method, **kw)
    prompts = [[10, 20, 30, 40], [7] * 9, [500, 600, 700]]
    # Prefill (and any warm-up) unguarded; then guarded decode/spec steps, prefills included.
    eng.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))
    violations: list[str] = []
    guarded(eng.executor, violations)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=3)
    with HostIOGuard(violations):
        results = eng.generate(prompts, params)
    eng.close()
    assert all(len(r.token_ids) == 12 for r in results)
    assert not violations, "\n".join(sorted(set(violations)))


def test_the_guard_catches_a_hidden_sync():
    """Negative control: what the executor used to do is caught; staging is not."""
    violations: list[str] = []
    with HostIOGuard(violations):
        upload("cpu", ([1, 2, 3], torch.long))
        x = torch.tensor([1, 2, 3])  # noqa: F841  (a blocking H2D copy on CUDA)
        y = torch.zeros(3)
        y[[0, 1]] = 1.0
        y.sum().item()
    assert len(violations) == 3, violations
