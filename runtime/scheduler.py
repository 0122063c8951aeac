"""The scheduler core: continuous batching over waiting/running queues. Pure, no sockets.

Every step: (1) give each running sequence its next tokens (decode token or next prefill
chunk), preempting the newest sequences by recompute when pages run out; (2) admit waiting
sequences while the token budget, the sequence limit and the pages allow; (3) after the
step, append the produced tokens and finish sequences on EOS, stop ids or max_tokens.

A sequence is just its tokens (prompt + output) and how many of them have KV
(`num_computed`): a prefill chunk, a decode step and a recompute after preemption are the
same operation, "run tokens[num_computed:]", so there is one code path for all three.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from overlap.batch import BatchPlan, SeqWork, StepOutput
from overlap.config import BRANCHED_METHODS, SchedulerConfig, lookup_match
from overlap.speculative.controller import Candidate, SpeculationController, chain_options, tree_options
from overlap.speculative.ngram import lookup
from runtime.messages import SamplingParams
from runtime.pages import PageAllocator
from runtime.prefix_cache import CacheChain, PrefixCache


@dataclass(eq=False)  # identity, not field equality: queues hold distinct sequences
class Sequence:
    seq_id: int
    request_id: str
    tokens: list[int]  # prompt + generated
    num_prompt: int
    params: SamplingParams
    seed: int
    num_spec_tokens: int  # drafts per step for this sequence (0: no speculation)
    stop_ids: frozenset[int]
    num_computed: int = 0  # tokens whose KV is in the cache
    pages: list[int] = field(default_factory=list)
    num_reused: int = 0  # of those, found in the prefix cache at (re)admission
    cached: CacheChain = field(default_factory=CacheChain)  # its pages that are in the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]


@dataclass(frozen=True)
class SeqUpdate:
    """What one step did to one request: new tokens, and a finish reason when it ended."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_drafts: int = 0
    num_accepted: int = 0
    spec_k: int | None = None  # drafts (or tree nodes) the step verified; None: not a speculating decode


