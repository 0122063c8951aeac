"""Runs one BatchPlan on the device: prefill chunks, decode steps and speculative steps.

Each step is split the way the pipelined runtime needs it:
  1. prepare  (host)   flatten the plan into input tensors, plan attention;
  2. launch   (device) draft (speculative steps), target forward, sampling / verification,
                       queued on the forward stream; the produced ids are copied to the host
                       on the copy stream (on the CPU handed over as they are) and `submit`
                       returns an EventFuture for them;
  3. collect  (sync)   the one documented sync point: the future resolves to Python ints;
  4. catch up (device) `finish` queues the drafter's run over the tokens it has not seen
                       (KV fill) and returns at once.
The caller (engine or executor process) hands the step's output to the scheduler right after
3, so step N+1 is planned and prepared while the device still runs step N's catch-up: that
is the overlap the runtime is built around. With overlap off, `finish` also waits for the
device to go idle, so planning starts only after the previous step has completed.

A batch in which some decoding sequence gets drafts is a speculative step: each sampled
sequence verifies its own drafts (any number, 0 included) or tree in one target pass, beside
prefill chunks and plain decodes; other batches sample one token per finishing sequence.
The drafter describes its own share of the step (overlap/speculative/base.py: the rows it
wants verified, their mask, its catch-up), so every drafter runs through the same path here.
The drafter is built by overlap/speculative/build.py; the step timing is overlap/step_timing.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from overlap import kernels
from overlap.attention import make_backend
from overlap.attention.base import AttentionBackend, SeqAttention
from overlap.batch import BatchPlan, SeqOutput, SeqWork, StepOutput
from overlap.config import EngineConfig
from overlap.device import Device, Event, HostCopy, host_io, upload
from overlap.futures import EventFuture
from overlap.graphs import GraphRunner
from overlap.kv import KVPool, slot_mapping
from overlap.models import fused
from overlap.models.llama import LlamaModel
from overlap.sampling import SamplingTensors, probabilities, row_argmax, sample
from overlap.speculative.base import DraftLayout, DraftRequest, FinishedStep, Proposal, Proposer, TreeLayout, Verified
from overlap.speculative.build import build_proposer
from overlap.speculative.rejection import verify_chain, verify_greedy
from overlap.speculative.tree import top_path_accepted, verify_tree, verify_tree_greedy
from overlap.step_timing import StepTiming, TimingTotals


log = logging.getLogger("overlap.executor")


@dataclass
class PreparedStep:
    plan: BatchPlan
    input_ids: torch.Tensor  # [T] i64
    positions: torch.Tensor  # [T] i64
    meta: Any  # attention metadata for this step (None when a GraphRunner plans it)
    attn: list[SeqAttention]  # per sequence, for a GraphRunner
    row_starts: list[int]  # each sequence's first row in the flat batch
    q_len: int | None  # new tokens of every sequence when they are all equal (graph-eligible)
    logits_rows: torch.Tensor  # [S] i64: last row of every sequence that samples
    sampled: list[SeqWork]  # sequences that produce tokens, in logits_rows order
    sampling: SamplingTensors | None
    spec_ks: list[int] | None  # drafts per sampled sequence on a speculative step, else None
    layout: DraftLayout | None  # the proposer's description of the step (None: no proposer)
    tree: "TreeBatch | None" = None  # tree steps: the trees being verified
    # Index tensors the launch needs, staged with the inputs (nothing in launch builds a
    # device tensor from Python data): end_pos [S] (where each sampled sequence's next token
    # sits), row_starts [B], sampled_starts [S] (each sampled sequence's last-token row);
    # speculative steps also draft_rows, padded_draft, padded_all, num_drafts, and
    # draft_tokens [S, W] when the proposer knew its drafts on the host (see prepare).
    index: dict[str, torch.Tensor] = field(default_factory=dict)
    width: int = 0  # drafts per row of a speculative step's padded [S, W] layout


@dataclass
class TreeBatch:
    slots: torch.Tensor  # [S, N+1] i64 KV slots of the rows [x_n, node_1..node_N]
    parents: torch.Tensor  # [S, N] i64 (0 = root)
    order: torch.Tensor  # [S, N] i64 index among siblings
    depth: int
    width: int  # children per node at most
    moved_rows: torch.Tensor  # [S, D] i64 flat rows the accepted path's depth 1..D moves to
    top_nodes: torch.Tensor  # [S, D] i64 each tree's top path by depth (node ids; 0 past it or none)


@dataclass
class LaunchedStep:
    prepared: PreparedStep
    tokens: torch.Tensor  # [S, K+1] i64 produced tokens (padding past num_produced)
    num_accepted: torch.Tensor | None  # [S] i64 on speculative steps
    num_drafts: list[int]
    hidden: torch.Tensor | None = None  # [T, H] the target's hidden states (when the layout keeps them)
    top_accepted: torch.Tensor | None = None  # [S] i64 on tree steps: accepted drafts on the top path

    def device_results(self) -> tuple[torch.Tensor, ...]:
        if self.num_accepted is None:
            return (self.tokens,)
        if self.top_accepted is None:
            return self.tokens, self.num_accepted
        return self.tokens, self.num_accepted, self.top_accepted


@dataclass
class InFlightStep:
    """A submitted step. The forward stream runs: start → launch → launched → (host collects)
    → catch_up_start → catch-up → end; the events bracket those parts for the timing."""

    plan: BatchPlan
    work: LaunchedStep  # filled in by the device work
    output: EventFuture  # → StepOutput once the produced ids are on the host
    submitted: float  # host perf_counter when the launch was queued
    start: Event
    launched: Event
    catch_up_start: Event | None = None
    end: Event | None = None
    resolved: float | None = None  # host perf_counter when the output was known


class Executor:
    def __init__(self, model: LlamaModel, kv: KVPool, backend: AttentionBackend,
                 proposer: Proposer | None = None, overlap: bool = True, scratch_page: int | None = None):
        self.model = model
        self.kv = kv
        self.backend = backend
        self.proposer = proposer
        self.overlap = overlap
        # With a scratch page (a KV page the scheduler never hands out), uniform decode and
        # verify steps run through a GraphRunner per q_len: padded to a bucket, a CUDA graph.
        self.scratch_page = scratch_page
        self.graphs: dict[int, GraphRunner] = {}
        self.device = model.embed_tokens.device
        self.streams = Device(self.device)
        cfg = model.cfg
        self._attn_dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype)
        self.timing = TimingTotals()
        self._previous: InFlightStep | None = None  # the last finished step, for the timing
        # One CUDA-graph memory pool for every runner (target q_lens, the draft's steps).
        self.graph_pool = None
        self.graph_report: list[dict] = []  # what setup_graphs set up, for logs and checks
        self.settle()

    def settle(self) -> None:
        """Wait once for the default stream's set-up work (KV pools, the FlashInfer workspace,
        dummy positions, weights) before the forward stream, which is not ordered against
        the default stream, may read it. CUDA only; call after building or swapping parts."""
        if self.streams.is_cuda:
            torch.cuda.synchronize(self.device)

    def _runner(self, q_len: int, lazily: bool = True) -> GraphRunner:
        runner = self.graphs.get(q_len)
        if runner is None:
            # A q_len first seen while serving (drafts cut short near max_tokens) is never
            # captured then: a capture synchronizes the device mid-serving. It runs padded,
            # eagerly; start-up captures the q_lens a configuration runs (graph_q_lens).
            runner = self.graphs[q_len] = GraphRunner(self.model, self.kv, self.backend, q_len,
                                                      scratch_page=self.scratch_page, pool=self.graph_pool,
                                                      use_graphs=False if lazily else None)
            if lazily:
                log.info("graphs: target q_len=%d was not captured at start-up: it runs eagerly (padded)", q_len)
        return runner

    def setup_graphs(self, q_lens: list[int], require: bool = False) -> list[dict]:
        """At start-up: every bucket of every runner (the target's for each q_len, the draft
        model's single-token steps), captured on CUDA into one shared pool, with a log line
        per runner (what, how many buckets, how long). require: raise when they cannot be
        captured (graphs = "on" on CUDA) instead of saying they run eagerly."""
        if self.scratch_page is None:
            return []
        runners = [self._runner(q, lazily=False) for q in sorted(set(q_lens))]
        if self.proposer is not None:
            runners += self.proposer.graph_runners()
        if require and self.streams.is_cuda:
            eager = [f"{r.name} q_len={r.q_len}: {r.eager_reason}" for r in runners if r.eager_reason]
            if eager:
                raise RuntimeError("graphs = on, but CUDA graphs cannot be captured: " + "; ".join(eager))
        if any(r.use_graphs for r in runners) and self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        for r in runners:
            if r.use_graphs and not r.captured:
                r.pool = self.graph_pool  # one pool for all of them
        t0 = time.perf_counter()
        self.graph_report = [r.capture_all() for r in runners]
        total = time.perf_counter() - t0
        captured = sum(len(r["captured"]) for r in self.graph_report)
        log.info("graphs: start-up set-up of %d runners done in %.2f s (%d CUDA graphs captured%s)",
                 len(runners), total, captured, "" if captured else "; every bucket runs eagerly")
        self.settle()
        return self.graph_report

    def execute(self, plan: BatchPlan) -> StepOutput:
        """Run one step to its output (the drafter's catch-up may still be running)."""
        step = self.submit(plan)
        output = step.output.result()
        self.finish(step, output)
        return output

    def submit(self, plan: BatchPlan) -> InFlightStep:
        """1-2: prepare on the host, queue the device work; returns at once."""
        with self.streams.issuing():
            prepared = self.prepare(plan)
        stream = self.streams.forward
        start = stream.record()
        launched = LaunchedStep(prepared, torch.empty(0), None, [])
        copy = HostCopy(self.streams.new_event())

        def device_work() -> None:
            # Runs on the stream (a worker thread on the CPU): results land in `launched`,
            # and the launch starts the copy of the produced ids as soon as they exist.
            try:
                self.launch(prepared, into=launched, copy=copy)
            except BaseException as e:
                self.streams.fail(copy, e)
                raise

        stream.submit(device_work)
        done = stream.record()
        future = EventFuture(copy.event, lambda: self.collect(launched, copy.values))
        return InFlightStep(plan, launched, future, time.perf_counter(), start, done)

    def finish(self, step: InFlightStep, output: StepOutput) -> None:
        """4: queue the drafter's catch-up (returns without waiting for it) and time the step."""
        step.resolved = time.perf_counter()
        stream = self.streams.forward
        step.catch_up_start = stream.record()
        self.catch_up(step.plan, output, step.work)
        step.end = stream.record()
        if not self.overlap:
            step.end.synchronize()  # plan the next step only once the device is idle
        self._time(step)

    def _time(self, step: InFlightStep) -> None:
        # Once step N's ids are on the host, every event of step N-1 has fired (they precede
        # N's launch on the forward stream), so reading them costs no sync.
        prev, self._previous = self._previous, step
        if prev is None or not step.launched.query():
            return
        continuing = {s.seq_id for s in prev.plan.seqs} & {s.seq_id for s in step.plan.seqs}
        busy = prev.launched.seconds_since(prev.start) + prev.end.seconds_since(prev.catch_up_start)
        idle_in_step = max(0.0, prev.catch_up_start.seconds_since(prev.launched))
        # Only back-to-back steps of the same sequences measure the pipeline; a gap while
        # the server had no work is not idleness the runtime could have avoided.
        idle_before = max(0.0, step.start.seconds_since(prev.end)) if continuing else 0.0
        plan_s = max(0.0, step.submitted - prev.resolved) if continuing else 0.0
        self.timing.add(StepTiming(prev.plan.step_id, busy, idle_in_step, idle_before, plan_s,
                                   min(plan_s, max(0.0, plan_s - idle_before))))

    def synchronize(self) -> None:
        self.streams.forward.synchronize()

    def close(self) -> None:
        self.streams.close()

    # 1. host work
    def prepare(self, plan: BatchPlan) -> PreparedStep:
        if self.proposer is not None and plan.freed_seq_ids:
            self._on_drafter_stream(lambda: self.proposer.release(plan.freed_seq_ids))
        sampled = [s for s in plan.seqs if s.sample]
        dev = self.device
        # 1. Drafts per sampled sequence, as the scheduler asked. Only decode rows speculate,
        #    whatever else the batch carries (prefill chunks, sequences with speculation off
        #    sample one token each), so chains of different lengths, trees and plain rows
        #    share one verify pass.
        ks = [s.num_spec_tokens if (self.proposer is not None and s.is_decode) else 0 for s in sampled]
        # 2. The proposer lays its step out: the rows it wants verified (it may grant fewer
        #    than asked: a fixed tree grants a chain or the tree, n-gram finds fewer), their depths and mask,
        #    the drafts it already knows on the host. A proposer that plans from device state
        #    calls the wait it is given (EAGLE-2; the documented sync of dynamic trees).
        layout = None if self.proposer is None else \
            self.proposer.plan(plan, sampled, ks, self.streams.forward.synchronize)
        ks = layout.num_drafts if layout is not None else ks
        spec = any(ks)
        tree = layout.tree if spec else None
        # 3. The flat rows of the step.
        ids: list[int] = []
        positions: list[int] = []
        attn: list[SeqAttention] = []
        rows: list[int] = []
        row_starts: list[int] = []
        sampled_starts: list[int] = []  # first row of each sampled sequence's verify block
        draft_rows: list[int] = []  # flat rows of the drafts (chain drafts or tree nodes)
        j = 0  # index among sampled sequences
        for s in plan.seqs:
            row_starts.append(len(ids))
            k = ks[j] if s.sample else 0
            # A sequence's rows: its tokens, then its drafts ([x_n, d_1..d_k], or a tree's
            # [x_n, node_1..node_N]) at the depths the layout gives, under its mask (a tree's;
            # else causal). Drafts not known on the host yet are filled in by launch().
            if not k:
                drafts = []
            elif layout.tokens is not None:
                drafts = layout.tokens[j]
            else:
                drafts = [0] * k
            q_len = len(s.token_ids) + len(drafts)
            ids += s.token_ids + drafts
            positions += range(s.start_pos, s.end_pos)
            if drafts:
                positions += [s.end_pos - 1 + d for d in layout.depths[j]]
            mask = tree.masks[j] if tree is not None and drafts else None
            attn.append(SeqAttention(q_len, s.start_pos + q_len, s.page_table, mask))
            if s.sample:
                # The last token's row and every draft's: logits for the verify block.
                sampled_starts.append(len(ids) - 1 - len(drafts))
                rows += range(len(ids) - 1 - len(drafts), len(ids))
                draft_rows += range(len(ids) - len(drafts), len(ids))
                j += 1
        q_lens = {a.q_len for a in attn}
        uniform = q_lens.pop() if len(q_lens) == 1 and plan.is_decode_only and tree is None else None
        graphed = self.scratch_page is not None and uniform is not None
        # 4. Everything the device reads this step, staged in ONE pinned buffer and copied
        #    without blocking (on the forward stream: submit prepares under `issuing()`).
        arrays: dict[str, tuple[object, torch.dtype]] = {
            "ids": (ids, torch.long), "positions": (positions, torch.long), "logits_rows": (rows, torch.long),
            "end_pos": ([s.end_pos for s in sampled], torch.long), "row_starts": (row_starts, torch.long),
            "sampled_starts": (sampled_starts, torch.long)}
        width = 0
        if spec:
            # Where each verify row goes in the padded [S, W+1] layout (W: the layout's width,
            # the widest chain asked for or the tree's nodes), and each sequence's draft count.
            width = layout.width
            padded_all, padded_draft = [], []
            for i, k in enumerate(ks):
                padded_draft += range(i * width, i * width + k)
                padded_all += range(i * (width + 1), i * (width + 1) + k + 1)
            arrays.update(draft_rows=(draft_rows, torch.long), padded_draft=(padded_draft, torch.long),
                          padded_all=(padded_all, torch.long), num_drafts=(list(ks), torch.long))
            if layout.tokens is not None:  # the host's drafts, [S, W] for propose() and verification
                arrays["draft_tokens"] = ([t + [0] * (width - len(t)) for t in layout.tokens], torch.long)
        if tree is not None:
            arrays.update(self._tree_arrays(sampled, ks, sampled_starts, tree, width, layout.depths))
        names = list(arrays)
        host_sampling = SamplingTensors.host_arrays(sampled) if sampled else []
        staged = upload(dev, *arrays.values(), *host_sampling)
        index = dict(zip(names, staged))
        return PreparedStep(
            plan=plan,
            input_ids=index.pop("ids"),
            positions=index.pop("positions"),
            # A graphed step is planned by its runner, into the bucket's static buffers.
            meta=None if graphed else self.backend.plan(attn, self.kv.page_size, *self._attn_dims),
            attn=attn,
            row_starts=row_starts,
            q_len=uniform if graphed else None,
            logits_rows=index.pop("logits_rows"),
            sampled=sampled,
            sampling=SamplingTensors.from_staged(sampled, staged[len(names):]) if sampled else None,
            spec_ks=ks if spec else None,
            layout=layout,
            tree=self._tree_batch(index, tree) if tree is not None else None,
            index=index,
            width=width,
        )

    def _tree_arrays(self, sampled: list[SeqWork], ks: list[int], starts: list[int], tree: TreeLayout,
                     n: int, tree_depths: list[list[int]]) -> dict[str, tuple[object, torch.dtype]]:
        """The tree step's host-side layout, per sampled sequence ([S, ...] rows): its nodes'
        parents and sibling order, KV slots, and where the accepted path's rows move to.
        A sequence that decodes plainly beside the trees gets a tree nobody can enter (every
        node its own parent, so the root has no children: verify_tree draws its one token
        from p, as plain sampling does), and slots and moves that point at its own row only
        (self-copies), so the whole step stays one set of [S, ...] tensors. A smaller tree (a
        chain along the top path) is padded the same way: nodes past its k are their own
        parents, and its slots and moves past its rows and depth point at its root."""
        depth = tree.depth
        closed = list(range(1, n + 1)), [0] * n
        parents, order, slots, moved_rows, top_nodes = [], [], [], [], []
        for j, (s, k) in enumerate(zip(sampled, ks)):
            row = starts[j]
            root_slot = slot_mapping(s.page_table, s.end_pos - 1, s.end_pos, self.kv.page_size)
            if not k:
                parents.append(closed[0])
                order.append(closed[1])
                slots.append(root_slot * (n + 1))
                moved_rows.append([row] * depth)
                top_nodes.append([0] * depth)
                continue
            own_depth = max(tree_depths[j])
            parents.append(tree.parents[j] + closed[0][k:])
            order.append(tree.order[j] + closed[1][k:])
            # Only the sequence's own k + 1 slots (pages were reserved for what it asked).
            slots.append(slot_mapping(s.page_table, s.start_pos, s.start_pos + 1 + k, self.kv.page_size)
                         + root_slot * (n - k))
            moved_rows.append(list(range(row + 1, row + 1 + own_depth)) + [row] * (depth - own_depth))
            top = (tree.top_path[j] or []) if tree.top_path is not None else []
            top_nodes.append(top[:depth] + [0] * (depth - len(top[:depth])))
        return {"tree_parents": (parents, torch.long), "tree_order": (order, torch.long),
                "tree_slots": (slots, torch.long), "tree_moved_rows": (moved_rows, torch.long),
                "tree_top_nodes": (top_nodes, torch.long)}

    def _tree_batch(self, index: dict[str, torch.Tensor], tree: TreeLayout) -> TreeBatch:
        return TreeBatch(index.pop("tree_slots"), index.pop("tree_parents"), index.pop("tree_order"),
                         tree.depth, tree.max_children, index.pop("tree_moved_rows"), index.pop("tree_top_nodes"))

    def _on_drafter_stream(self, fn) -> None:
        # A model drafter's state (KV, carried logits) is only touched by work on the forward
        # stream, in order; a host drafter's state lives on the host.
        if self.proposer.state_on_host:
            fn()
        else:
            self.streams.forward.submit(fn)

    # 2. device work (runs on the forward stream)
    def launch(self, step: PreparedStep, into: LaunchedStep | None = None,
               copy: HostCopy | None = None) -> LaunchedStep:
        """The step's device work; results go into `into` (a new LaunchedStep by default)."""
        into = into or LaunchedStep(step, torch.empty(0), None, [])
        self._launch(step, into, copy)
        return into

    def _publish(self, into: LaunchedStep, result: LaunchedStep, copy: HostCopy | None) -> None:
        """Fill `into`, THEN start the copy of the produced ids: the host reads `into` as soon
        as the copy lands, possibly while later work of this launch still runs."""
        into.tokens, into.num_accepted, into.num_drafts = result.tokens, result.num_accepted, result.num_drafts
        into.hidden, into.top_accepted = result.hidden, result.top_accepted
        if copy is not None:
            self.streams.start_copy(copy, into.device_results())

    def _launch(self, step: PreparedStep, into: LaunchedStep, copy: HostCopy | None) -> None:
        if step.spec_ks is not None:
            self._launch_speculative(step, into, copy)
            return
        hidden, logits = self._target_forward(step, step.input_ids)
        keep = hidden if step.layout is not None and step.layout.keep_hidden else None
        if step.sampling is None:
            launched = LaunchedStep(step, torch.empty(0, 1, dtype=torch.long, device=self.device), None, [], keep)
        else:
            launched = LaunchedStep(step, sample(logits, step.sampling, step.index["end_pos"])[:, None], None, [], keep)
        self._publish(into, launched, copy)

    def _launch_speculative(self, step: PreparedStep, into: LaunchedStep, copy: HostCopy | None) -> None:
        """Stages 2-4, one path for every drafter: draft, verify every sequence's rows in one
        target pass (chains, or trees under their masks, beside plain rows), and the proposer's
        catch-up right here when its layout asks for it."""
        seqs, ks, st, layout, index = step.sampled, step.spec_ks, step.sampling, step.layout, step.index
        # Stage 2: draft (a host drafter's drafts are staged already; propose hands them back).
        proposal = self.proposer.propose(DraftRequest(seqs, layout, st, index.get("draft_tokens")))
        if proposal.tokens.shape[1] != step.width:
            raise RuntimeError(f"the drafter proposed {proposal.tokens.shape[1]} drafts per row; "
                               f"the step was prepared for {step.width}")
        ids = step.input_ids
        if layout.tokens is None or layout.device_fills:
            ids = ids.clone()
            ids[index["draft_rows"]] = proposal.tokens.view(-1)[index["padded_draft"]]
        # Stage 3: one target pass over every row (q_len = k+1 per chain, N+1 per tree).
        hidden, logits = self._target_forward(step, ids)
        # Stage 4 (recovered / bonus token) happens inside verification.
        top_accepted = None
        if step.tree is None:
            tokens, accepted = self._verify_chains(step, logits, proposal)
            num_drafts = list(ks)
        else:
            tokens, accepted, hidden, top_accepted = self._verify_trees(step, logits, hidden, proposal.tokens)
            # A tree reports its depth: the most drafts one path of it can have accepted (a
            # chain along its top path: its length).
            num_drafts = [max(d) if k else 0 for k, d in zip(ks, layout.depths)]
        launched = LaunchedStep(step, tokens, accepted, num_drafts, hidden if layout.keep_hidden else None,
                                top_accepted)
        self._publish(into, launched, copy)  # the host waits only for this copy
        if layout.catches_up_in_launch:
            # The drafter's catch-up, queued right here behind verification with the verify
            # pass's own batch info; no host sync in between (MTP k = 1: speculative/mtp.py).
            meta = step.meta if step.meta is not None else \
                self.backend.plan(step.attn, self.kv.page_size, *self._attn_dims)
            self.proposer.after_verify(Verified(seqs, tokens, accepted, hidden, step.positions, self.backend, meta))

    def _verify_chains(self, step: PreparedStep, logits: torch.Tensor,
                       proposal: Proposal) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [rows, V] f32 of the verify blocks → (tokens [S, W+1] i64, num_accepted [S] i64)."""
        b, width, st, index = len(step.sampled), step.width, step.sampling, step.index
        padded_rows = index["padded_all"]
        # Drafters may find fewer drafts than the width (n-gram); verify what they proposed.
        num_drafts = index["num_drafts"]
        if st.all_greedy:  # argmax compare: no [S, W+1, V] probabilities
            best = torch.zeros(b * (width + 1), dtype=torch.long, device=self.device)
            best[padded_rows] = row_argmax(logits)
            return verify_greedy(best.view(b, width + 1), proposal.tokens, num_drafts)
        padded = torch.zeros(b * (width + 1), logits.shape[-1], device=self.device)
        padded[padded_rows] = logits
        p = probabilities(padded, st.repeat_rows(width + 1)).view(b, width + 1, -1)
        return verify_chain(p, proposal.probs, proposal.tokens, num_drafts, st.seed, index["end_pos"])

    def _verify_trees(self, step: PreparedStep, logits: torch.Tensor, hidden: torch.Tensor, nodes: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Walk the trees (tree.py), then move each accepted path's KV and hidden states into
        place, as a chain's would be. logits [rows, V] f32, hidden [T, H], nodes [S, N] i64 →
        (tokens [S, D+1] i64, num_accepted [S] i64, the moved hidden states [T, H], the accepted
        drafts on each tree's top path [S] i64: what its chain alone would have accepted, for
        the controller, which learns chains and trees on the same steps from it)."""
        st, tb, index = step.sampling, step.tree, step.index
        b, n, depth, dev = len(step.sampled), step.width, tb.depth, self.device
        if st.all_greedy and self._host_verify(logits):
            # The same ops as below in two kernel calls (kernels/tree_walk.cpp): ~35 calls of a
            # few microseconds each over a handful of integers, a step's cost that only
            # speculation pays.
            tokens, accepted, path, top_accepted = kernels.verify_trees_greedy(
                logits, index["padded_all"], nodes, tb.parents, tb.order, depth, tb.width, tb.top_nodes)
            moved = kernels.compact_paths(accepted, path, tb.slots, index["sampled_starts"], tb.moved_rows, hidden,
                                          *fused.caches(self.kv), self.kv.page_size)
            return tokens, accepted, moved, top_accepted
        if st.all_greedy:
            # The target's argmax after each tree's root and nodes, [S, N+1]: the walk on
            # one-hot p without building it (6.3 -> 0.9 ms for an 8-node tree on a CPU: the
            # residual updates scan the whole vocabulary per child tried).
            best = torch.zeros(b * (n + 1), dtype=torch.long, device=dev)
            best[index["padded_all"]] = row_argmax(logits)
            tokens, accepted, path = verify_tree_greedy(best.view(b, n + 1), nodes, tb.parents, tb.order,
                                                        depth, tb.width)
            top_accepted = top_path_accepted(tb.top_nodes, path, accepted, nodes, best.view(b, n + 1))
        else:
            # p after each tree's root and nodes (and the one row of a plain sequence), [S, N+1].
            padded = torch.zeros(b * (n + 1), logits.shape[-1], device=dev)
            padded[index["padded_all"]] = logits
            p = probabilities(padded, st.repeat_rows(n + 1)).view(b, n + 1, -1)
            tokens, accepted, path = verify_tree(p, nodes, tb.parents, tb.order, depth, tb.width, st.seed,
                                                 index["end_pos"])
            top_accepted = top_path_accepted(tb.top_nodes, path, accepted)
        # Compaction: the node at depth i of the accepted path moves to slot n + i (KV) and
        # to row i of the sequence's block (the hidden states the drafter's catch-up reads).
        keep = torch.arange(depth, device=dev)[None, :] < accepted[:, None]  # [S, D]
        slots = tb.slots  # [S, N+1]
        dst = slots[:, 1:depth + 1]
        self.kv.copy_slots(torch.where(keep, slots.gather(1, path), dst).reshape(-1), dst.reshape(-1))
        starts = index["sampled_starts"]
        src_rows = torch.where(keep, starts[:, None] + path, tb.moved_rows)
        moved = hidden.clone()
        moved[tb.moved_rows.reshape(-1)] = hidden[src_rows.reshape(-1)]
        return tokens, accepted, moved, top_accepted

    @staticmethod
    def _host_verify(logits: torch.Tensor) -> bool:
        """Whether a greedy tree step verifies through the CPU kernels: f32 logits (and so the
        step, its pool and its trees) on the CPU."""
        return logits.device.type == "cpu" and logits.dtype == torch.float32

    def _target_forward(self, step: PreparedStep, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target forward → (hidden [T, H], logits [len(logits_rows), V] f32), through a
        graph if the step was planned for one."""
        if step.q_len is None:
            return self.model(ids, step.positions, self.backend, self.kv, step.meta, step.logits_rows)
        return self._runner(step.q_len).forward(ids, step.positions, step.attn, step.logits_rows)

    # 3. the sync point
    def collect(self, launched: LaunchedStep, host: list[torch.Tensor] | None = None) -> StepOutput:
        # The one host sync of a step: the scheduler needs the produced ids as Python ints.
        # `host` holds the copies made on the copy stream (pinned memory on CUDA), already
        # complete when the step's future resolves, so tolist() does not wait here.
        host = host if host is not None else list(launched.device_results())
        with host_io():  # the documented device→host read
            tokens = host[0].tolist()
            accepted = host[1].tolist() if launched.num_accepted is not None else None
            top = host[2].tolist() if len(host) > 2 else None
        outputs: dict[int, SeqOutput] = {}
        for i, s in enumerate(launched.prepared.sampled):
            if accepted is None:
                outputs[s.seq_id] = SeqOutput(s.seq_id, tokens[i][:1])
            else:
                a = accepted[i]
                outputs[s.seq_id] = SeqOutput(s.seq_id, tokens[i][: a + 1], launched.num_drafts[i], a,
                                              launched.prepared.spec_ks[i], top[i] if top is not None else -1)
        plan = launched.prepared.plan
        return StepOutput(plan.step_id, [outputs.get(s.seq_id, SeqOutput(s.seq_id, [])) for s in plan.seqs])

    # 4. drafter catch-up
    def catch_up(self, plan: BatchPlan, output: StepOutput, work: LaunchedStep) -> None:
        """Hand the proposer the step's facts; it feeds its drafter the tokens it has not seen
        (prompt chunks, produced tokens) by its own rule, on the forward stream."""
        layout = work.prepared.layout
        if layout is None:
            return  # no drafter
        row_starts = work.prepared.row_starts
        # On the host, before the next step is planned (the launch's hidden states are not read here).
        self.proposer.observe(FinishedStep(plan.seqs, output.seqs, row_starts))
        if layout.catches_up_in_launch:
            return  # it caught up inside the launch
        # `work.hidden` exists once the launch has run: read it from the stream (a host
        # drafter keeps none).
        self._on_drafter_stream(lambda: self.proposer.catch_up(
            FinishedStep(plan.seqs, output.seqs, row_starts, work.hidden)))


def build_executor(config: EngineConfig, model: LlamaModel) -> Executor:
    """The target's KV pool, the attention backend and the configured drafter around `model`.
    With graphs, every pool gets one page past the scheduler's: the padding rows' scratch page."""
    num_pages = config.cache.num_pages
    scratch = num_pages if config.use_graphs else None
    kv = model.new_kv_pool(num_pages + (scratch is not None), config.cache.page_size)
    backend = make_backend(config.attention_backend, config.device)
    executor = Executor(model, kv, backend, build_proposer(config, model, scratch), overlap=config.overlap,
                        scratch_page=scratch)
    if scratch is not None:
        executor.setup_graphs(graph_q_lens(config), require=config.graphs == "on")
    return executor


def graph_q_lens(config: EngineConfig) -> list[int]:
    """The uniform q_lens this configuration's steps run with: 1 (decode) and 2..k+1 (the
    verify pass of a chain of k drafts, or fewer: the scheduler cuts drafts short near
    max_tokens and the context end, and n-gram finds fewer). EAGLE's fixed tree: its
    chains-only steps are causal chains of up to the tree's depth. Tree verify passes carry
    a mask and are not graphed."""
    spec = config.spec
    k = spec.num_spec_tokens if spec.method in ("draft", "ngram", "mtp") else 0
    if spec.method == "eagle" and spec.tree == "static":
        k = spec.tree_depth
    return list(range(1, (k or 0) + 2))
