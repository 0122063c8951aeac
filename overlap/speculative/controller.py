"""The speculation controller: how many drafts each sequence verifies this step.

Speculation pays only while a step's extra rows cost less than the tokens they win
(docs/architecture.md §8): speedup ≈ acceptance_length / (r(q) + k·c). At batch 1 a verify
row is nearly free, so full k wins; in a compute-bound batch every row costs about as much
as a plain decode row, and drafts that are rejected only slow the batch down. So each step
the controller picks, per sequence, one option (0..k drafts; for EAGLE's fixed tree: none, a
chain of 1..depth drafts along the tree's top path, or the whole tree) to maximise

    expected tokens of the step / predicted time of the step,

where a sequence's expected tokens with d drafts deep are 1 + Σ_{j≤d} Π_{m≤j} a[m], a[m]
being its own exponential average of "draft m accepted, given drafts 1..m-1 were" (kept apart
for its chains and its trees: a tree's several candidates per level accept more; a fixed
tree whose steps report what its top path accepted is its chain plus the tree's gain); and the
step's time is the target's cost at the batch's total rows plus the drafter's steps (level
j >= 2 runs over the sequences still drafting at depth j; draft 1 comes from the carried
distribution), from `StepCostModel`: a cost
curve (ms vs rows) measured at start-up or loaded from a cache, corrected online from the
step times the runtime observes.

The choice is greedy in marginal tokens per marginal row: the sequence whose next option wins
the most per extra row goes first, and the best configuration seen along the way is kept
(a cost curve with steps makes the rate non-monotone, so the search does not stop at the
first loss). Per-request caps (`SamplingParams.spec`, `num_spec_tokens`, room before
max_tokens) bound the options; the controller never exceeds them.

Detaching. Choosing no drafts does not make a step free: a model drafter still follows every
speculating sequence (its catch-up runs the head or the draft model over each new token,
~10% of a target step here), so a batch where the controller keeps choosing 0 is slower than
plain decoding. A sequence is therefore detached (the scheduler stops speculating for it for
the rest of the request and the drafter stops following it: `should_detach`, after which it
costs exactly a plain decode) once it has gone without drafts for
- `detach_hopeless` steps in which the batch itself ruled speculation out (had all its
  drafting sequences taken any one of their options with an average sequence's acceptance,
  none would have beaten plain decoding: a compute-bound batch, which no acceptance of its
  own changes; judged only once a plain step of the batch's size has been timed), or
- `detach_after` steps whatever the reason (its own acceptance stayed too low: slower,
  since acceptance is noisy and `relax` re-probes it meanwhile).
Under sustained load every sequence detaches within a few steps. A new request is admitted
detached at once where the batch it joins already rules speculation out (`admits_drafts`):
following it would cost its prompt's catch-up and a few steps' for nothing (at concurrency 2
on the Xeon every request of the draft and EAGLE modes detached after its 3 steps,
docs/controller.md). Every `probe_every`-th such request is admitted attached anyway, so
the cost model keeps seeing speculative steps and a load that has eased is noticed.

A lookup branch (lookup_branch.py) rides on every option that drafts: up to L more rows,
verified where the sequence's history matched, and tokens beyond the drafts' reach where the
target copies. Each sequence's `BranchYield` (what its branch added: tokens beyond what its
drafts' acceptance predicted, and rows: how often its lookup matches and how many it then
verifies) is added to each of its options that draft: the tokens to the option's, the rows
as a branch that fires or not, the step priced at its expected cost over how many of the
batch's branches fire (`_Branches`: the curve rises in steps, and its cost at the expected
rows under-priced a tree with its branch by ~3.6 ms). Without it the controller priced a
chain of 3 as 4 rows where the step verified up to 12, and counted none of the copied
tokens: at concurrency 8 on the Xeon it ran at 0.90-0.98x of plain decoding where fixed
drafts with the branch ran at 1.05-1.20x (session 21). Where the scheduler looked the branch
up before the choice (Candidate.branch: the lookup runs on the host history, which is
complete when the next step is planned) the branch is priced as it is: its rows if it
matched, with the tokens branches won on the steps where they fired (`when_fired`), else
nothing. Paired against pricing by how often it fires (AMD EPYC Zen 5, session 32): eagle
0.953 / mtp:3 0.966 at concurrency 8 for the old pricing (which detached 2-3x as many; an A/A
pair there spreads ~4%), eagle 0.993 at batch 1. A known branch's length is a choice too: the step is searched with the
branches whole and cut (`_branch_caps`), each row priced by its reach over every request
(`BranchYield.reached`), and the scheduler cuts them as chosen (`branch_cap`).

Pure and deterministic given its inputs: tests drive it with a scripted cost model.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Protocol


@dataclass(frozen=True)
class SpecOption:
    """One thing a sequence may do this step."""

    rows: int  # verify rows on top of the sequence's own tokens (chain: k; tree: its nodes)
    depth: int  # how many draft positions can be accepted (chain: k; tree: its depth)
    tree: bool = False  # a tree: its acceptance is tracked apart from the sequence's chains

    @property
    def k(self) -> int:
        return self.rows


PLAIN = SpecOption(0, 0)


def chain_options(cap: int) -> list[SpecOption]:
    """0..cap drafts in a chain."""
    return [SpecOption(k, k) for k in range(cap + 1)]


def tree_options(nodes: int, depth: int, cap: int, chains: bool = True) -> list[SpecOption]:
    """No tree; a chain of 1..depth drafts along the tree's top-ranked path (chains: the
    drafter grows them, EAGLE's fixed shape does); or the whole tree when the request has room
    for it (cap >= nodes). Where a tree's extra rows cost more than its extra branches win
    (a compute-bound CPU, a busy batch) the chain still speculates."""
    out = [PLAIN] + (chain_options(min(depth, cap))[1:] if chains and nodes > 0 else [])
    if cap >= nodes > 0 and (nodes, depth) != (out[-1].rows, out[-1].depth):
        out.append(SpecOption(nodes, depth, tree=True))
    return out


@dataclass(frozen=True)
class Candidate:
    """A decoding sequence the controller chooses for."""

    key: Hashable  # the sequence (its acceptance history)
    options: list[SpecOption]  # options[0] is PLAIN; ordered by rows
    # The rows of its lookup branch if it drafts this step, where the lookup ran before the
    # choice (the scheduler's, on the host history; 0: nothing matched); None: not known, priced
    # by how often its branch fires (_Branches).
    branch: int | None = None


class CostModel(Protocol):
    def step_ms(self, rows: int) -> float: ...  # a target step over `rows` query rows

    def drafter_ms(self, rows: int) -> float: ...  # one drafter step over `rows` sequences

    # What a step pays beyond its rows and the drafter's levels when `speculating` sequences in
    # it draft (the proposal, verification and the speculative path's host work); 0 for none.
    # tree: a step that verifies at least one tree (EAGLE), priced apart from chains-only steps.
    def spec_overhead_ms(self, speculating: int, tree: bool = False) -> float: ...

    # catch_up_rows: prompt rows the drafter caught up on at the head of this step (queued
    # behind the previous step, so its time lands in this one's); prompt_rows: the step's rows
    # that are prompt chunks.
    def observe(self, rows: int, drafter_rows: list[int], ms: float, speculating: int = 0,
                catch_up_rows: int = 0, tree: bool = False, prompt_rows: int = 0) -> None: ...

    # Whether a plain step over `rows` rows (its rows bucket) has been timed: a batch is ruled
    # out for speculation only against a measured plain step.
    def plain_measured(self, rows: int) -> bool: ...


def non_decreasing(values: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): a run
    that dips is replaced by its mean."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


class StepCostModel:
    """Target ms vs total query rows: piecewise linear between measured points, linear past
    the last; the drafter step is `drafter_fraction` of the measured (uncorrected) forward
    over the same rows.

    Online correction: each observed plain step (its rows and its wall time) updates an
    exponential average of observed / predicted for the rows bucket it fell in (buckets by
    powers of two; a bucket's first steps as their plain mean), so a curve measured under
    other conditions (another context length, a busier machine) bends toward what the server
    actually sees. A correction per bucket, not
    one scale, because one scale never changes a decision (the rate's argmax is scale-free):
    only the curve's shape does. The corrected curve is kept non-decreasing (`_below`).

    A speculative step's excess over that prediction (rows plus the drafter's levels, as the
    curve is corrected when the price is asked: the step is kept whole) is the price of
    speculating: a forward over the same rows costs the same either way, so what is
    left is the proposal, the verification and their host work, which a bare cost curve does
    not see. It grows with the number of sequences that draft (each has its own proposal,
    acceptance walk and KV moves), so it is learned per bucket of that number (powers of
    two) and apart for steps that verify a tree (EAGLE) and chains-only steps. Across the
    buckets it is fitted as a fixed part plus a part per sequence (`_fixed_plus_per_sequence`):
    a bucket not yet seen is priced from that line, a seen one from its own median moved
    along the line's slope; a kind not yet seen at 0. One
    price for every batch size was tried first: learned mostly in small batches, it made a
    draft in a batch of 8 look nearly free (docs/controller.md)."""

    def __init__(self, points: dict[int, float], drafter_fraction: float = 0.0, alpha: float = 0.1,
                 drafter_points: dict[int, float] | None = None):
        """drafter_points: a drafter step's measured ms vs the sequences it runs over (batch 1,
        batch 8), which replaces drafter_fraction where given: a fixed fraction, measured once
        on one machine, priced the head's levels at 0.10 of a target step where the int8 head
        with its 8k vocabulary took 0.036, and the controller chose 1-2 drafts at batch 1
        where full k ran 10% faster (session 22)."""
        if not points or 1 not in points:
            raise ValueError("a step-cost curve needs at least the 1-row cost")
        self.drafter_points = sorted((int(r), float(ms)) for r, ms in (drafter_points or {}).items())
        self.rows = sorted(points)
        # A forward over more rows never costs less than one over fewer: a measured dip is the
        # machine's noise, and a dip is exactly what makes one k look cheaper than a smaller one
        # (a start-up calibration with 2 rows at 0.93 of 1 and 4 at 1.39 kept mtp:3 at k=1 on
        # 90% of its steps, session 15). So the curve is the closest non-decreasing one.
        self.ms = non_decreasing([float(points[r]) for r in self.rows])
        self.drafter_fraction = drafter_fraction
        self.alpha = alpha
        self.correction: dict[int, float] = {}  # bucket → observed / predicted (EMA), plain steps
        self.plain_steps = Counter()  # bucket → plain steps observed in it
        # (bucket of speculating sequences, tree step?) → its speculative steps: (ms, rows,
        # drafter levels, sequences drafting), the last `window` of them, priced against the
        # curve when asked; the first one is skipped (_Overhead). Tree steps apart: a tree's
        # expansion and walk cost more than a chain's, and one median over both priced EAGLE's
        # trees at its chains' price (session 9).
        self.overhead: dict[tuple[int, bool], _Overhead] = {}
        self.clock = 0  # steps observed (of every kind): the age of a price's steps
        self._prices: dict[int, float] = {}  # id(_Overhead) → its price on the current curve
        self._floors: dict[int, float] = {}  # bucket → _below(bucket) on the current corrections
        # rows → step_ms(rows) on the current corrections: a controller's search prices up to
        # EXACT + 1 row counts a step for the branches that may fire (_Branches), mostly the same
        # few again and again. Bounded: without plain steps nothing else clears it.
        self._steps: dict[float, float] = {}
        # (sequences, tree) → spec_overhead_ms: a step's search asks for the same few a dozen
        # times (each a fit over the buckets); every observed step may change them.
        self._overheads: dict[tuple[int, bool], float] = {}
        # rows → drafter_ms(rows): fixed by the measured points, asked for ~20 times a step.
        self._drafter: dict[int, float] = {}

    @classmethod
    def from_report(cls, report: dict, drafter: str | None = None, batch=None) -> "StepCostModel":
        """From `overlap bench --step-costs --json` (runtime/step_costs.py): total rows =
        batch × rows per sequence for each measured batch; the drafter's fraction from the
        report's head (mtp/eagle) or draft (draft-target) measurements."""
        points: dict[int, float] = {}
        for b, costs in report["target"].items():
            for rows, ms in costs.items():
                points.setdefault(int(b) * int(rows), float(ms))
        fraction, drafter_points = 0.0, None
        key = {"mtp": "head", "eagle": "head", "draft": "draft"}.get(drafter or "")
        if key and f"{key}_fraction" in report:
            fraction = min(float(v) for v in report[f"{key}_fraction"].values())
        if key and key in report:
            drafter_points = {int(b): float(ms) for b, ms in report[key].items()}
        return cls(points, fraction, drafter_points=drafter_points)

    def as_dict(self) -> dict:
        # String keys: the stats travel as JSON too (HTTP, bench reports).
        return {"points": {str(r): ms for r, ms in zip(self.rows, self.ms)}, "drafter_fraction": self.drafter_fraction,
                "drafter_points": {str(r): ms for r, ms in self.drafter_points},
                "correction": {str(1 << (b - 1)): c for b, c in sorted(self.correction.items())},
                "spec_overhead_ms": {("tree " if t else "") + str(1 << (b - 1)): self._price(o)
                                     for (b, t), o in sorted(self.overhead.items()) if o.ready}}

    @staticmethod
    def _bucket(rows: float) -> int:  # rows may be expected rows (a lookup branch's average)
        return max(round(rows), 1).bit_length()

    def _base(self, rows: int) -> float:
        rows = max(rows, 1)
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.ms[i]
        if i == len(self.rows):  # past the last point: the last segment's slope (or per-row cost)
            if len(self.rows) == 1:
                return self.ms[0] * rows
            r0, r1, m0, m1 = self.rows[-2], self.rows[-1], self.ms[-2], self.ms[-1]
        else:
            r0, r1, m0, m1 = self.rows[i - 1], self.rows[i], self.ms[i - 1], self.ms[i]
        return m0 + (m1 - m0) * (rows - r0) / (r1 - r0)

    def step_ms(self, rows: float) -> float:
        ms = self._steps.get(rows)
        if ms is None:
            if len(self._steps) >= 4096:
                self._steps.clear()
            bucket = self._bucket(rows)
            ms = self._steps[rows] = max(self._base(rows) * self._correction(bucket), self._below(bucket))
        return ms

    def _below(self, bucket: int) -> float:
        """The most a step of fewer rows (a lower bucket, at its top row) is predicted to cost:
        the corrected curve is kept non-decreasing, as the bare one is. Each bucket's
        correction is learned on its own steps (at batch 1 the 16-31-row bucket's from the
        warm-up's prompt chunks, 1.16, the 8-15-row one's from short chunks, 1.56), so a verify
        step over 16 rows was predicted at 34 ms where one over 8 was at 43: a tree with its
        lookup branch took 49, and the 15 ms of excess, charged to the trees' price of
        speculating, priced the tree 4 ms over chains that cost 3 less, and the controller
        verified chains on 80% of the steps where the tree runs 3% faster (session 28)."""
        if bucket not in self._floors:
            self._floors[bucket] = max((self._base((1 << b) - 1) * self._correction(b) for b in range(1, bucket)),
                                       default=0.0)
        return self._floors[bucket]

    def _correction(self, bucket: int) -> float:
        """The bucket's correction; one not observed yet borrows the nearest observed bucket's
        (the lower on a tie). Left at 1 (the bare forward), a batch of 8 rows whose plain steps
        were not seen yet was priced at 20 ms where they take 29 (the host work of 8 sequences
        around the forward), while its speculative steps' price was learned from what they
        took: plain decoding looked 40% cheaper than it is and at concurrency 8 EAGLE's
        sequences detached before a plain step was measured (session 23)."""
        if bucket in self.correction:
            return self.correction[bucket]
        if not self.correction:
            return 1.0
        return self.correction[min(self.correction, key=lambda b: (abs(b - bucket), b))]

    def drafter_ms(self, rows: int) -> float:
        # A fraction of the measured forward, not of the corrected step: the correction is what
        # a whole step pays beyond its forward (scheduling, sampling, the host's share), which a
        # drafter level inside the step does not pay again. Of the corrected step, a head level
        # at batch 1 was priced 3.1 ms where the 1-row correction was 1.48, and the controller
        # chose k = 1 where fixed k = 3 ran 9% faster (docs/controller.md, session 9).
        if not rows:
            return 0.0
        ms = self._drafter.get(rows)
        if ms is None:
            if self.drafter_points:
                ms = _interpolate(self.drafter_points, rows)
            else:
                ms = self.drafter_fraction * self._base(rows)
            self._drafter[rows] = ms
        return ms

    def spec_overhead_ms(self, speculating: int, tree: bool = False) -> float:
        key = (speculating, tree)
        if key not in self._overheads:
            self._overheads[key] = self._overhead_ms(speculating, tree)
        return self._overheads[key]

    def _overhead_ms(self, speculating: int, tree: bool) -> float:
        # This kind's buckets only: a kind not seen yet is free, so it gets tried and measured
        # (borrowing the tree's price kept EAGLE's cheaper chains from ever being tried).
        seen = {b: o for (b, t), o in self.overhead.items() if o.ready and t == tree}
        if speculating <= 0 or not seen:
            return 0.0
        if len(seen) == 1:
            # One bucket: nothing says how its price splits. It shrinks in proportion below the
            # bucket's sequences and stays flat above them: optimistic either way, so another
            # batch size gets tried, measured, and fitted.
            (only,) = seen.values()
            return self._price(only) * min(speculating / only.count, 1.0)
        fixed, per_seq = _fixed_plus_per_sequence([(o.count, self._price(o)) for o in seen.values()])
        own = seen.get(self._bucket(speculating))
        if own is not None:  # its own bucket's price, moved along the fitted slope within it
            return self._price(own) + per_seq * (speculating - own.count)
        return fixed + per_seq * speculating

    def _predicted(self, rows: int, drafter_rows) -> float:
        """A step's predicted ms over `rows` rows with the drafter's levels, before any price
        of speculating."""
        return self.step_ms(rows) + sum(self.drafter_ms(n) for n in drafter_rows if n)

    def _price(self, overhead: "_Overhead") -> float:
        """A bucket's price of speculating against the curve as corrected now (cached until an
        observed step changes the curve or the bucket)."""
        key = id(overhead)
        if key not in self._prices:
            self._prices[key] = overhead.price(self._predicted)
        return self._prices[key]

    def observe(self, rows: int, drafter_rows: list[int], ms: float, speculating: int = 0,
                catch_up_rows: int = 0, tree: bool = False, prompt_rows: int = 0) -> None:
        self._overheads.clear()
        if ms <= 0:
            return
        self.clock += 1
        # A price taken from steps this old no longer stands: a host's slow spell (seconds to a
        # minute on a shared VM) lands on whichever kind ran then, and once that kind is priced
        # out it runs no more steps to unlearn it. On an AMD EPYC, mtp:3 at batch 1: a spell put
        # 50 ms steps into the price of speculating (21.7 ms a step where 2-4 is usual); every
        # sequence detached, every later request was turned away, and the 3 steps of one probe
        # in 8 requests could not outvote the spell's in the window: the round ran at 0.96x of
        # plain decoding, 1.82x fixed (session 29). An expired bucket is priced as one not seen
        # yet: from the line through its kind's other buckets or, with none left, not at all
        # (free), so the next request drafts and measures it.
        for overhead in self.overhead.values():
            if overhead.expire(self.clock):
                self._prices.pop(id(overhead), None)
        # The drafter's catch-up over the previous step's prompt rows ran on the device just
        # before this step: a one-off cost per request, not a price of this step's shape (a
        # request's first speculative step carried its prompt's catch-up, and two such steps
        # priced speculation out at batch 1 for good: docs/controller.md, session 8). What is
        # learned from is the step's own time, its predicted share taken out.
        ms = max(ms - self.drafter_ms(catch_up_rows), 0.0)
        if speculating:
            # Kept whole, and priced against the curve as it is when asked (_price): a price
            # taken once as the excess over the curve of that moment counted the host work of a
            # batch twice once plain steps had corrected the curve for it (concurrency 16, mtp:3:
            # 40 ms a step learned before any plain step of 16 rows was seen, session 27).
            overhead = self.overhead.setdefault((self._bucket(speculating), tree), _Overhead())
            overhead.add(ms, rows, tuple(drafter_rows), speculating, self.clock)
            self._prices.pop(id(overhead), None)  # the other buckets' prices stand
            return
        # Only decode steps teach the curve: a step holding a prompt chunk pays for a request's
        # start (its pages, prefix lookup, first sampling) beyond its rows. Taught by prompt
        # chunks, the buckets a verify step falls in read 1.8-1.9 at batch 1 where decode steps
        # read 1.16, and speculation, priced by its excess over that and never below 0, was
        # taken for 1.6x a plain step where it costs 1.2x (paired at batch 1, EAGLE: 8% more
        # time a token, no drafts chosen on 258 steps); at concurrency 16 the 64-127-row bucket
        # read 1.35 from prompt chunks against the decode buckets' 1.16-1.18 and detached 15 of
        # 20 sequences as hopeless (session 28). A bucket no decode step reached borrows the
        # nearest one's correction.
        predicted = self._base(rows)
        if predicted <= 0 or prompt_rows:
            return
        b = self._bucket(rows)
        ratio = min(4.0, max(0.25, ms / predicted))  # one stalled step must not rewrite the curve
        old = self._correction(b)
        # A bucket's own first steps weigh 1, 1/2, 1/3, ... (their mean) until that falls to
        # alpha: from the borrowed value at alpha, a batch of 16 priced at 1.0 took 20 plain steps
        # to reach its 1.75, and was detached meanwhile (session 27).
        self.plain_steps[b] += 1
        self.correction[b] = old + max(self.alpha, 1.0 / self.plain_steps[b]) * (ratio - old)
        self._floors.clear()
        self._steps.clear()
        self._prices.clear()  # every price is taken against the curve

    def plain_measured(self, rows: int) -> bool:
        """Whether a plain step in the rows bucket of `rows` has been observed."""
        return self.plain_steps[self._bucket(rows)] > 0


