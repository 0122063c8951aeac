"""The scheduler core alone: no model, outputs faked. Budgets, chunking, pages, preemption."""

from overlap.batch import SeqOutput, StepOutput
from overlap.config import SchedulerConfig
from runtime.messages import SamplingParams
from runtime.pages import PageAllocator
from runtime.scheduler import Scheduler


def scheduler(num_pages=64, page_size=4, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw), PageAllocator(num_pages, page_size), eos_token_ids=(2,))


def fake_run(sched: Scheduler, token=7):
    """Schedule one step and pretend every sampling sequence produced `token`."""
    plan = sched.schedule()
    out = StepOutput(plan.step_id, [SeqOutput(w.seq_id, [token] if w.sample else []) for w in plan.seqs])
    return plan, sched.update(plan, out)


def test_chunked_prefill_respects_the_token_budget():
    s = scheduler(max_batched_tokens=10)
    s.add("a", list(range(100, 125)), SamplingParams(max_tokens=3), seed=0)
    chunks = []
    while s.waiting or (s.running and s.running[0].num_computed < 25):
        plan, _ = fake_run(s)
        chunks.append((plan.seqs[0].start_pos, len(plan.seqs[0].token_ids), plan.seqs[0].sample))
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]


def test_decode_and_prefill_share_a_step_and_limits_hold():
    s = scheduler(max_batched_tokens=16, max_num_seqs=2)
    for i in range(3):
        s.add(f"r{i}", [10 + i] * 6, SamplingParams(max_tokens=5), seed=i)
    plan, _ = fake_run(s)
    assert [len(w.token_ids) for w in plan.seqs] == [6, 6]  # third waits: max_num_seqs=2
    plan, _ = fake_run(s)
    assert all(len(w.token_ids) == 1 for w in plan.seqs) and len(plan.seqs) == 2


def test_pages_are_allocated_per_sequence_and_all_freed():
    s = scheduler(num_pages=20, page_size=4)
    for i in range(3):
        s.add(f"r{i}", [10] * 9, SamplingParams(max_tokens=4), seed=i)
    while s.has_work():
        plan, _ = fake_run(s)
        tables = [w.page_table for w in plan.seqs]
        used = [p for t in tables for p in t]
        assert len(used) == len(set(used)), "two sequences share a page"
    assert s.allocator.num_free == 20


def test_preemption_takes_the_newest_and_recomputes_its_tokens():
    s = scheduler(num_pages=6, page_size=4, max_batched_tokens=64)
    s.add("old", [10] * 8, SamplingParams(max_tokens=12, ignore_eos=True), seed=0)
    s.add("new", [11] * 8, SamplingParams(max_tokens=12, ignore_eos=True), seed=1)
    fake_run(s)  # both prefilled: 4 of 6 pages used
    seen_preempt = False
    while s.has_work():
        plan, _ = fake_run(s)
        seen_preempt |= s.num_preemptions > 0
        for w in plan.seqs:
            seq = s.by_seq.get(w.seq_id)
            if seq is not None and seq.request_id == "new" and w.start_pos == 0 and seq.num_output:
                # Recompute: prompt and generated tokens come back as one prefill chunk.
                assert w.token_ids[:8] == [11] * 8 and len(w.token_ids) > 8
    assert seen_preempt
    assert s.allocator.num_free == 6


def test_stop_conditions_and_abort():
    s = scheduler()
    s.add("eos", [10] * 3, SamplingParams(max_tokens=50), seed=0)
    _, updates = fake_run(s, token=2)
    assert updates[0].finish_reason == "stop" and updates[0].new_token_ids == [2]
    s.add("len", [10] * 3, SamplingParams(max_tokens=2), seed=0)
    fake_run(s)
    _, updates = fake_run(s)
    assert updates[0].finish_reason == "length"
    s.add("gone", [10] * 3, SamplingParams(max_tokens=50), seed=0)
    fake_run(s)
    s.abort("gone")
    assert not s.has_work() and s.allocator.num_free == s.allocator.num_pages


