"""One executor as a group of tensor-parallel ranks (torch.distributed; gloo on the CPU).

Rank 0 (the leader) is the executor the scheduler talks to. For every step it packs the
BatchPlan (token ids, positions, page tables, sampling parameters: one msgpack buffer) and
broadcasts it; every rank then runs the same step on its shard (models/tp.py), and the
collectives inside the forward keep them in lockstep. Sampling uses counter-based noise
keyed by each request's seed, and the logits are all-gathered, so every rank draws the
same tokens: only the leader's output is used, nothing is sent back.

The plan broadcast runs on its own process group, issued by the host thread, while the
model's collectives run on the default group from the forward stream's thread: two groups,
each used by one thread, so their collectives can never interleave differently on two
ranks. The leader broadcasts step N+1's plan while step N's drafter catch-up may still run.

A rank that dies makes the others' next collective fail after `timeout` (gloo raises; the
leader's step fails with DeviceError and the executor process reports it upstream), never
an endless hang.
"""

from __future__ import annotations

import datetime

import msgspec
import torch
import torch.distributed as dist

from overlap.batch import BatchPlan

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BatchPlan)
STOP = -1  # broadcast length that tells the followers to leave


def init_group(rank: int, world: int, rendezvous: str, timeout_s: float = 60.0):
    """Initialise torch.distributed (gloo) and return the plan-broadcast group."""
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class PlanBroadcast:
    def __init__(self, group):
        self.group = group

    def send(self, plan: BatchPlan | None) -> None:
        data = b"" if plan is None else _encoder.encode(plan)
        size = torch.tensor([STOP if plan is None else len(data)], dtype=torch.long)
        dist.broadcast(size, src=0, group=self.group)
        if plan is not None:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> BatchPlan | None:
        size = torch.zeros(1, dtype=torch.long)
        dist.broadcast(size, src=0, group=self.group)
        if size.item() == STOP:
            return None
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return _decoder.decode(buf.numpy().tobytes())


class LeaderExecutor:
    """Rank 0: the Executor the engine drives, broadcasting each plan before running it."""

    def __init__(self, executor, broadcast: PlanBroadcast, followers=()):
        self.executor = executor
        self.broadcast = broadcast
        self.followers = list(followers)  # processes to join at close

    def __getattr__(self, name):  # timing, synchronize, proposer, kv, ...: the local executor's
        return getattr(self.executor, name)

    def submit(self, plan: BatchPlan):
        self.broadcast.send(plan)
        return self.executor.submit(plan)

    def execute(self, plan: BatchPlan):
        step = self.submit(plan)
        output = step.output.result()
        self.executor.finish(step, output)
        return output

    def finish(self, step, output) -> None:
        self.executor.finish(step, output)

    def close(self) -> None:
        try:
            self.broadcast.send(None)
        finally:
            self.executor.close()
            for p in self.followers:
                p.join(timeout=30)
            if dist.is_initialized():
                dist.destroy_process_group()


def follow(executor, broadcast: PlanBroadcast) -> None:
    """Ranks > 0: run every broadcast plan until the leader says stop."""
    while True:
        plan = broadcast.receive()
        if plan is None:
            return
        executor.execute(plan)


def run_follower(rank: int, world: int, config, model_dir: str, rendezvous: str) -> None:
    """Entry point of a follower rank process (spawned by start_group)."""
    from overlap.config import ModelConfig, torch_dtype
    from overlap.executor import build_executor
    from overlap.models.loading import read_model_config
    from overlap.models.tp import Collectives, Shard, load_sharded

    group = init_group(rank, world, rendezvous, config.tp_timeout_s)
    cfg = ModelConfig.from_hf(read_model_config(model_dir))
    model = load_sharded(model_dir, Shard.of(cfg, rank, world), Collectives(world), torch_dtype(config.dtype),
                         config.device)
    executor = build_executor(config, model)
    try:
        follow(executor, PlanBroadcast(group))
    finally:
        executor.close()
        dist.destroy_process_group()


def start_group(config, model_dir: str, rendezvous_dir: str) -> tuple[LeaderExecutor, object]:
    """Spawn ranks 1..N-1, become rank 0; → (the leader executor, rank 0's sharded model)."""
    import torch.multiprocessing as mp

    from overlap.config import ModelConfig, torch_dtype
    from overlap.executor import build_executor
    from overlap.models.loading import read_model_config
    from overlap.models.tp import Collectives, Shard, load_sharded

    world = config.tensor_parallel
    if config.spec.method != "none":
        raise ValueError("tensor parallelism runs without speculation for now (spec method none)")
    rendezvous = f"file://{rendezvous_dir}/rendezvous"
    ctx = mp.get_context("spawn")
    followers = [ctx.Process(target=run_follower, args=(r, world, config, model_dir, rendezvous), daemon=True,
                             name=f"overlap-tp{r}") for r in range(1, world)]
    for p in followers:
        p.start()
    group = init_group(0, world, rendezvous, config.tp_timeout_s)
    cfg = ModelConfig.from_hf(read_model_config(model_dir))
    model = load_sharded(model_dir, Shard.of(cfg, 0, world), Collectives(world), torch_dtype(config.dtype),
                         config.device)
    return LeaderExecutor(build_executor(config, model), PlanBroadcast(group), followers), model