def _interpolate(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y) points; past the ends, the nearest segment's
    line (one point: y proportional to x), never below 0."""
    if len(points) == 1:
        return points[0][1] * x / points[0][0]
    i = min(max(bisect.bisect_left([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


def _fixed_plus_per_sequence(points: list[tuple[float, float]]) -> tuple[float, float]:
    """The price of speculating as fixed + per_seq · sequences, fitted (least squares, both
    >= 0) to the buckets' (sequences, ms). Measured on the Xeon at batch 1, 2-3, 4-7 and 8
    (mtp:3 + branch, fixed k): 8.9, 12.3, 20.5, 24.5 ms, about 7 + 2.3 a sequence; the price
    per sequence of the nearest bucket, used before, read 4-7 sequences' 20 ms as 40 for 8
    and priced speculation out at concurrency 8. Two buckets at least."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return max(mean_y, 0.0), 0.0
    fixed = mean_y - slope * mean_x
    if fixed < 0:  # through the origin instead
        return 0.0, max(sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0)
    return fixed, slope


class _PricedStep(NamedTuple):
    """One speculative step a bucket prices from."""

    ms: float
    rows: int
    drafter_rows: tuple  # the drafter's levels: sequences each ran over
    speculating: int  # sequences that drafted
    clock: int  # StepCostModel.clock when it was observed: its age