def test_speculative_decodes_reserve_and_trim_draft_pages():
    s = scheduler(num_pages=32, page_size=2)
    s.add("a", [10] * 3, SamplingParams(max_tokens=20), seed=0, num_spec_tokens=4)
    plan, _ = fake_run(s)
    assert plan.seqs[0].num_spec_tokens == 0  # prefill step: no drafts
    plan = s.schedule()
    w = plan.seqs[0]
    assert w.num_spec_tokens == 4 and w.draft
    # last token + 4 drafts + the drafter's catch-up slot past the bonus token
    assert len(w.page_table) * 2 >= w.start_pos + 1 + 4 + 1
    s.update(plan, StepOutput(plan.step_id, [SeqOutput(w.seq_id, [7], 4, 0)]))
    assert len(s.by_request["a"].pages) == -(-len(s.by_request["a"].tokens) // 2)


# -- the scheduler process's core: admission bound ---------------------------------------------

class _Sent:
    """Stands in for the PUSH socket to the tokenizer: decodes what would go over the wire."""

    def __init__(self):
        self.messages = []

    def send(self, data):
        from runtime import ipc

        self.messages.append(ipc.decode_to_tokenizer(data))


def test_admission_queue_is_bounded_with_an_overloaded_error():
    from overlap.config import CacheConfig, EngineConfig
    from runtime.frontend import RequestLimits
    from runtime.ipc import Addresses
    from runtime.messages import AddRequest, RequestFailed, pack_ids
    from runtime.procs import ServeSpec
    from runtime.scheduler_proc import SchedulerService

    config = EngineConfig(cache=CacheConfig(page_size=4, num_pages=8))
    spec = ServeSpec(config, "unused", "m", (2,), RequestLimits(100, 64, 8, 4, 0),
                     Addresses("a", "b", "c", "d", "e"), max_waiting=3)
    to_tokenizer, to_executor = _Sent(), []

    class Executor:
        def send(self, data):
            to_executor.append(data)

    service = SchedulerService(spec, Executor(), to_tokenizer)
    for i in range(5):
        service.handle(AddRequest(f"r{i}", pack_ids([1, 2, 3]), SamplingParams(max_tokens=4), 0, 0))
    refused = [m for m in to_tokenizer.messages if isinstance(m, RequestFailed)]
    assert [m.request_id for m in refused] == ["r3", "r4"] and all(m.code == "overloaded" for m in refused)
    assert len(service.scheduler.waiting) == 3
    service.schedule()  # admitted requests leave the queue, so new ones fit again
    assert to_executor and len(service.scheduler.waiting) < 3


class FixedChoices:
    """A controller double: records what it was asked, gives each candidate option `pick`
    (clamped to what it may take)."""

    def __init__(self, pick):
        self.pick, self.asked, self.observed, self.steps, self.forgotten = pick, [], [], [], []
        self.catch_ups, self.branches, self.prompt_rows = [], [], []
        self.known, self.branch_cap = [], 16  # the candidates' looked-up branch rows; the cut chosen

    def choose(self, candidates, other_rows=0, other_tokens=0):
        self.asked.append(([c.options for c in candidates], other_rows, other_tokens))
        self.known.append([c.branch for c in candidates])
        return [c.options[min(self.pick, len(c.options) - 1)] for c in candidates]

    def observe(self, key, num_drafts, num_accepted, tree=False, depth=0, branch_rows=None, top_accepted=-1):
        self.observed.append((key, num_drafts, num_accepted) + (("tree",) if tree else ()))
        self.branches.append((depth, branch_rows))

    def observe_step(self, rows, drafter_rows, seconds, speculating=0, catch_up_rows=0, tree=False,
                     prompt_rows=0):
        self.steps.append((rows, drafter_rows, seconds))
        self.catch_ups.append(catch_up_rows)
        self.prompt_rows.append(prompt_rows)

    def should_detach(self, key):
        return False

    def admits_drafts(self, batch, options, others=0):
        return True

    def forget(self, key):
        self.forgotten.append(key)

    def stats(self):
        return {"spec_controller": "double"}


def test_a_batch_with_a_prefill_chunk_still_speculates_for_its_decodes():
    ctl = FixedChoices(pick=2)
    clock = iter(range(100)).__next__
    s = Scheduler(SchedulerConfig(max_batched_tokens=64), PageAllocator(64, 4), (2,), ctl, clock=clock)
    s.add("a", [10, 11, 12], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=3)
    fake_run(s)  # a's prefill
    s.add("b", list(range(100, 110)), SamplingParams(max_tokens=20), seed=1, num_spec_tokens=3)
    plan = s.schedule()
    a, b = plan.seqs
    assert a.is_decode and a.num_spec_tokens == 2 and b.num_spec_tokens == 0 and not plan.is_decode_only
    options, other_rows, other_tokens = ctl.asked[-1]
    assert [o.k for o in options[0]] == [0, 1, 2, 3] and other_rows == 10 and other_tokens == 1
    out = StepOutput(plan.step_id, [SeqOutput(a.seq_id, [7, 7], 2, 1), SeqOutput(b.seq_id, [7])])
    updates = s.update(plan, out)
    assert (a.seq_id, 2, 1) in ctl.observed
    assert ctl.steps[-1][0] == 1 + 2 + 10 and ctl.steps[-1][2] > 0  # rows: decode + drafts + chunk
    assert [u.spec_k for u in updates] == [2, None]  # b's step was a prefill
    assert s.stats()["spec_controller"] == "double"
    # The drafter catches up on a step's prompt chunks ahead of the next step: a's prompt (3
    # rows) is priced into this step's time, b's chunk (10 rows) into the next one's.
    assert ctl.catch_ups == [0, 3]
    fake_run(s)
    assert ctl.catch_ups == [0, 3, 10]
    # Steps holding a prompt chunk say how many of their rows it was: a's prefill, then b's.
    assert ctl.prompt_rows == [3, 10, 0]


def test_the_step_is_priced_by_the_rows_it_verified():
    """A lookup branch verifies rows beyond the drafts asked for (an n-gram drafter may find
    fewer): the cost model learns from the rows the target ran."""
    ctl = FixedChoices(pick=3)
    clock = iter(range(100)).__next__
    s = Scheduler(SchedulerConfig(), PageAllocator(64, 4), (2,), ctl, clock=clock, lookup_branch=4)
    s.add("a", [10, 11, 12], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=3)
    fake_run(s)
    plan = s.schedule()
    (a,) = plan.seqs
    assert a.num_spec_tokens == 3 and a.lookup_rows == 4
    # The deepest path was the 4-token branch; 3 + 4 rows verified.
    s.update(plan, StepOutput(plan.step_id, [SeqOutput(a.seq_id, [7, 7, 7], 4, 2, 3 + 4)]))
    assert ctl.steps[-1][0] == 1 + 3 + 4
    # The controller hears the option it chose (a chain of 3) and the branch's rows beyond it.
    assert ctl.observed[-1] == (a.seq_id, 4, 2) and ctl.branches[-1] == (3, 4)
    plan = s.schedule()
    s.update(plan, StepOutput(plan.step_id, [SeqOutput(plan.seqs[0].seq_id, [7], 3, 0, 3)]))  # no lookup matched
    assert ctl.branches[-1] == (3, 0)


def test_the_branch_is_looked_up_before_the_choice_and_cut_as_chosen():
    """A sequence whose tokens repeat: the scheduler finds its lookup branch on its tokens
    before the controller chooses (Candidate.branch: its rows), and hands the drafter the
    branch cut to the rows the controller chose to verify (SeqWork.branch)."""
    ctl = FixedChoices(pick=3)
    s = Scheduler(SchedulerConfig(), PageAllocator(64, 4), (2,), ctl, lookup_branch=6, lookup_match=(2, 3))
    s.add("a", [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=3)
    s.add("b", [10, 11, 12, 13], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=3)  # no repeat
    fake_run(s)  # prefill: each samples 7 (fake_run)
    ctl.branch_cap = 4
    plan = s.schedule()
    a, b = plan.seqs
    # a: ... 5, 6, 7 matches 5, 6, 7 earlier; the copy runs 8, 9, 5, 6, 7, 8 (6 rows)
    assert ctl.known[-1] == [6, 0]
    assert a.branch == [8, 9, 5, 6] and a.lookup_rows == 6
    assert b.branch == []
    s.update(plan, StepOutput(plan.step_id, [SeqOutput(a.seq_id, [7]), SeqOutput(b.seq_id, [7])]))
    ctl.pick = 0  # plain decoding: no branch to verify
    plan = s.schedule()
    assert [w.branch for w in plan.seqs] == [None, None]


def test_a_step_without_branch_rows_reports_no_branch():
    ctl = FixedChoices(pick=3)
    s = Scheduler(SchedulerConfig(), PageAllocator(64, 4), (2,), ctl)
    s.add("a", [10, 11, 12], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=3)
    fake_run(s)
    plan = s.schedule()
    s.update(plan, StepOutput(plan.step_id, [SeqOutput(plan.seqs[0].seq_id, [7, 7], 3, 1, 3)]))
    assert ctl.branches[-1] == (3, None) and ctl.steps[-1][0] == 1 + 3


def test_tree_requests_are_offered_chains_or_the_whole_tree():
    ctl = FixedChoices(pick=-1)
    s = Scheduler(SchedulerConfig(), PageAllocator(64, 4), (2,), ctl, tree_depth=3, tree_chains=True)
    s.add("a", [10, 11], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=6)
    s.add("b", [10, 11], SamplingParams(max_tokens=3), seed=0, num_spec_tokens=6)
    fake_run(s)
    plan = s.schedule()
    options = ctl.asked[-1][0]
    assert [(o.rows, o.depth, o.tree) for o in options[0]] == [(0, 0, False), (1, 1, False), (2, 2, False),
                                                                (3, 3, False), (6, 3, True)]
    # No room for the tree before max_tokens: a chain of what fits (2 tokens left: 1 draft).
    assert [(o.rows, o.depth) for o in options[1]] == [(0, 0), (1, 1)]
    assert [w.num_spec_tokens for w in plan.seqs] == [6, 1]
    # What each verified is observed as a tree's or a chain's acceptance.
    out = StepOutput(plan.step_id, [SeqOutput(plan.seqs[0].seq_id, [7, 7], 3, 1),
                                    SeqOutput(plan.seqs[1].seq_id, [7], 1, 0)])
    s.update(plan, out)
    assert ctl.observed[-2:] == [(plan.seqs[0].seq_id, 3, 1, "tree"), (plan.seqs[1].seq_id, 1, 0)]


def test_dynamic_tree_requests_are_offered_all_or_nothing():
    ctl = FixedChoices(pick=1)
    s = Scheduler(SchedulerConfig(), PageAllocator(64, 4), (2,), ctl, tree_depth=3)
    s.add("a", [10, 11], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=6)
    s.add("b", [10, 11], SamplingParams(max_tokens=3), seed=0, num_spec_tokens=6)
    fake_run(s)
    plan = s.schedule()
    options = ctl.asked[-1][0]
    assert [(o.rows, o.depth) for o in options[0]] == [(0, 0), (6, 3)]
    assert [(o.rows, o.depth) for o in options[1]] == [(0, 0)]  # no room for the tree before max_tokens
    assert [w.num_spec_tokens for w in plan.seqs] == [6, 0]

def test_a_request_is_admitted_detached_where_its_batch_rules_drafts_out():
    from overlap.speculative.controller import ControllerConfig, SpeculationController
    from speculative.test_controller import Scripted

    # One draft pays alone (batch 1) and not when both draft (batch 2).
    ctl = SpeculationController(Scripted(base=10.0, per_row=6.0), ControllerConfig(probe_every=0))
    s = Scheduler(SchedulerConfig(max_batched_tokens=64), PageAllocator(64, 4), (2,), ctl)
    s.add("a", [10, 11, 12], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=3)
    plan, _ = fake_run(s)
    assert plan.seqs[0].draft  # alone: the drafter follows it
    s.add("b", [20, 21, 22], SamplingParams(max_tokens=20), seed=1, num_spec_tokens=3)
    plan, _ = fake_run(s)
    drafts = {s.by_seq[w.seq_id].request_id: w.draft for w in plan.seqs}
    assert drafts == {"a": True, "b": False}
    assert s.by_request["b"].num_spec_tokens == 0 and ctl.stats()["spec_detached"] == 1
    plan, _ = fake_run(s)
    assert [w.num_spec_tokens for w in plan.seqs if s.by_seq[w.seq_id].request_id == "b"] == [0]


def test_admission_counts_the_detached_sequences_beside_the_batch():
    """A request joining a running sequence that was detached would draft alone beside it;
    one joining a sequence that drafts, with it: admission asks the batch choose() will judge."""
    from overlap.speculative.controller import ControllerConfig, SpeculationController
    from speculative.test_controller import Scripted

    seen = []

    class Recording(SpeculationController):
        def admits_drafts(self, batch, options, others=0):
            seen.append((batch, others))
            return super().admits_drafts(batch, options, others)

    ctl = Recording(Scripted(base=10.0, per_row=0.5), ControllerConfig(probe_every=0))
    s = Scheduler(SchedulerConfig(max_batched_tokens=64), PageAllocator(64, 4), (2,), ctl)
    s.add("a", [10, 11, 12], SamplingParams(max_tokens=20), seed=0, num_spec_tokens=3)
    fake_run(s)
    s.by_request["a"].num_spec_tokens = 0  # detached
    s.add("b", [20, 21, 22], SamplingParams(max_tokens=20), seed=1, num_spec_tokens=3)
    fake_run(s)
    s.add("c", [30, 31, 32], SamplingParams(max_tokens=20), seed=2, num_spec_tokens=3)
    fake_run(s)
    assert seen == [(1, 0), (1, 1), (2, 1)]


def test_the_engine_and_the_server_offer_eagle_chains_alike():
    from overlap.config import SpecConfig
    from runtime.scheduler import spec_arguments

    assert spec_arguments(SpecConfig(method="eagle")) == {"tree_depth": 3, "tree_chains": True, "lookup_branch": 0,
                                                          "lookup_match": (2, 3)}
    assert spec_arguments(SpecConfig(method="eagle", tree="dynamic")) == {
        "tree_depth": 3, "tree_chains": False, "lookup_branch": 0, "lookup_match": (2, 3)}
    assert spec_arguments(SpecConfig(method="mtp", lookup_branch=4, lookup_min_match=3, ngram_max=5)) == {
        "tree_depth": 0, "tree_chains": False, "lookup_branch": 4, "lookup_match": (3, 5)}
    # The model drafters take a branch; n-gram (a lookup itself) and none do not.
    assert spec_arguments(SpecConfig(method="draft", lookup_branch=4))["lookup_branch"] == 4
    assert spec_arguments(SpecConfig(method="ngram", lookup_branch=4))["lookup_branch"] == 0
    for module in ("runtime/engine.py", "runtime/scheduler_proc.py"):  # both build their Scheduler with it
        assert "**spec_arguments(config.spec)" in open(module).read()
