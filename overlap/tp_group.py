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

import dataclasses
import datetime
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from overlap.batch import BatchPlan

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(BatchPlan)
STOP = -1  # broadcast length that tells the followers to leave


def init_group(rank: int, world: int, rendezvous: str, timeout_s: float = 60.0, device: str = "cpu"):
    """Initialise torch.distributed → (the plan-broadcast group, the drafts group). The model's
    collectives use NCCL on GPUs and gloo on the CPU; the two host-side groups are gloo."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout)


def rank_device(device: str, rank: int) -> str:
    return f"cuda:{rank}" if device.startswith("cuda") else device


class PlanBroadcast:
    def __init__(self, group):
        self.group = group
        self.bytes_sent = 0
        self.plans_sent = 0

    def send(self, plan: BatchPlan | None) -> None:
        data = b"" if plan is None else _encoder.encode(plan)
        size = torch.tensor([STOP if plan is None else len(data)], dtype=torch.long)
        self.bytes_sent += 8 + len(data)
        self.plans_sent += plan is not None
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
        step = self.executor.submit(plan)
        # What the group costs in messages: plan bytes (and, with a draft model, proposals).
        proposals = getattr(self.executor.proposer, "channel", None)
        self.executor.timing.extra.update(
            tp_ranks=dist.get_world_size(), tp_plans=self.broadcast.plans_sent,
            tp_plan_bytes=self.broadcast.bytes_sent, tp_proposal_bytes=proposals.bytes_sent if proposals else 0)
        return step

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

    group, drafts = init_group(rank, world, rendezvous, config.tp_timeout_s, config.device)
    config = config.replace(device=rank_device(config.device, rank))
    cfg = ModelConfig.from_hf(read_model_config(model_dir))
    model = load_sharded(model_dir, Shard.of(cfg, rank, world), Collectives(world), torch_dtype(config.dtype),
                         config.device)
    executor = build_executor(config.replace(spec=dataclasses.replace(config.spec, method="none")), model)
    executor.proposer = (FollowerProposer(SharedProposals(drafts)) if config.spec.method == "draft"
                         else _sharded_mtp(config, model))
    _set_up(executor, config)
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
    if config.spec.method not in ("none", "draft", "mtp"):
        raise ValueError(f"tensor parallelism runs with --spec none, draft or mtp, not {config.spec.method!r} yet")
    rendezvous = f"file://{rendezvous_dir}/rendezvous"
    ctx = mp.get_context("spawn")
    followers = [ctx.Process(target=run_follower, args=(r, world, config, model_dir, rendezvous), daemon=True,
                             name=f"overlap-tp{r}") for r in range(1, world)]
    for p in followers:
        p.start()
    group, drafts = init_group(0, world, rendezvous, config.tp_timeout_s, config.device)
    config = config.replace(device=rank_device(config.device, 0))
    cfg = ModelConfig.from_hf(read_model_config(model_dir))
    model = load_sharded(model_dir, Shard.of(cfg, 0, world), Collectives(world), torch_dtype(config.dtype),
                         config.device)
    executor = build_executor(config.replace(spec=dataclasses.replace(config.spec, method="none")), model)
    if config.spec.method == "draft":
        # The draft shares the target's embeddings and lm_head, which no rank holds whole:
        # the leader loads them once more, in full, for its draft.
        from overlap.speculative.build import build_proposer

        holder = full_embeddings(model_dir, model.dtype, model.embed_tokens.device, model.matmul)
        executor.proposer = LeaderProposer(build_proposer(config, holder), SharedProposals(drafts))
    else:
        executor.proposer = _sharded_mtp(config, model)
    _set_up(executor, config)
    return LeaderExecutor(executor, PlanBroadcast(group), followers), model


def _set_up(executor, config) -> None:
    """After the drafter is swapped in: the graphs of the verify pass (and the leader's draft
    steps) at start-up like a TP=1 executor's, then one device sync (the drafter's KV pool was
    made on the default stream)."""
    from overlap.executor import graph_q_lens

    executor.setup_graphs(graph_q_lens(config), require=config.graphs == "on")
    executor.settle()


def _sharded_mtp(config, model):
    """MTP: the head is sharded with the target on every rank (it reads the target's hidden
    states, which every rank holds whole after the all-reduce); no proposal travels."""
    if config.spec.method != "mtp":
        return None
    from overlap.attention import make_backend
    from overlap.models.tp import load_head_sharded
    from overlap.speculative.mtp import MTPProposer

    return MTPProposer(load_head_sharded(config.spec.head, model), make_backend(config.attention_backend, config.device),
                       config.cache.num_pages, config.cache.page_size)


def full_embeddings(model_dir: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                    matmul: str = "exact"):
    """A layerless LlamaModel holding the target's full embedding (and lm_head, if untied), on
    `device` (the rank's): the draft built around it inherits its device, so a holder left on
    the CPU would put the whole draft there and fail its first propose on a GPU."""
    from safetensors import safe_open

    from overlap.config import ModelConfig
    from overlap.models.llama import LlamaModel
    from overlap.models.loading import read_model_config

    cfg = ModelConfig.from_hf(read_model_config(model_dir))
    holder = LlamaModel(dataclasses.replace(cfg, num_layers=0), dtype, device, matmul=matmul)
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h, torch.no_grad():
            if "model.embed_tokens.weight" in h.keys():
                holder.embed_tokens.copy_(h.get_tensor("model.embed_tokens.weight").to(dtype))
            if not cfg.tie_word_embeddings and "lm_head.weight" in h.keys():
                holder.lm_head.copy_(h.get_tensor("lm_head.weight").to(dtype))
    return holder


# -- drafts under tensor parallelism -----------------------------------------------------------

class SharedProposals:
    """The draft model runs on the leader only (a small model gains nothing from sharding);
    its proposals are broadcast so that every rank verifies the same drafts. Runs on the
    forward stream's thread, on a group of its own."""

    def __init__(self, group):
        self.group = group
        self.bytes_sent = 0

    def share(self, proposal):
        from overlap.speculative.base import Proposal

        # vocab 0: no q tensor (one-hot drafts at the tokens, or greedy drafts)
        vocab = 0 if proposal.probs is None else proposal.probs.shape[-1]
        meta = torch.tensor([*proposal.tokens.shape, vocab], dtype=torch.long)
        dist.broadcast(meta, src=0, group=self.group)
        # Through host memory (the drafts group is gloo): on a GPU this copy is a sync of the
        # draft step, the price of running the draft on one rank only.
        dist.broadcast(proposal.tokens.cpu().contiguous(), src=0, group=self.group)
        if proposal.probs is not None:
            dist.broadcast(proposal.probs.cpu().contiguous(), src=0, group=self.group)
        self.bytes_sent += meta.numel() * 8 + proposal.tokens.numel() * 8 + vocab * proposal.tokens.numel() * 4
        return Proposal(proposal.tokens, proposal.probs)

    def receive(self):
        from overlap.speculative.base import Proposal

        meta = torch.zeros(3, dtype=torch.long)
        dist.broadcast(meta, src=0, group=self.group)
        b, k, vocab = meta.tolist()
        tokens = torch.zeros(b, k, dtype=torch.long)
        probs = torch.zeros(b, k, vocab) if vocab else None
        dist.broadcast(tokens, src=0, group=self.group)
        if probs is not None:
            dist.broadcast(probs, src=0, group=self.group)
        return Proposal(tokens, probs)


class LeaderProposer:
    """Rank 0's drafter: plans and proposes, then shares the proposal with the other ranks."""

    def __init__(self, inner, channel: SharedProposals):
        self.inner, self.channel = inner, channel
        self.name, self.state_on_host = inner.name, inner.state_on_host

    def graph_runners(self) -> list:
        return self.inner.graph_runners()

    def plan(self, batch, sampled, ks, wait):
        return self.inner.plan(batch, sampled, ks, wait)

    def propose(self, request):
        return self.channel.share(self.inner.propose(request))

    def after_verify(self, verified) -> None:
        self.inner.after_verify(verified)

    def observe(self, finished) -> None:
        self.inner.observe(finished)

    def catch_up(self, finished) -> None:
        self.inner.catch_up(finished)

    def release(self, seq_ids) -> None:
        self.inner.release(seq_ids)


class FollowerProposer:
    """Ranks > 0: the leader's drafts, received; nothing to catch up on. The leader's drafter
    (a draft model) lays out chains of the ks asked for, and so does this one."""

    name, state_on_host = "remote", False

    def __init__(self, channel: SharedProposals):
        self.channel = channel

    def graph_runners(self) -> list:
        return []

    def plan(self, batch, sampled, ks, wait):
        from overlap.speculative.base import DraftLayout

        return DraftLayout.chains(ks)

    def propose(self, request):
        proposal = self.channel.receive()
        device = request.sampling.seed.device
        probs = None if proposal.probs is None else proposal.probs.to(device)
        return type(proposal)(proposal.tokens.to(device), probs)

    def after_verify(self, verified) -> None:
        pass

    def observe(self, finished) -> None:
        pass

    def catch_up(self, finished) -> None:
        pass

    def release(self, seq_ids) -> None:
        pass
