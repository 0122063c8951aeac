"""Streams, events and EventFutures (CPU emulation; the CUDA ones on a GPU), and the pipelined
executor: overlap on and off give the same tokens, and with overlap on the next step is
planned while the drafter's catch-up still runs."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from overlap.config import CacheConfig, EngineConfig, SpecConfig
from overlap.device import CpuStream, Device, DeviceError, HostCopy, upload
from overlap.futures import EventFuture
from runtime.engine import Engine
from runtime.messages import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_upload_builds_what_torch_tensor_builds():
    """The CPU staging goes through numpy (no GIL hand-off per array); each tensor must be
    the one torch.tensor makes: dtype, shape (nested and empty lists), float32 rounding."""
    given = np.array([7, 8, 9])
    arrays = [([1, 2, 3], torch.long), ([[1, 0], [0, 2]], torch.long), ([], torch.long),
              ([0.1, 1e-40, 3.4e38], torch.float32), ([True, False], torch.bool), ([2**62, -5], torch.long),
              (given, torch.int32)]
    for (values, dtype), got in zip(arrays, upload("cpu", *arrays)):
        want = torch.tensor(values, dtype=dtype)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    staged = upload("cpu", (given, torch.long))[0]
    given[0] = 0  # the upload is a copy: later changes to the caller's array do not reach it
    assert staged.tolist() == [7, 8, 9]


def test_stream_runs_in_order_and_events_follow_the_work():
    stream, seen, gate = CpuStream(), [], threading.Event()
    stream.submit(gate.wait)
    for i in range(5):
        stream.submit(lambda i=i: seen.append(i))
    event = stream.record()
    assert not event.query()  # the stream is held at the gate: the host got control back
    gate.set()
    event.synchronize(timeout=5)
    assert seen == list(range(5)) and event.query()
    later = stream.record()
    later.synchronize(timeout=5)
    assert later.seconds_since(event) >= 0
    stream.close()


def test_wait_orders_two_streams():
    a, b, seen, gate = CpuStream(), CpuStream(), [], threading.Event()
    a.submit(gate.wait)
    a.submit(lambda: seen.append("a"))
    b.wait(a.record())
    b.submit(lambda: seen.append("b"))
    done = b.record()
    time.sleep(0.05)
    assert seen == []  # b waits for a, which waits for the gate
    gate.set()
    done.synchronize(timeout=5)
    assert seen == ["a", "b"]


def test_a_failed_stream_reports_the_error_at_its_events():
    stream, seen = CpuStream(), []
    stream.submit(lambda: 1 / 0)
    stream.submit(lambda: seen.append("skipped"))
    with pytest.raises(DeviceError, match="ZeroDivisionError"):
        stream.record().synchronize(timeout=5)
    assert seen == []  # nothing runs after a failure


def test_event_timeout():
    stream, gate = CpuStream(), threading.Event()
    stream.submit(gate.wait)
    with pytest.raises(TimeoutError):
        stream.record().synchronize(timeout=0.05)
    gate.set()


def copy_of(device: Device, make) -> HostCopy:
    """Queue `make()` on the forward stream and the copy of its result to the host."""
    copy = HostCopy(device.new_event())
    device.forward.submit(lambda: device.start_copy(copy, (make(),)))
    return copy


def test_event_future_blocking_and_awaited():
    device = Device("cpu")
    copy = copy_of(device, lambda: torch.arange(4) * 2)
    future = EventFuture(copy.event, lambda: copy.values[0].tolist())
    assert future.result(timeout=5) == [0, 2, 4, 6] and future.done()

    async def main():
        c = copy_of(device, lambda: torch.ones(2))
        return await EventFuture(c.event, lambda: c.values[0].sum().item())

    assert asyncio.run(main()) == 2.0
    device.close()


def _tiny_engine(tiny_dirs, overlap: bool) -> Engine:
    spec = SpecConfig(controller="off", method="draft", num_spec_tokens=3, draft_model=str(tiny_dirs["draft"]))
    return Engine(EngineConfig(model=str(tiny_dirs["target"]), spec=spec, overlap=overlap,
                               cache=CacheConfig(page_size=16, num_pages=256)), progress=False)


PROMPTS = [[10, 20, 30, 40], [500, 600], [7] * 9, [1234, 99, 5, 17, 3]]


def test_overlap_on_and_off_give_identical_greedy_outputs(tiny_dirs):
    outs = {}
    for overlap in (True, False):
        eng = _tiny_engine(tiny_dirs, overlap)
        outs[overlap] = [r.token_ids for r in eng.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))]
        timing = eng.stats()
        assert timing["timed_steps"] > 0 and timing["device_busy_s"] > 0
        assert 0 <= timing["hidden_plan_s"] <= timing["plan_s"] + 1e-9
        eng.close()
    assert outs[True] == outs[False] and all(len(o) == 16 for o in outs[True])


@pytest.mark.parametrize("overlap", [True, False])
def test_next_step_is_planned_while_the_catch_up_runs(tiny_dirs, overlap):
    """Slow the drafter's catch-up down and record when the scheduler plans: with overlap on,
    planning happens inside a catch-up; with it off, never."""
    eng = _tiny_engine(tiny_dirs, overlap)
    proposer, scheduler = eng.executor.proposer, eng.scheduler
    catch_ups, plans = [], []
    real_catch_up, real_schedule = proposer.catch_up, scheduler.schedule

    def slow_catch_up(updates):
        start = time.perf_counter()
        time.sleep(0.05)
        real_catch_up(updates)
        catch_ups.append((start, time.perf_counter()))

    def timed_schedule():
        plans.append(time.perf_counter())
        return real_schedule()

    proposer.catch_up, scheduler.schedule = slow_catch_up, timed_schedule
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.executor.synchronize()
    inside = sum(any(a < t < b for a, b in catch_ups) for t in plans)
    assert (inside > 0) == overlap, (inside, len(plans))
    eng.close()


@needs_cuda
@pytest.mark.gpu
def test_cuda_stream_event_and_host_copy():
    device = Device("cuda")
    copy = copy_of(device, lambda: torch.arange(1 << 20, device="cuda").sum())
    assert copy.values[0].is_pinned()
    copy.event.synchronize(timeout=10)
    assert copy.values[0].item() == (1 << 20) * ((1 << 20) - 1) // 2
    start = device.forward.record()
    device.forward.submit(lambda: torch.randn(2048, 2048, device="cuda") @ torch.randn(2048, 2048, device="cuda"))
    end = device.forward.record()
    end.synchronize(timeout=10)
    assert end.seconds_since(start) > 0


def test_a_failing_step_raises_instead_of_hanging(tiny_dirs):
    eng = _tiny_engine(tiny_dirs, overlap=True)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    eng.executor.model.forward = broken
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(DeviceError, match="kernel exploded"):
        eng.step()


def test_copy_started_inside_stream_work_fires_before_the_work_ends():
    """What the no-sync MTP schedule relies on: ids copied mid-work reach the host while the
    stream still runs the rest of that work."""
    device, gate, box = Device("cpu"), threading.Event(), {}
    copy = HostCopy(device.new_event())

    def work():
        box["ids"] = torch.tensor([1, 2, 3])
        device.start_copy(copy, (box["ids"],))
        gate.wait(5)  # the rest of the step (the head's re-run) is still running

    device.forward.submit(work)
    copy.event.synchronize(timeout=5)
    assert copy.values[0].tolist() == [1, 2, 3]
    assert not gate.is_set()
    gate.set()
    device.forward.synchronize()