def spec_arguments(spec) -> dict:
    """The Scheduler's tree_depth, tree_chains, lookup_branch and lookup_match for a SpecConfig
    (the engine's scheduler and the server's build theirs alike): EAGLE's trees, with chains
    along a fixed tree's top path; the rows of a model drafter's lookup branch and the n-gram
    lengths its lookup matches (lookup_branch.py)."""
    eagle = spec.method == "eagle"
    return {"tree_depth": spec.tree_depth if eagle else 0, "tree_chains": eagle and spec.tree == "static",
            "lookup_branch": spec.lookup_branch if spec.method in BRANCHED_METHODS else 0,
            "lookup_match": lookup_match(spec)}


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: PageAllocator,
                 eos_token_ids: tuple[int, ...] = (), controller: SpeculationController | None = None,
                 tree_depth: int = 0, clock=time.perf_counter, prefix_cache: PrefixCache | None = None,
                 tree_chains: bool = False, lookup_branch: int = 0, lookup_match: tuple[int, int] = (2, 3)):
        """controller: chooses each speculating decode's drafts per step (None: every one
        verifies its cap). tree_depth: EAGLE, a sequence's num_spec_tokens is a tree of that
        depth, not a chain; tree_chains: its drafter also grows chains of 1..tree_depth drafts
        along the tree's top path (EAGLE's fixed shape), which the controller may choose
        instead of the tree. lookup_branch: rows reserved per drafting step, beyond its drafts,
        for the drafter's lookup branch (SeqWork.lookup_rows); lookup_match: the shortest and
        longest suffix n-gram its lookup matches. prefix_cache: full pages shared across
        requests (runtime/prefix_cache.py; None: off)."""
        self.config = config
        self.lookup_branch = lookup_branch
        self.lookup_match = lookup_match
        self.controller = controller
        self.tree_depth = tree_depth
        self.tree_chains = tree_chains
        self.clock = clock
        self._scheduled_at: dict[int, float] = {}  # step id → when it was planned (step times)
        self._prompt_catch_up = 0  # prompt rows the drafter catches up on ahead of the next step
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.by_request: dict[str, Sequence] = {}
        self.by_seq: dict[int, Sequence] = {}
        self._seq_ids = itertools.count()
        self._step_ids = itertools.count()
        self._freed: list[int] = []
        self.num_preemptions = 0

    # -- requests --------------------------------------------------------------------------

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
            num_spec_tokens: int = 0) -> Sequence:
        if request_id in self.by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_ids), len(prompt_ids), params,
                       seed, num_spec_tokens, stop)
        self.waiting.append(seq)
        self.by_request[request_id] = seq
        self.by_seq[seq.seq_id] = seq
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> Sequence | None:
        seq = self.by_request.get(request_id)
        if seq is not None:
            self._finish(seq, reason)
        return seq

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------

    def schedule(self) -> BatchPlan | None:
        budget = self.config.max_batched_tokens
        works: list[SeqWork] = []
        # 1. running sequences first, oldest first; preempt from the newest end.
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue  # preempted while making room for an older sequence
            work = self._try_schedule(seq, budget, preempt=True)
            if work is not None:
                works.append(work)
                budget -= len(work.token_ids)
        # 2. admit waiting sequences while budget, seat and pages allow (FCFS: stop at the first misfit).
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            work = self._try_schedule(seq, budget, preempt=False)
            if work is None:
                break
            self.waiting.popleft()
            self.running.append(seq)
            if self.controller is not None and seq.num_spec_tokens and not self._admits_drafts(seq):
                # The batch rules drafts out: the drafter never follows it (as if detached).
                seq.num_spec_tokens = 0
                work = msgspec.structs.replace(work, draft=False)
            if self.prefix_cache is not None:
                self.prefix_cache.record_lookup(len(seq.tokens), seq.num_reused)
            works.append(work)
            budget -= len(work.token_ids)
        if not works:
            return None
        # 3. how many drafts each decoding sequence verifies (a batch that carries prefill
        # chunks still speculates for its decode rows); pages were reserved for the caps,
        # and what a smaller choice leaves unused is trimmed after the step.
        if self.controller is not None:
            works = self._choose_drafts(works)
        freed, self._freed = self._freed, []
        plan = BatchPlan(next(self._step_ids), works, freed)
        self._scheduled_at = {plan.step_id: self.clock()}
        return plan

    def _choose_drafts(self, works: list[SeqWork]) -> list[SeqWork]:
        spec = [i for i, w in enumerate(works) if w.draft and w.is_decode]
        others = [w for i, w in enumerate(works) if i not in set(spec)]
        # Each one's lookup branch, found now on its host history: the controller then prices
        # the branches that will fire, at their rows (the drafter verifies these tokens).
        branches = {i: self._lookup(works[i]) for i in spec}
        candidates = [Candidate(works[i].seq_id, self._options(works[i]),
                                None if branches[i] is None else len(branches[i])) for i in spec]
        chosen = dict(zip(spec, self.controller.choose(candidates, sum(len(w.token_ids) for w in others),
                                                       sum(1 for w in others if w.sample))))
        for c in candidates:
            if self.controller.should_detach(c.key):
                # Many steps without drafts: stop speculating for this request, so the drafter
                # stops following it (its catch-up is what a "no drafts" step still costs).
                self.by_seq[c.key].num_spec_tokens = 0
        # The branches as long as the controller chose to verify them this step.
        cap = self.controller.branch_cap
        return [msgspec.structs.replace(w, num_spec_tokens=chosen[i].k,
                                        branch=branches[i][:cap] if chosen[i].depth and branches[i] is not None
                                        else None) if i in chosen else w
                for i, w in enumerate(works)]

    def _lookup(self, work: SeqWork) -> list[int] | None:
        """The lookup branch of a decoding sequence with rows reserved for one: the continuation
        of its latest earlier suffix match (ngram.lookup; [] where none matched), None without
        rows reserved."""
        if not work.lookup_rows:
            return None
        return lookup(self.by_seq[work.seq_id].tokens, work.lookup_rows, *self.lookup_match)

    def _admits_drafts(self, seq: Sequence) -> bool:
        # Judged by every option that drafts (options[0] is plain decoding), in the batch of the
        # running sequences that draft, the detached ones beside it (as choose() judges it).
        drafting = self._capped_options(seq.num_spec_tokens, seq.num_spec_tokens)[1:]
        attached = sum(1 for s in self.running if s is not seq and s.num_spec_tokens > 0)
        return self.controller.admits_drafts(attached + 1, drafting, len(self.running) - attached - 1)

    def _options(self, work: SeqWork):
        """work.num_spec_tokens is the cap this step (the request's k, less near max_tokens)."""
        return self._capped_options(self.by_seq[work.seq_id].num_spec_tokens, work.num_spec_tokens)

    def _capped_options(self, k: int, cap: int):
        """A request's options for its k (EAGLE: the tree's nodes) under this step's cap."""
        if self.tree_depth:
            return tree_options(k, self.tree_depth, cap, chains=self.tree_chains)
        return chain_options(cap)

    def _try_schedule(self, seq: Sequence, budget: int, preempt: bool) -> SeqWork | None:
        if self.prefix_cache is not None and not seq.pages:
            self._reuse_cached_prefix(seq)  # a new sequence, or one back after preemption
        remaining = len(seq.tokens) - seq.num_computed
        n = min(remaining, budget)
        is_last_chunk = n == remaining
        # Speculate only once the drafter has followed the sequence: a cache hit can leave a
        # single token for the first step, and the drafter has carried nothing for it yet.
        spec = self._num_drafts(seq) if (remaining == 1 and seq.num_computed > seq.num_reused) else 0
        # A lookup branch beside the drafts: as many rows as the room allows, like the drafts.
        lookup = min(self.lookup_branch, self._room(seq) - 1) if spec else 0
        # Room for: this step's tokens, the drafts being verified (and the branch), and the
        # drafter's catch-up run over the token this step produces.
        need = seq.num_computed + n + spec + lookup + (1 if seq.num_spec_tokens else 0)
        while not self.allocator.can_grow(seq.pages, need):
            victim = self.running[-1] if self.running else None
            if not preempt or victim is None:
                if seq not in self.running:
                    self._forget_reused(seq)  # not admitted: let go of the cached pages it took
                return None
            self._preempt(victim)
            if victim is seq:
                return None
        self.allocator.grow(seq.pages, need)
        p = seq.params
        # The first chunk after a prefix-cache hit: a drafter that keeps the tokens on the host
        # (n-gram, a lookup branch) gets the reused ones too, or it could never copy from them.
        drafts = seq.num_spec_tokens > 0
        reused = seq.tokens[:seq.num_reused] if drafts and seq.num_reused and seq.num_computed == seq.num_reused else []
        return SeqWork(
            seq_id=seq.seq_id,
            token_ids=seq.tokens[seq.num_computed: seq.num_computed + n],
            start_pos=seq.num_computed,
            page_table=list(seq.pages),
            sample=is_last_chunk,
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seq.seed,
            num_spec_tokens=spec,
            draft=drafts,
            lookup_rows=lookup,
            reused_ids=reused,
        )

    def _reuse_cached_prefix(self, seq: Sequence) -> None:
        """Start the sequence on the cached pages that hold a prefix of its tokens: a cache hit
        is just a sequence whose first num_computed tokens already have KV."""
        pages, chain = self.prefix_cache.match(seq.tokens)
        self.prefix_cache.acquire(pages)
        seq.pages, seq.cached = pages, chain
        seq.num_computed = seq.num_reused = len(pages) * self.allocator.page_size

    def _forget_reused(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.num_computed = seq.num_reused = 0
        seq.cached = CacheChain()

    def _room(self, seq: Sequence) -> int:
        """Tokens the sequence may still produce: before max_tokens and the context end."""
        return min(seq.params.max_tokens - seq.num_output, self.config.max_model_len - len(seq.tokens))

    def _num_drafts(self, seq: Sequence) -> int:
        """Drafts for a decode step: never past max_tokens or the context (a step emits k+1)."""
        return max(0, min(seq.num_spec_tokens, self._room(seq) - 1))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens, go to the front of the queue."""
        self.running.remove(seq)
        self._forget_reused(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._freed.append(seq.seq_id)
        self.waiting.appendleft(seq)

    def update(self, plan: BatchPlan, output: StepOutput) -> list[SeqUpdate]:
        """3. Record what the step produced; finish sequences that hit a stop condition."""
        updates = []
        produced = {o.seq_id: o for o in output.seqs}
        self._observe_step(plan, output)
        for work in plan.seqs:
            seq = self.by_seq.get(work.seq_id)
            if seq is None:
                continue  # finished or aborted while the step ran
            if seq.num_computed != work.start_pos or seq not in self.running:
                continue  # preempted while the step ran: its tokens will be recomputed
            seq.num_computed = work.end_pos
            if self.prefix_cache is not None:
                # Before the produced tokens can finish the sequence (and free its pages).
                self.prefix_cache.publish(seq.tokens, seq.pages, seq.num_computed, seq.cached)
            out = produced.get(seq.seq_id)
            new = self._append(seq, out.token_ids) if out else []
            if out is not None and out.num_drafts and seq.finish_reason is None:
                # The verify pass wrote the KV of every draft it accepted (a tree's accepted path
                # is moved into place): those tokens are computed, so the next step starts at the
                # bonus token and speculates, instead of re-running the accepted drafts as a chunk.
                seq.num_computed += out.num_accepted
            if work.draft and seq.finish_reason is None:
                # Give back the pages reserved for rejected drafts; keep what holds every
                # known token (the drafter's KV includes the last one). The work's flag, not
                # the sequence's: a sequence detached since this step was planned had pages
                # reserved for it all the same.
                self.allocator.trim(seq.pages, len(seq.tokens))
            if new or seq.finish_reason:
                spec_k = work.num_spec_tokens if (work.draft and work.is_decode) else None
                updates.append(SeqUpdate(seq.request_id, new, seq.finish_reason,
                                         out.num_drafts if out else 0, out.num_accepted if out else 0, spec_k))
        return updates

    def _observe_step(self, plan: BatchPlan, output: StepOutput) -> None:
        """Feed the controller: each sequence's verified drafts, and the step's wall time
        (from planning to its output: host and device, as the throughput sees it)."""
        if self.controller is None:
            return
        # A tree verifies more rows than its depth; a chain (EAGLE's top path too) its depth.
        trees = {w.seq_id for w in plan.seqs if self.tree_depth and w.num_spec_tokens > self.tree_depth}
        works = {w.seq_id: w for w in plan.seqs}
        # The depth of the option each sequence took: a tree's, or its chain's length.
        depths = {w.seq_id: self.tree_depth if w.seq_id in trees else w.num_spec_tokens for w in plan.seqs}
        for o in output.seqs:
            w = works.get(o.seq_id)
            # A lookup branch's rows: what the step verified beyond the option the controller
            # chose (None where the step reserved no branch rows for the sequence).
            branch_rows = max(o.num_rows - w.num_spec_tokens, 0) if w is not None and w.lookup_rows else None
            self.controller.observe(o.seq_id, o.num_drafts, o.num_accepted, tree=o.seq_id in trees,
                                    depth=depths.get(o.seq_id, 0), branch_rows=branch_rows,
                                    top_accepted=o.top_accepted)
        start = self._scheduled_at.pop(plan.step_id, None)
        if start is not None:
            # The rows the target verified: what the drafter laid out (a tree's nodes, a lookup
            # branch beyond the drafts asked for; n-gram may find fewer), not what was asked.
            rows = sum(len(w.token_ids) for w in plan.seqs) + sum(o.num_rows or o.num_drafts for o in output.seqs)
            levels = [sum(1 for d in depths.values() if d >= j) for j in range(2, max(depths.values(), default=0) + 1)]
            self.controller.observe_step(rows, levels, self.clock() - start,
                                         speculating=sum(1 for d in depths.values() if d),
                                         catch_up_rows=self._prompt_catch_up, tree=bool(trees),
                                         prompt_rows=sum(len(w.token_ids) for w in plan.seqs if not w.is_decode))
        # The drafter catches up on this step's prompt chunks right after it, ahead of the
        # next step on the device: the next step's time carries them.
        self._prompt_catch_up = sum(len(w.token_ids) for w in plan.seqs if w.draft and not w.is_decode)

    def _append(self, seq: Sequence, token_ids: list[int]) -> list[int]:
        new = []
        for tok in token_ids:
            seq.tokens.append(tok)
            new.append(tok)
            if tok in seq.stop_ids:
                self._finish(seq, "stop")
            elif seq.num_output >= seq.params.max_tokens:
                self._finish(seq, "length")
            elif len(seq.tokens) >= self.config.max_model_len:
                self._finish(seq, "length")
            if seq.finish_reason:
                break
        return new

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finish_reason is None:
            seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.free(seq.pages)
        self._freed.append(seq.seq_id)
        if self.controller is not None:
            self.controller.forget(seq.seq_id)
        self.by_request.pop(seq.request_id, None)
        self.by_seq.pop(seq.seq_id, None)

    # -- observability ---------------------------------------------------------------------

    def stats(self) -> dict:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "free_pages": self.allocator.num_free,
            "total_pages": self.allocator.num_pages,
            "preemptions": self.num_preemptions,
            **(self.controller.stats() if self.controller is not None else {}),
            **(self.prefix_cache.stats() if self.prefix_cache is not None else {}),
        }