@dataclass
class _Overhead:
    """The price of speculating in one bucket: the median of its last `window` speculative
    steps' excess ms over the curve as it is corrected now (and of their drafting sequences).
    The median, not an average, and the bucket's first step skipped: the first speculative
    step of a kind pays one-time costs (a first EAGLE tree step was measured at 57 ms against
    14 predicted), and one such step, averaged in, priced trees out for good: the controller
    never drafted again to unlearn it.
    And no price before `min_steps` steps are in: a median of one is that one step. At
    concurrency 16 (mtp:3) the second speculative step of the batch still paid warm-up (91 ms
    against 43 predicted); priced from it alone, speculation for 16 sequences cost as much as
    the step itself, every sequence was detached three steps later and the run decoded plain
    (session 27, docs/controller.md). Until a bucket is priced the line through the others
    prices it, or nothing does (it is tried: optimistic, as a kind not seen yet is).
    A step older than `max_age` observed steps (of any kind) no longer counts
    (StepCostModel.observe says why)."""

    window: int = 8
    min_steps: int = 3
    max_age: int = 128  # in steps the cost model observed: ~1.5 s at batch 1, ~3 s at a batch of 8
    steps: int = 0
    recent: list[_PricedStep] = field(default_factory=list)

    def add(self, ms: float, rows: int, drafter_rows: tuple, speculating: int, clock: int) -> None:
        self.steps += 1
        if self.steps == 1:
            return
        self.recent = (self.recent + [_PricedStep(ms, rows, drafter_rows, speculating, clock)])[-self.window:]

    def expire(self, clock: int) -> bool:
        """Drop the steps observed more than max_age steps before `clock`; whether any went."""
        if not self.recent or clock - self.recent[0].clock <= self.max_age:
            return False
        self.recent = [s for s in self.recent if clock - s.clock <= self.max_age]
        return True

    @property
    def ready(self) -> bool:
        return len(self.recent) >= self.min_steps

    def price(self, predicted) -> float:
        """The median excess of the recent steps over predicted(rows, drafter levels), each
        clamped to [-half, all] of its prediction (one stalled step must not rewrite the price).

        Below zero too: the corrected curve scales the bare forward's cost of more rows by the
        1-row decode step's host share, so at batch 1 it predicts a verify step above what it
        takes, and more so the more rows it verifies. Floored at 0, EAGLE's chains and trees
        both read 0 and the tree, with the most rows, was over-priced the most (chains chosen
        on 833 of 1290 steps; priced signed, chains -5.8 ms and trees -2.1, on 432: 2.9% less
        time a token, paired, session 28)."""
        excess = []
        for step in self.recent:
            p = predicted(step.rows, step.drafter_rows)
            excess.append(min(max(step.ms - p, -0.5 * p), p))
        return _median(excess)

    @property
    def count(self) -> float:
        return _median([s.speculating for s in self.recent])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class Acceptance:
    """One sequence's per-position acceptance: a[m] = P(draft m accepted | drafts < m were),
    an exponential average over the steps that verified position m. A position not measured
    yet reads from `base` (the population of every request: what an unknown request most
    likely does) or, without one, the fixed `prior`."""

    prior: float
    alpha: float
    rates: list[float] = field(default_factory=list)
    base: "Acceptance | None" = None

    def at(self, position: int) -> float:  # 1-based
        if position <= len(self.rates):
            return self.rates[position - 1]
        return self.base.at(position) if self.base is not None else self.prior

    def expected_tokens(self, depth: int) -> float:
        """1 (the recovered or bonus token) + the expected accepted drafts of a chain `depth` long."""
        total, reach = 1.0, 1.0
        for m in range(1, depth + 1):
            reach *= self.at(m)
            total += reach
        return total

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A verified step: drafts 1..num_accepted accepted, num_accepted+1 (if drafted) rejected;
        deeper positions were not tested, so they keep their estimate."""
        tested = min(num_drafts, num_accepted + 1)
        while len(self.rates) < tested:
            self.rates.append(self.at(len(self.rates) + 1))
        for m in range(1, tested + 1):
            hit = 1.0 if m <= num_accepted else 0.0
            self.rates[m - 1] += self.alpha * (hit - self.rates[m - 1])

    def relax(self, rate: float) -> None:
        """A step without drafts: drift toward the population (or the prior), so a sequence
        turned off is tried again eventually (its acceptance may have recovered) instead of
        never being measured."""
        for m in range(len(self.rates)):
            toward = self.base.at(m + 1) if self.base is not None else self.prior
            self.rates[m] += rate * (toward - self.rates[m])


@dataclass
class BranchYield:
    """What a sequence's lookup branch adds to a step where it drafts: the rows it verifies
    beyond the drafts (0 on a step where no lookup matched) and the tokens it wins beyond what
    the drafts' acceptance predicted (a copy runs past the drafts' depth), exponential
    averages over its speculative steps. A sequence not measured yet reads from `base`
    (every request's), as Acceptance does; the first measurement of one without a base is
    taken whole."""

    alpha: float
    rows: float = 0.0
    tokens: float = 0.0
    fires: float = 0.0  # of its drafting steps, the share where a lookup matched (rows > 0)
    steps: int = 0
    # What it wins on the steps where a lookup matched (`tokens` averages every drafting step,
    # those without a branch too), less the reach of the rows it verified there (so a branch
    # verified whole and one cut short teach the same number), and how many such steps it saw.
    fired_tokens: float = 0.0
    fired_steps: int = 0
    # reach[j]: of the fired steps that verified j + 1 branch rows or more, the share that
    # accepted j + 1 tokens or more (past the drafts' depth only the branch's can be): what
    # the row adds, so a branch cut to fewer rows is priced without the rest (`when_fired`).
    # Every request's only (a sequence's own reads it): one request's few steps set a row at
    # 0 on its first miss, its branches were then cut above it, and the row never measured.
    reach: list = field(default_factory=list)
    base: "BranchYield | None" = None

    def expected(self) -> tuple[float, float]:
        """(rows, tokens) a drafting step of this sequence adds for its branch."""
        if not self.steps and self.base is not None:
            return self.base.expected()
        # A branch never costs tokens (the walk takes the drafts' path where the copy is
        # wrong): a negative residual is the acceptance model's noise.
        return self.rows, max(self.tokens, 0.0)

    def firing(self) -> tuple[float, float]:
        """(p, rows): how likely a drafting step's lookup matches, and the rows it then
        verifies. A step verifies all of a branch or none of it (`_Branches` says why that
        matters)."""
        if not self.steps and self.base is not None:
            return self.base.firing()
        if self.fires <= 0.0:
            return 0.0, 0.0
        return min(self.fires, 1.0), self.rows / self.fires

    def when_fired(self, rows: int) -> float:
        """The tokens a drafting step's branch adds beyond the drafts' prediction where its
        lookup matched and `rows` of it are verified (a step known to carry one)."""
        if not self.fired_steps:
            if self.base is not None and self.base.fired_steps:
                return self.base.when_fired(rows)
            # None seen fire: the average over every drafting step, over the share that fires.
            (_, tokens), (p, _) = self.expected(), self.firing()
            return tokens / p if p > 0.0 else tokens
        return max(self.fired_tokens + self.reached(rows), 0.0)

    def reached(self, rows: int) -> float:
        """The summed reach of a branch's first `rows` rows. Rows never verified yet (a step
        cuts its branches, or a longer one than seen) continue the last two seen at their
        ratio: a copy that ran j tokens runs on about as it did, and a row priced at nothing
        would be cut for good, never measured (every branch was cut to 4 rows at batch 1,
        8% slower than 12 whole, in session 32's first try)."""
        reach = self.base.reach if self.base is not None else self.reach  # every request's
        total = sum(reach[:rows])
        if rows > len(reach) and reach:
            ratio = min(reach[-1] / reach[-2], 1.0) if len(reach) > 1 and reach[-2] > 0.0 else 1.0
            last = reach[-1]
            for _ in range(rows - len(reach)):
                last *= ratio
                total += last
        return total

    def observe(self, rows: int, extra_tokens: float, accepted: int = 0) -> None:
        if rows > 0:
            if self.base is None:  # the reach is kept over every request only (reached)
                for j in range(rows):
                    hit = float(accepted > j)
                    if j < len(self.reach):
                        self.reach[j] += self.alpha * (hit - self.reach[j])
                    else:
                        self.reach.append(hit)
            won = extra_tokens - self.reached(rows)
            if not self.fired_steps:  # its first: taken whole, or from every request's
                base = self.base is not None and self.base.fired_steps
                self.fired_tokens = self.base.fired_tokens if base else won
            self.fired_steps += 1
            self.fired_tokens += self.alpha * (won - self.fired_tokens)
        if not self.steps:
            if self.base is None or not self.base.steps:  # the first measurement anywhere: taken whole
                self.rows, self.tokens, self.fires = rows, extra_tokens, float(rows > 0)
            else:  # from every request's, then moved by its own
                (self.rows, self.tokens), self.fires = self.base.expected(), self.base.fires
        self.steps += 1
        self.rows += self.alpha * (rows - self.rows)
        self.tokens += self.alpha * (extra_tokens - self.tokens)
        self.fires += self.alpha * ((rows > 0) - self.fires)


class _Branches:
    """The lookup branches of a batch's drafting sequences, for the step's predicted time:
    branch i adds its r_i rows with probability p_i (its lookup matched) and none otherwise,
    so the step's time is the expectation of the target's cost over how many of them fire
    (a Poisson-binomial count), each that fires adding the branches' mean length.

    Not the cost at the expected rows: the curve rises in steps (a register tile of the
    linear kernel holds 6 rows on AVX-512 BF16), and at batch 1 a tree of 9 rows with a branch
    of 8 that fired on ~25% of the steps was priced at 9 + 2 rows, 19.3 ms, where a step with
    the branch took 22.9 and one without 19.4; a chain of 3 was over-priced by ~0.5 ms the
    other way, and the controller gave the tree half the steps where chains alone ran 6.5%
    faster (AMD EPYC Zen 5, session 30; docs/controller.md). Exact up to `EXACT` branches (at most
    EXACT + 1 points of the curve); beyond, where the count's spread covers a smooth stretch
    of the curve, three points of a normal with its mean and variance (Gauss-Hermite: exact
    for a curve of degree 5 or less), so a step's price costs a bounded number of lookups
    at any batch size."""

    EXACT = 8

    def __init__(self):
        self.count = [1.0]  # count[c]: probability that c branches fire (while n <= EXACT)
        self.n = 0
        self.mean = 0.0  # Σ p_i: branches expected to fire
        self.variance = 0.0  # Σ p_i (1 - p_i)
        self.rows = 0.0  # Σ p_i r_i: rows expected
        self._points: list[tuple[float, float]] | None = None  # points(), until a branch is added

    def add(self, p: float, rows: float, times: int = 1) -> None:
        """`times` more branches, each firing with probability p for `rows` rows."""
        if p <= 0.0 or rows <= 0.0:
            return
        self._points = None
        for _ in range(times):
            self.n += 1
            self.mean += p
            self.variance += p * (1.0 - p)
            self.rows += p * rows
            if self.n <= self.EXACT:
                self.count = [a * (1.0 - p) + b * p for a, b in zip(self.count + [0.0], [0.0] + self.count)]

    def points(self) -> list[tuple[float, float]]:
        """(extra rows, weight) pairs whose weighted cost is the step's expected cost (weights
        summing to 1)."""
        if self._points is None:
            self._points = self._spread()
        return self._points

    def _spread(self) -> list[tuple[float, float]]:
        if not self.n:
            return [(0.0, 1.0)]
        length = self.rows / self.mean
        if self.n <= self.EXACT:
            kept = [(c * length, w) for c, w in enumerate(self.count) if w > 1e-4]
            total = sum(w for _, w in kept)
            return [(rows, w / total) for rows, w in kept]
        spread = 3.0 ** 0.5 * self.variance ** 0.5 * length
        return [(max(self.rows - spread, 0.0), 1 / 6), (self.rows, 2 / 3), (self.rows + spread, 1 / 6)]


@dataclass
class TreeGain:
    """What a sequence's tree accepts beyond its top path (the chain it contains): drafts
    accepted off that path a step, an exponential average over its tree steps; `base`
    (every request's) until it has one. Never below 0: a tree holds its chain."""

    alpha: float
    value: float = 0.0
    steps: int = 0
    base: "TreeGain | None" = None

    def expected(self) -> float:
        if not self.steps and self.base is not None:
            return self.base.expected()
        return self.value

    def observe(self, gain: float) -> None:
        if not self.steps:
            self.value = gain if self.base is None or not self.base.steps else self.base.expected()
        self.steps += 1
        self.value += self.alpha * (max(gain, 0.0) - self.value)


@dataclass(frozen=True)
class ControllerConfig:
    enabled: bool = True  # off: every sequence verifies its cap (the fixed-k behaviour)
    prior: float = 0.6  # acceptance assumed before any request has been measured
    # Weight of the newest step in a sequence's acceptance average. Acceptance comes in bursts
    # (a miss or three, then a copied run): at 0.3 three misses cut an estimate to a third and
    # the sequence went plain or short for steps that fixed k would have won (batch 1, mtp:3:
    # 4.7% slower than fixed k); 0.1 recovered 3-5% of that at batch 1 and 10% at a batch of 8
    # (paired runs in one process, docs/controller.md, "Session 24"); 0.05 was no better.
    # The branch yields' averages (BranchYield) take the same weight.
    alpha: float = 0.1
    population_alpha: float = 0.02  # ... in the average over every request (a new request's prior)
    relax: float = 0.02  # per plain step, pull toward the population (re-probing a turned-off sequence)
    # Speculate only if the predicted rate beats plain decoding by this factor: a margin for
    # the cost model's error, which otherwise turns every predicted 1-4% gain into a loss
    # (measured: mtp at concurrency 2-4 chose drafts and ran at 0.88-0.93x, docs/controller.md).
    min_gain: float = 1.05
    detach_after: int = 16  # consecutive "no drafts" choices after which a sequence is detached (0: never)
    detach_hopeless: int = 3  # ... or this many of them in batches where speculation could not pay (0: never)
    probe_every: int = 8  # of the requests the batch would admit detached, this one in n starts attached (0: none)
    explore_branches: int = 8  # every n-th step verifies its known lookup branches uncut (0: never)


class SpeculationController:
    def __init__(self, cost: CostModel, config: ControllerConfig = ControllerConfig()):
        self.cost = cost
        self.config = config
        self.acceptance: dict[Hashable, Acceptance] = {}
        # Every request's verified steps: what a request not measured yet is expected to do.
        self.population = Acceptance(config.prior, config.population_alpha)
        # Trees accept more per depth than chains (several candidates a level): their own
        # averages, per sequence and over the population, so one never skews the other.
        self.tree_acceptance: dict[Hashable, Acceptance] = {}
        self.tree_population = Acceptance(config.prior, config.population_alpha)
        # Where the verifier reports what a tree's top path accepted on its own (the chain it
        # contains), a tree is priced as that chain plus its gain: the drafts accepted off the
        # top path. Chains and trees are then learned on the same steps; learned apart, the
        # chains' acceptance came from the easy stretches where chains were chosen and the
        # trees' from the rest (position 3: 0.75 against 0.50), and at batch 1 the controller
        # verified chains on 40-80% of the steps where the fixed tree ran faster (session 27).
        self.tree_gain: dict[Hashable, TreeGain] = {}
        self.tree_gain_population = TreeGain(config.population_alpha)
        # A lookup branch's yield, per sequence and over every request: nothing until a step
        # with a branch is observed (a drafter without one never adds any).
        self.branch: dict[Hashable, BranchYield] = {}
        self.branch_population = BranchYield(config.population_alpha)
        # The branch rows of this step's candidates whose lookup ran before the choice
        # (Candidate.branch): priced as they are, not by how often their branches fire.
        self._known_branch: dict[Hashable, int] = {}
        # The most rows of a known branch this step verifies (choose() sets it, trying each of
        # `_branch_caps` while it searches; the scheduler cuts each sequence's branch to it).
        self.branch_cap = 0
        self.chosen = Counter()  # k (verify rows) chosen per decoding sequence, over all steps
        self.steps = 0
        self.plain_streak: Counter = Counter()  # key → consecutive steps it was given no drafts
        self.hopeless_streak: Counter = Counter()  # key → of those, steps its batch ruled drafts out
        self.detached = 0  # sequences detached over the controller's life (at admission too)
        self.turned_away = 0  # requests the batch would have admitted detached (probes included)

    def _acc(self, key: Hashable, tree: bool = False) -> Acceptance:
        table, base = (self.tree_acceptance, self.tree_population) if tree else (self.acceptance, self.population)
        acc = table.get(key)
        if acc is None:
            acc = table[key] = Acceptance(self.config.prior, self.config.alpha, base=base)
        return acc

    def _branch(self, key: Hashable | None) -> tuple[float, float]:
        """(rows, tokens) the sequence's lookup branch adds to a drafting step (None: an average
        request's)."""
        rows = self._known_rows(key)
        if rows is not None:
            if not rows:
                return 0.0, 0.0
            return rows, self.branch.get(key, self.branch_population).when_fired(rows)
        if key is None or key not in self.branch:
            return self.branch_population.expected()
        return self.branch[key].expected()

    def _branch_firing(self, key: Hashable) -> tuple[float, float]:
        """(p, rows): how likely the sequence's lookup branch fires on a drafting step, and its
        rows when it does (BranchYield.firing; a known branch fires or not)."""
        rows = self._known_rows(key)
        if rows is not None:
            return (1.0, float(rows)) if rows else (0.0, 0.0)
        return self.branch.get(key, self.branch_population).firing()

    def _known_rows(self, key: Hashable | None) -> int | None:
        """The rows of the sequence's known branch this step verifies (cut to branch_cap; 0:
        nothing matched), None where its branch was not looked up before the choice."""
        full = self._known_branch.get(key)
        return None if full is None else min(full, self.branch_cap)

    def _drafted(self, key: Hashable | None, depth: int, tree: bool) -> float:
        """Expected tokens from a step's drafts alone (1 + those accepted) where the sequence
        (None: an average request) drafts a chain `depth` deep or, tree, its tree: the chain
        along its top path plus the tree's gain once a tree step reported its top path."""
        if tree and self.tree_gain_population.steps:
            if key is None:
                return self.population.expected_tokens(depth) + self.tree_gain_population.expected()
            gain = self.tree_gain.get(key, self.tree_gain_population)
            return self._acc(key).expected_tokens(depth) + gain.expected()
        if key is None:
            return (self.tree_population if tree else self.population).expected_tokens(depth)
        return self._acc(key, tree).expected_tokens(depth)

    def _priced(self, key: Hashable, options: list[SpecOption]) -> list[tuple[float, float]]:
        """Each option's (expected tokens of the step, expected verify rows beyond the
        sequence's own token) where the sequence takes it: its drafts' and, where it drafts,
        its lookup branch's."""
        branch_rows, branch_tokens = self._branch(key)
        return [(self._drafted(key, o.depth, o.tree) + branch_tokens, o.rows + branch_rows) if o.depth
                else (1.0, 0.0) for o in options]

    def _tokens(self, key: Hashable, option: SpecOption) -> float:
        return self._priced(key, [option])[0][0]

    def _rows(self, key: Hashable, option: SpecOption) -> float:
        return self._priced(key, [option])[0][1]

    # -- per step ----------------------------------------------------------------------------

    def choose(self, candidates: list[Candidate], other_rows: int = 0, other_tokens: int = 0) -> list[SpecOption]:
        """One option per candidate. other_rows: the batch's rows that are not decode rows of a
        candidate (prefill chunks, sequences that do not speculate); other_tokens: the tokens
        those produce (one per chunk that ends its prompt, one per plain decode)."""
        self.steps += 1
        self._known_branch = {c.key: c.branch for c in candidates if c.branch is not None}
        longest = max(self._known_branch.values(), default=0)
        self.branch_cap = longest
        if not self.config.enabled:
            picked = [c.options[-1] for c in candidates]
        else:
            best = None
            # Every `explore_branches`-th step verifies its branches whole: rows a cut keeps off
            # are measured still (their reach can change with the requests).
            explore = self.config.explore_branches and self.steps % self.config.explore_branches == 0
            caps = [longest] if explore else self._branch_caps(candidates, longest)
            for cap in reversed(caps):  # a tie keeps the longest
                self.branch_cap = cap
                rate, options = self._search(candidates, other_rows, other_tokens)
                if best is None or rate > best[0]:
                    best = (rate, options, cap)
            _, picked, self.branch_cap = best
        hopeless: dict[tuple, bool] = {}  # per set of options: the verdict is the batch's
        # The batch that could draft: candidates capped at plain decoding this step (no room
        # before max_tokens) decode beside it, as the other rows do.
        drafters = sum(1 for c in candidates if len(c.options) > 1)
        beside = len(candidates) - drafters
        for c, o in zip(candidates, picked):
            self.chosen[o.k] += 1
            if o.depth:
                self.plain_streak.pop(c.key, None)
                self.hopeless_streak.pop(c.key, None)
                continue
            self._acc(c.key).relax(self.config.relax)
            if c.key in self.tree_acceptance:
                self.tree_acceptance[c.key].relax(self.config.relax)
            self.plain_streak[c.key] += 1
            drafting = tuple(c.options[1:])
            if self.config.enabled and drafting:
                if drafting not in hopeless:
                    hopeless[drafting] = self._hopeless(drafting, drafters, other_rows + beside,
                                                        other_tokens + beside)
                self.hopeless_streak[c.key] += hopeless[drafting]
        return picked

    def should_detach(self, key: Hashable) -> bool:
        """Whether the sequence went long enough without drafts (see the module doc); True
        once: the controller then forgets it (the scheduler stops offering it drafts)."""
        after, hopeless = self.config.detach_after, self.config.detach_hopeless
        if not self.config.enabled:
            return False
        if not ((after and self.plain_streak.get(key, 0) >= after)
                or (hopeless and self.hopeless_streak.get(key, 0) >= hopeless)):
            return False
        self.forget(key)
        self.detached += 1
        return True

    def admits_drafts(self, batch: int, options: SpecOption | list[SpecOption], others: int = 0) -> bool:
        """Whether a request joining `batch` sequences that draft (itself included), beside
        `others` that do not (detached), starts attached: unless that batch rules out every one
        of its drafting `options` for an average request (the `detach_hopeless` verdict, given
        before the drafter has followed it; the same verdict `choose` gives a running batch)."""
        options = [options] if isinstance(options, SpecOption) else list(options)
        if not self.config.enabled or not self.config.detach_hopeless or \
                not self._hopeless(options, batch, others, others):
            return True
        self.turned_away += 1
        if self.config.probe_every and self.turned_away % self.config.probe_every == 0:
            return True  # a probe: keeps the step costs and acceptance measured
        self.detached += 1
        return False

    def _time(self, rows: float, levels: list[int], speculating: int, tree: bool = False,
              branches: _Branches | None = None) -> float:
        """Predicted ms of a step over `rows` rows, and the rows of the drafting sequences'
        lookup `branches` that fire, where `speculating` sequences draft and levels[j] of them
        run drafter level j + 2; tree: at least one of them a tree."""
        points = branches.points() if branches is not None else [(0.0, 1.0)]
        target = sum(w * self.cost.step_ms(rows + extra) for extra, w in points)
        return (target + sum(self.cost.drafter_ms(n) for n in levels if n)
                + self.cost.spec_overhead_ms(speculating, tree))

    def _hopeless(self, options, batch: int, other_rows: int = 0, other_tokens: int = 0) -> bool:
        """Whether every one of `options` loses to plain decoding for a batch of `batch`
        sequences that all take it with an average request's acceptance (the population's),
        beside `other_rows` rows making `other_tokens` tokens that do not speculate (prefill
        chunks, detached sequences): the batch, not the sequence, rules speculation out.

        The whole batch, not one sequence added to a plain batch: a drafter level over 8
        sequences costs less than twice one over 1, and a step's price of speculating is
        mostly paid once, whoever drafts; one sequence priced alone paid all of both, so at
        concurrency 8 the 8th request was admitted detached before any speculative step was
        measured, and a half-detached batch shared the price among fewer sequences until every
        request ran plain (session 23: fixed drafts ran 1.06-1.21x there). Every option, not
        only the cheapest: a chain of 3 (or a branch's copy) can pay where one draft does not
        (session 22)."""
        if batch <= 0:
            return False
        # Judged only against a measured plain step: before a plain step of this batch's size
        # has run, its price is the curve's guess (at concurrency 16 the bare forward, 26 ms
        # where the step took 45) and speculation was ruled out, and every sequence detached,
        # on it (session 27).
        if not self.cost.plain_measured(batch + other_rows):
            return False
        branch_tokens = self._branch(None)[1]
        branches = _Branches()
        branches.add(*self.branch_population.firing(), times=batch)
        plain = (batch + other_tokens) / self._time(batch + other_rows, [], 0) * self.config.min_gain
        for option in options:
            accepted = self._drafted(None, option.depth, option.tree)
            levels = [batch] * max(0, option.depth - 1)
            rows = other_rows + batch * (1 + option.rows)
            tokens = other_tokens + batch * (accepted + branch_tokens)
            if tokens / self._time(rows, levels, batch, option.tree, branches) > plain:
                return False
        return True

    @staticmethod
    def _branch_caps(candidates: list[Candidate], longest: int) -> list[int]:
        """The lengths a step may cut its known branches to: all of the longest, two thirds,
        one third, never shorter than one row past the deepest draft (the drafts' positions
        are not the branch's alone, so `BranchYield.reached` does not price them). A branch's last
        rows win little (a copy that ran 8 tokens seldom runs 12) and cost rows: at batch 1
        on the AMD EPYC a 12-token branch ran 2-3% faster than an 8-token one, at concurrency 8
        up to 5% slower (session 32), so the step weighs them against the curve."""
        floor = max((c.options[-1].depth for c in candidates), default=0) + 1
        caps = {longest} | {max(-(-longest * n // 3), floor) for n in (1, 2)}
        return sorted(c for c in caps if c <= longest) or [longest]

    def _search(self, candidates: list[Candidate], other_rows: int, other_tokens: int) -> tuple[float, list[SpecOption]]:
        """(the best predicted rate, the options that make it)."""
        n = len(candidates)
        level = [0] * n  # index into each candidate's options
        # Each option's expected (tokens, rows), priced once: the search revisits them (at batch
        # 1 these lookups were most of a choice's ~0.2 ms, on the host's critical path).
        priced = [self._priced(c.key, c.options) for c in candidates]
        rows = other_rows + n
        tokens = other_tokens + float(n)
        max_depth = max((c.options[-1].depth for c in candidates), default=0)
        drafting = [0] * (max_depth + 1)  # drafting[j]: sequences drafting at depth >= j (j >= 1)
        trees = 0  # sequences whose option is a tree
        branches = _Branches()  # the lookup branches of the sequences that draft
        plain_rate = tokens / self._time(rows, [], 0)
        best_rate, best_len, path = plain_rate * self.config.min_gain, 0, []

        def push(heap, i):
            if level[i] + 1 < len(priced[i]):
                (cur_tokens, cur_rows), (next_tokens, next_rows) = priced[i][level[i]: level[i] + 2]
                # Ordered per expected row (a branch at its mean rows); the rate below prices it
                # as it fires.
                heapq.heappush(heap, (-(next_tokens - cur_tokens) / max(1.0, next_rows - cur_rows), i))

        heap: list = []
        for i in range(n):
            push(heap, i)
        while heap:
            _, i = heapq.heappop(heap)
            cur, nxt = candidates[i].options[level[i]], candidates[i].options[level[i] + 1]
            tokens += priced[i][level[i] + 1][0] - priced[i][level[i]][0]
            rows += nxt.rows - cur.rows
            if nxt.depth and not cur.depth:  # it starts drafting: its branch may fire
                branches.add(*self._branch_firing(candidates[i].key))
            for j in range(cur.depth + 1, nxt.depth + 1):
                drafting[j] += 1
            level[i] += 1
            path.append(i)
            # Draft 1 comes from the carried distribution; each deeper one costs a drafter step.
            trees += nxt.tree - cur.tree
            rate = tokens / self._time(rows, drafting[2:], drafting[1], trees > 0, branches)
            if rate > best_rate:
                best_rate, best_len = rate, len(path)
            push(heap, i)
        final = [0] * n
        for i in path[:best_len]:
            final[i] += 1
        return best_rate, [c.options[final[i]] for i, c in enumerate(candidates)]

    # -- feedback ----------------------------------------------------------------------------

    def observe(self, key: Hashable, num_drafts: int, num_accepted: int, tree: bool = False,
                depth: int = 0, branch_rows: int | None = None, top_accepted: int = -1) -> None:
        """A sequence's verified step (num_drafts: drafts proposed, or the deepest path: a tree's
        depth, or a lookup branch's length where it runs deeper). branch_rows: the rows its
        lookup branch verified beyond the `depth`-deep option it took (0: no lookup matched;
        None: the step reserved no branch). top_accepted: on a tree, what its top path alone
        accepted (-1: not reported)."""
        if num_drafts and branch_rows is not None and depth:
            # The branch's tokens: what the step produced beyond what the drafts' acceptance,
            # before this step, predicted for the option (positions the branch reached past
            # the option's depth are what that prediction leaves out).
            extra = num_accepted + 1 - self._drafted(key, depth, tree)
            if key not in self.branch:
                self.branch[key] = BranchYield(self.config.alpha, base=self.branch_population)
            self.branch[key].observe(branch_rows, extra, num_accepted)
            self.branch_population.observe(branch_rows, extra, num_accepted)
            # The acceptance learns positions 1..depth only: the deepest path may be the
            # branch's, and a miss past the option's depth is the branch's, not a draft the
            # option never made (a chain of 2 beside an 8-token branch that missed at once
            # had its position 3 marked rejected, and a request kept at k = 2 could never
            # show that a third draft lands).
            num_drafts, num_accepted = min(num_drafts, depth), min(num_accepted, depth)
        if not num_drafts:
            return
        if not (tree and top_accepted >= 0):
            self._acc(key, tree).observe(num_drafts, num_accepted)
            (self.tree_population if tree else self.population).observe(num_drafts, num_accepted)
            return
        # A tree that reports its top path: the chain it contains, verified on this step, and
        # what its other branches added (it is priced from these, never from the trees' own
        # averages: _drafted).
        on_top = min(top_accepted, num_accepted)
        self._acc(key).observe(num_drafts, on_top)
        self.population.observe(num_drafts, on_top)
        if key not in self.tree_gain:
            self.tree_gain[key] = TreeGain(self.config.alpha, base=self.tree_gain_population)
        self.tree_gain[key].observe(num_accepted - on_top)
        self.tree_gain_population.observe(num_accepted - on_top)

    def observe_step(self, rows: int, drafter_rows: list[int], seconds: float, speculating: int = 0,
                     catch_up_rows: int = 0, tree: bool = False, prompt_rows: int = 0) -> None:
        """A step's wall time; speculating: how many of its sequences drafted; catch_up_rows:
        prompt rows of the previous step that the drafter caught up on ahead of this one;
        tree: whether one of them verified a tree; prompt_rows: its rows that are prompt chunks."""
        self.cost.observe(rows, drafter_rows, seconds * 1e3, speculating, catch_up_rows, tree, prompt_rows)

    def forget(self, key: Hashable) -> None:
        self.acceptance.pop(key, None)
        self.tree_acceptance.pop(key, None)
        self.tree_gain.pop(key, None)
        self.branch.pop(key, None)
        self.plain_streak.pop(key, None)
        self.hopeless_streak.pop(key, None)

    def stats(self) -> dict:
        total = sum(self.chosen.values())
        mean = sum(k * c for k, c in self.chosen.items()) / total if total else 0.0
        out = {"spec_controller": "on" if self.config.enabled else "off", "spec_mean_k": mean,
               "spec_k_histogram": {str(k): c for k, c in sorted(self.chosen.items())},
               "spec_detached": self.detached}
        if isinstance(self.cost, StepCostModel):
            out["spec_cost_model"] = self.cost.as_dict()
        return out
