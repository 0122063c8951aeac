"""The kernels' thread pool (overlap/kernels/pool.h): the caller and its helpers claim a job's
chunks, so whichever thread runs a chunk, and however the OS schedules them, every job gives
the result it gives with nothing else running."""

import threading

import torch

from overlap import kernels


def test_jobs_from_a_worker_beside_a_busy_thread_give_the_callers_own_results():
    # The engine's shape of contention: the stream's worker issues many small pool jobs while
    # the main thread runs Python on the other core; thousands of jobs cross the helper's
    # spin-then-sleep and its late wake-ups (a claim of a finished job must not run it again).
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=gen).to(torch.bfloat16)
    weight = torch.randn(1536, 576, generator=gen).to(torch.bfloat16)
    want = kernels.linear_bf16(x, weight)  # the main thread's, nothing beside it
    stop, wrong, calls = threading.Event(), [], [0]

    def worker():
        for i in range(3000):
            got = kernels.linear_bf16(x, weight)
            if not torch.equal(got, want):
                wrong.append(i)
            calls[0] += 1
        stop.set()

    t = threading.Thread(target=worker)
    t.start()
    spin = 0
    while not stop.is_set():  # the main thread's Python, on the other core
        spin += sum(range(200))
    t.join()
    assert calls[0] == 3000 and wrong == []
