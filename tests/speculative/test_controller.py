"""The speculation controller on scripted cost curves: full k when rows are cheap and drafts
land, nothing when rows are expensive or drafts miss, and a per-request back-off."""

import pytest

import itertools
import random

from overlap.speculative.controller import (PLAIN, BranchYield, Candidate, ControllerConfig, SpecOption,
                                            SpeculationController, StepCostModel, _Branches, chain_options,
                                            tree_options)


class Scripted:
    """ms = base + per_row · rows; the drafter costs `drafter` of a target step per level."""

    def __init__(self, base=10.0, per_row=0.0, drafter=0.0, spec_overhead_ms=0.0):
        self.base, self.per_row, self.drafter = base, per_row, drafter
        self.overhead = spec_overhead_ms  # one price per speculative step, whoever drafts
        self.seen = []

    def step_ms(self, rows):
        return self.base + self.per_row * rows

    def drafter_ms(self, rows):
        return self.drafter * self.step_ms(rows)

    def spec_overhead_ms(self, speculating, tree=False):
        return self.overhead if speculating else 0.0

    def observe(self, rows, drafter_rows, ms, speculating=0, catch_up_rows=0, tree=False, prompt_rows=0):
        self.seen.append((rows, ms))

    def plain_measured(self, rows):
        return True  # the script is the plain steps' price


def controller(cost, **kw):
    return SpeculationController(cost, ControllerConfig(**kw))


def train(ctl, key, accepted, k=4, steps=20):
    """`steps` verified steps of k drafts, the first `accepted` of them accepted each time."""
    for _ in range(steps):
        ctl.observe(key, k, accepted)


def test_flat_curve_and_high_acceptance_picks_full_k():
    ctl = controller(Scripted(per_row=0.0))
    train(ctl, "a", 4)
    assert ctl.choose([Candidate("a", chain_options(4))]) == [SpecOption(4, 4)]


def test_batch_one_with_the_measured_cpu_curve_runs_full_k():
    # docs/fast_steps.md, batch 1 at ctx 256: 16.8 ms at 1 row, r(4) = 1.15, r(9) = 1.57; head 0.10.
    cost = StepCostModel({1: 16.8, 2: 17.5, 4: 19.3, 5: 20.5, 8: 24.5, 9: 26.4, 16: 40.0}, drafter_fraction=0.10)
    ctl = controller(cost, prior=0.8)
    assert ctl.choose([Candidate(0, chain_options(3))]) == [SpecOption(3, 3)]


@pytest.mark.parametrize("per_row", [10.0, 50.0])
def test_steep_curve_picks_no_drafts(per_row):
    # Every row costs about a plain decode row (compute-bound), and drafts land often but not
    # always (3 of 4, then none, alternately): a draft row wins less than a token.
    ctl = controller(Scripted(base=1.0, per_row=per_row, drafter=0.05))
    cands = [Candidate(i, chain_options(4)) for i in range(8)]
    for i in range(8):
        for step in range(20):
            ctl.observe(i, 4, 3 if step % 2 else 0)
    assert ctl.choose(cands) == [PLAIN] * 8


def test_zero_acceptance_picks_no_drafts_even_on_a_flat_curve():
    ctl = controller(Scripted(per_row=0.01, drafter=0.1))
    train(ctl, "a", 0, steps=60)  # the average forgets the 0.6 prior (alpha 0.1: 0.6 * 0.9^60)
    assert ctl.choose([Candidate("a", chain_options(4))]) == [PLAIN]


def test_backs_off_a_request_whose_drafts_stop_landing():
    ctl = controller(Scripted(base=10.0, per_row=1.0, drafter=0.05))
    train(ctl, "a", 4)
    train(ctl, "b", 4)
    cands = [Candidate("a", chain_options(4)), Candidate("b", chain_options(4))]
    assert [o.k for o in ctl.choose(cands)] == [4, 4]
    for step in range(1, 41):  # "a" starts producing unpredictable text: every first draft rejected
        ctl.observe("a", 4, 0)
        ctl.observe("b", 4, 4)
        ks = [o.k for o in ctl.choose(cands)]
        if ks[0] == 0:
            break
    assert ks == [0, 4], ks
    # Not at the first misses (acceptance comes in bursts: the average's alpha, 0.1), but
    # within a couple of dozen steps of nothing landing.
    assert 3 < step <= 25, f"took {step} steps to back off"


def test_caps_are_respected_and_choices_mix_per_sequence():
    ctl = controller(Scripted(base=10.0, per_row=0.5))
    train(ctl, "good", 4)
    train(ctl, "meh", 1)
    cands = [Candidate("good", chain_options(2)), Candidate("meh", chain_options(4)), Candidate("off", [PLAIN])]
    picked = ctl.choose(cands)
    assert picked[0].k == 2 and picked[2] == PLAIN
    assert picked[1].k == 1  # its second draft never lands: verifying it only costs


def test_tree_options_are_chains_along_the_top_path_or_the_whole_tree():
    tree = SpecOption(6, 3, tree=True)
    chains = [SpecOption(1, 1), SpecOption(2, 2), SpecOption(3, 3)]
    assert tree_options(6, 3, cap=6) == [PLAIN, *chains, tree]
    assert tree_options(6, 3, cap=5) == [PLAIN, *chains]  # no room for the tree: chains still
    assert tree_options(6, 3, cap=2) == [PLAIN, *chains[:2]]
    assert tree_options(6, 3, cap=6, chains=False) == [PLAIN, tree]  # EAGLE-2's dynamic trees
    assert tree_options(6, 3, cap=5, chains=False) == [PLAIN]
    assert tree_options(3, 3, cap=3) == [PLAIN, *chains]  # a one-path tree is the 3-chain


def test_trees_and_chains_are_priced_by_their_own_acceptance():
    options = tree_options(6, 3, 6)
    # Rows are free: the tree, which (trained) accepts all three levels where chains accept two,
    # is taken.
    ctl = controller(Scripted(per_row=0.0))
    train(ctl, "t", 2, k=3)  # chains: the third draft misses
    for _ in range(20):
        ctl.observe("t", 3, 3, tree=True)
    assert ctl.choose([Candidate("t", options)]) == [SpecOption(6, 3, tree=True)]
    # Rows cost 10% of a step each: the tree's 3 extra rows do not pay for what its branches
    # add over the 3-chain (its chains accept as much), the 3-chain does.
    ctl = controller(Scripted(base=10.0, per_row=1.0))
    train(ctl, "t", 3, k=3)
    for _ in range(20):
        ctl.observe("t", 3, 3, tree=True)
    assert ctl.choose([Candidate("t", options)]) == [SpecOption(3, 3)]
    # Chains miss at depth 2 while the tree's branches land: the tree wins despite its rows.
    ctl = controller(Scripted(base=10.0, per_row=0.5))
    train(ctl, "t", 1, k=3)
    for _ in range(20):
        ctl.observe("t", 3, 3, tree=True)
    assert ctl.choose([Candidate("t", options)]) == [SpecOption(6, 3, tree=True)]
    # Steep rows: nothing.
    steep = controller(Scripted(base=1.0, per_row=10.0))
    assert steep.choose([Candidate("t", options)]) == [PLAIN]


def test_off_runs_every_cap_and_stats_show_the_choices():
    ctl = controller(Scripted(base=1.0, per_row=10.0), enabled=False)
    picked = ctl.choose([Candidate(0, chain_options(3)), Candidate(1, chain_options(1))])
    assert [o.k for o in picked] == [3, 1]
    stats = ctl.stats()
    assert stats["spec_controller"] == "off" and stats["spec_k_histogram"] == {"1": 1, "3": 1}
    assert stats["spec_mean_k"] == 2.0


def test_a_turned_off_request_is_probed_again_eventually():
    ctl = controller(Scripted(base=10.0, per_row=1.0), relax=0.1)
    train(ctl, "a", 0)
    cands = [Candidate("a", chain_options(2))]
    ks = [ctl.choose(cands)[0].k for _ in range(100)]
    assert ks[0] == 0 and any(ks), "never re-measured"


def test_cost_model_interpolates_and_corrects_its_shape_online():
    cost = StepCostModel({1: 10.0, 4: 13.0, 16: 40.0})
    assert cost.step_ms(2) == pytest.approx(11.0)
    assert cost.step_ms(32) == pytest.approx(40.0 + 27.0 / 12 * 16)
    cost.observe(1, [], 10.0)  # one row as calibrated
    for _ in range(200):
        cost.observe(16, [], 80.0)  # the large batch runs twice as slow as calibrated
    assert cost.step_ms(16) == pytest.approx(80.0, rel=0.02)
    assert cost.step_ms(1) == pytest.approx(10.0)  # other observed buckets keep their own


def test_cost_model_from_a_step_costs_report():
    report = {"target": {"1": {"1": 16.8, "4": 19.3}, "8": {"1": 27.6, "4": 52.8}},
              "head_fraction": {"1": 0.1, "8": 0.12}, "draft_fraction": {"1": 0.18, "8": 0.2}}
    cost = StepCostModel.from_report(report, "mtp")
    assert cost.step_ms(1) == 16.8 and cost.step_ms(8) == 27.6 and cost.step_ms(32) == 52.8
    assert cost.drafter_fraction == 0.1
    # With the drafter's own measured steps, a level is priced from them, not the fraction.
    cost = StepCostModel.from_report({**report, "head": {"1": 0.7, "8": 1.4}}, "mtp")
    assert cost.drafter_ms(1) == pytest.approx(0.7) and cost.drafter_ms(8) == pytest.approx(1.4)
    assert cost.drafter_ms(4) == pytest.approx(1.0) and cost.drafter_ms(0) == 0.0
    assert cost.as_dict()["drafter_points"] == {"1": 0.7, "8": 1.4}


def test_a_measured_drafter_step_lets_batch_one_take_full_k():
    """The curve of this machine (batch 1 flat to 9 rows) and a chat request's acceptance
    (0.5, then 0.4 and 0.35 of the drafts before landing): priced at a fixed 0.10 of a target
    step a head level looks dear and the controller stops short of k; at the 0.7 ms the
    int8 head measured (0.035 of a step), the full chain of 3 pays."""
    points = {1: 20.2, 2: 20.1, 4: 20.0, 5: 20.0, 8: 21.1, 9: 21.0, 16: 23.5}
    picks = []
    for cost in (StepCostModel(points, drafter_fraction=0.10),
                 StepCostModel(points, drafter_fraction=0.10, drafter_points={1: 0.7, 8: 1.5})):
        ctl = controller(cost)
        ctl._acc("chat").rates = [0.5, 0.4, 0.35]
        picks.append(ctl.choose([Candidate("chat", chain_options(3))])[0].k)
    assert picks[0] < 3 and picks[1] == 3, picks


def test_a_sequence_without_drafts_for_detach_after_steps_is_detached_once():
    ctl = controller(Scripted(base=1.0, per_row=10.0), detach_after=3, detach_hopeless=0)  # steep: always plain
    cands = [Candidate("a", chain_options(2))]
    detached = []
    for _ in range(5):
        assert ctl.choose(cands) == [PLAIN]
        detached.append(ctl.should_detach("a"))
    assert detached == [False, False, True, False, False]
    assert ctl.stats()["spec_detached"] == 1


def test_a_step_with_drafts_resets_the_streak_and_detaching_can_be_off():
    cost = Scripted(base=10.0, per_row=0.0)  # flat: drafts win while they land
    ctl = controller(cost, detach_after=2, relax=0.0)
    train(ctl, "a", 0)
    cands = [Candidate("a", chain_options(2))]
    ctl.choose(cands)  # plain (acceptance 0): streak 1
    train(ctl, "a", 2)
    assert ctl.choose(cands)[0].k == 2 and not ctl.should_detach("a")  # drafts again: streak 0
    never = controller(Scripted(base=1.0, per_row=10.0), detach_after=0, detach_hopeless=0)
    off = controller(Scripted(base=1.0, per_row=10.0), enabled=False, detach_after=1)
    for ctl in (never, off):
        for _ in range(20):
            ctl.choose(cands)
        assert not ctl.should_detach("a")


def test_a_fixed_price_of_speculating_keeps_a_large_batch_plain():
    """One draft for one sequence of 16 adds little time by the rows alone; with the fixed
    price of a speculative step (proposal, verification) it no longer pays."""
    cands = [Candidate(i, chain_options(1)) for i in range(16)]

    def ks(overhead):
        ctl = controller(Scripted(base=30.0, per_row=0.5, spec_overhead_ms=overhead), min_gain=1.0 + 1e-6)
        for i in range(16):
            train(ctl, i, 1 if i == 0 else 0, k=1)  # only sequence 0's drafts land
        return [o.k for o in ctl.choose(cands)]

    assert ks(0.0) == [1] + [0] * 15
    assert ks(6.0) == [0] * 16


def test_cost_model_learns_the_price_of_speculating_from_speculative_steps_only():
    cost = StepCostModel({1: 10.0, 16: 40.0}, alpha=0.5)
    assert cost.spec_overhead_ms(1) == 0.0  # nothing seen: no price yet
    for _ in range(30):
        cost.observe(8, [], cost.step_ms(8))  # plain steps as predicted: no correction
        cost.observe(9, [], cost.step_ms(9) + 3.0, speculating=1)
    assert cost.spec_overhead_ms(1) == pytest.approx(3.0, rel=1e-3)
    assert cost.spec_overhead_ms(0) == 0.0
    assert cost.step_ms(8) == pytest.approx(StepCostModel({1: 10.0, 16: 40.0}).step_ms(8))
    assert cost.as_dict()["spec_overhead_ms"] == {"1": pytest.approx(3.0, rel=1e-3)}


def test_the_price_of_speculating_is_learned_per_bucket_of_drafting_sequences():
    """A few ms when one sequence drafts, much more when eight do: each bucket keeps its own,
    and a bucket never seen is priced from a line fitted through the seen ones."""
    cost = StepCostModel({1: 10.0, 64: 100.0})
    for _ in range(20):
        cost.observe(2, [], cost.step_ms(2) + 4.0, speculating=1)
        cost.observe(16, [], cost.step_ms(16) + 25.0, speculating=8)
    assert cost.spec_overhead_ms(1) == pytest.approx(4.0)
    assert cost.spec_overhead_ms(8) == pytest.approx(25.0)
    assert cost.spec_overhead_ms(16) == pytest.approx(49.0)  # the line: 1 ms + 3 ms a sequence
    assert cost.spec_overhead_ms(2) == pytest.approx(7.0)


def test_the_price_of_speculating_grows_as_a_fixed_part_plus_a_part_per_sequence():
    """Measured on the Xeon (mtp:3 + branch, fixed k): 8.9, 12.3 and 20.5 ms with 1, 2-3 and
    4-7 sequences drafting, 24.5 ms with 8. Learned from the smaller buckets, 8 sequences
    are priced near what they cost, not at 4-7 sequences' price per sequence (~40 ms), which
    ruled speculation out at concurrency 8."""
    cost = StepCostModel({1: 10.0, 64: 100.0})
    for n, ms in ((1, 8.9), (2, 12.3), (5, 20.5)):
        for _ in range(4):
            cost.observe(40, [], cost.step_ms(40) + ms, speculating=n)
    assert 22.0 < cost.spec_overhead_ms(8) < 30.0
    assert cost.spec_overhead_ms(5) == pytest.approx(20.5)  # a seen bucket at its own count: its own


def test_one_bucket_of_the_price_is_never_stretched_per_sequence_above_it():
    """One bucket seen (1 sequence, 9 ms): 8 sequences are not priced at 72 ms (which ruled
    speculation out before any batch of 8 was measured); below a lone bucket, in proportion."""
    cost = StepCostModel({1: 10.0, 64: 100.0})
    for _ in range(4):
        cost.observe(2, [], cost.step_ms(2) + 9.0, speculating=1)
    assert cost.spec_overhead_ms(8) == pytest.approx(9.0)
    big = StepCostModel({1: 10.0, 64: 100.0})
    for _ in range(4):
        big.observe(32, [], big.step_ms(32) + 24.0, speculating=8)
    assert big.spec_overhead_ms(2) == pytest.approx(6.0) and big.spec_overhead_ms(8) == pytest.approx(24.0)


def test_a_draft_priced_at_batch_one_does_not_pass_for_free_in_a_large_batch():
    """Learned at batch 1, a small price; at batch 8 the measured price is large: speculation
    stops there and stays at batch 1."""
    cost = StepCostModel({1: 10.0, 8: 20.0, 16: 30.0})
    ctl = controller(cost)
    for i in range(8):
        train(ctl, i, 1, k=1)  # every first draft lands
    assert ctl.choose([Candidate(0, chain_options(1))]) == [SpecOption(1, 1)]
    cands = [Candidate(i, chain_options(1)) for i in range(8)]
    assert [o.k for o in ctl.choose(cands)] == [1] * 8  # nothing learned yet: rows only
    for _ in range(10):
        cost.observe(2, [], cost.step_ms(2) + 1.0, speculating=1)
        cost.observe(16, [], cost.step_ms(16) + 30.0, speculating=8)
    assert ctl.choose([Candidate(0, chain_options(1))]) == [SpecOption(1, 1)]
    # One sequence is still priced as at batch 1 (its bucket), but the eight no longer draft.
    assert sum(o.k for o in ctl.choose(cands)) <= 1


def test_a_batch_that_rules_speculation_out_detaches_its_sequences_sooner():
    """Steep curve: one draft loses whatever the acceptance, so the batch (not the sequence)
    rules drafts out, and sequences detach after detach_hopeless steps. On a flat curve a
    sequence whose own drafts miss waits for detach_after: its acceptance may come back."""
    steep = controller(Scripted(base=1.0, per_row=10.0), detach_after=16, detach_hopeless=3)
    cands = [Candidate(i, chain_options(2)) for i in range(4)]
    detached = []
    for _ in range(4):
        assert steep.choose(cands) == [PLAIN] * 4
        detached.append([steep.should_detach(i) for i in range(4)])
    assert detached == [[False] * 4, [False] * 4, [True] * 4, [False] * 4]
    flat = controller(Scripted(base=10.0, per_row=0.5), detach_after=16, detach_hopeless=3, relax=0.0)
    train(flat, "a", 0)
    steps = 0
    while not flat.should_detach("a"):
        assert flat.choose([Candidate("a", chain_options(2))]) == [PLAIN]
        steps += 1
    assert steps == 16


def test_a_batch_is_ruled_out_only_against_a_measured_plain_step():
    """Before a plain step of the batch's size has run, its price is the curve's guess: no
    hopeless verdict on it (the sequences stay attached); once one has run, the verdict counts."""
    cost = StepCostModel({1: 10.0, 16: 20.0, 64: 200.0})  # rows past 16 are steep: drafts lose
    ctl = SpeculationController(cost, ControllerConfig(detach_after=0, detach_hopeless=3))
    cands = [Candidate(i, chain_options(3)) for i in range(16)]
    for _ in range(5):
        assert ctl.choose(cands) == [PLAIN] * 16
    assert not any(ctl.should_detach(i) for i in range(16))
    cost.observe(16, [], 30.0)  # a plain step of 16 rows measured
    for _ in range(3):
        assert ctl.choose(cands) == [PLAIN] * 16
    assert all(ctl.should_detach(i) for i in range(16))


def test_the_price_of_speculating_follows_the_curves_later_correction():
    """Speculative steps seen before any plain step of their size carry the host work every
    step of that batch pays; once plain steps correct the curve for it, the price is what is
    left (each step is kept whole and priced against the curve as it is when asked)."""
    cost = StepCostModel({1: 10.0, 64: 100.0})
    for _ in range(4):
        cost.observe(48, [], 1.5 * cost._base(48) + 3.0, speculating=16)  # 1.5x the bare forward
    assert cost.spec_overhead_ms(16) == pytest.approx(0.5 * cost._base(48) + 3.0)
    cost.observe(16, [], 1.5 * cost._base(16))  # a plain step of 16 rows: the host's 1.5x too
    assert cost.spec_overhead_ms(16) == pytest.approx(3.0)
    assert cost.as_dict()["spec_overhead_ms"] == {"16": pytest.approx(3.0)}


def test_the_price_of_speculating_ignores_a_first_step_and_stray_stalls():
    """The first speculative step of a bucket pays one-time costs and is skipped; after that
    the median of the recent steps: one stalled step does not price speculation out."""
    cost = StepCostModel({1: 10.0, 16: 40.0})
    cost.observe(9, [], cost.step_ms(9) + 14.0, speculating=1)  # a first tree step: slow once
    assert cost.spec_overhead_ms(1) == 0.0 and cost.as_dict()["spec_overhead_ms"] == {}
    for i in range(7):
        cost.observe(9, [], cost.step_ms(9) + (14.0 if i == 3 else 2.0), speculating=1)
    assert cost.spec_overhead_ms(1) == pytest.approx(2.0)
    for _ in range(8):  # the price really rose: the window follows it
        cost.observe(9, [], cost.step_ms(9) + 5.0, speculating=1)
    assert cost.spec_overhead_ms(1) == pytest.approx(5.0)


def test_a_price_learned_in_a_slow_spell_expires_and_the_kind_is_tried_again():
    """A host's slow spell lands on the speculative steps that ran then; priced out, the kind
    runs no more steps to unlearn it. After max_age observed steps of other kinds the spell's
    steps no longer count: the kind is unpriced (free) and a new request is admitted to draft."""
    cost = StepCostModel({1: 10.0, 16: 13.0})
    for _ in range(8):
        cost.observe(12, [1, 1], cost.step_ms(12) + 2.0, speculating=1)  # usual: 2 ms a step
    for _ in range(8):
        cost.observe(12, [1, 1], 3 * cost.step_ms(12), speculating=1)  # the spell: 3x
    assert cost.spec_overhead_ms(1) == pytest.approx(cost.step_ms(12))  # clamped at one prediction
    ctl = SpeculationController(cost, ControllerConfig())
    ctl.population.rates = [0.6, 0.4, 0.3]
    chain = chain_options(3)[1:]
    cost.observe(1, [], 10.0)  # a plain step measured: the batch's verdict may be given
    assert not ctl.admits_drafts(1, chain)
    for _ in range(100):  # the turned-away requests decode plain
        cost.observe(1, [], 10.0)
    assert cost.spec_overhead_ms(1) > 10.0 and not ctl.admits_drafts(1, chain)  # not yet
    for _ in range(28):  # 128 steps after the spell's last
        cost.observe(1, [], 10.0)
    assert cost.spec_overhead_ms(1) == 0.0 and cost.as_dict()["spec_overhead_ms"] == {}
    assert ctl.admits_drafts(1, chain)
    for _ in range(3):  # measured again at the host's usual speed
        cost.observe(12, [1, 1], cost.step_ms(12) + 2.0, speculating=1)
    assert cost.spec_overhead_ms(1) == pytest.approx(2.0)


def test_a_bucket_is_priced_from_three_steps_not_from_one_slow_one():
    """The second speculative step of a new batch size may still pay warm-up: alone it would
    price speculation out for good (the batch detaches before another step is measured), so a
    bucket is priced only from the median of three steps, and until then from the line through
    the other buckets (here one bucket: flat above it)."""
    cost = StepCostModel({1: 10.0, 64: 20.0})
    for _ in range(4):
        cost.observe(2, [], cost.step_ms(2) + 4.0, speculating=1)
    cost.observe(40, [], cost.step_ms(40) * 2, speculating=16)  # the first: skipped
    cost.observe(40, [], cost.step_ms(40) * 2, speculating=16)  # warm-up still: one step only
    assert cost.spec_overhead_ms(16) == pytest.approx(4.0)
    ctl = SpeculationController(cost, ControllerConfig(min_gain=1.0))
    ctl.population.rates = [0.8, 0.7, 0.6]
    assert ctl.choose([Candidate(i, chain_options(3)) for i in range(16)])[0].depth > 0
    for _ in range(2):
        cost.observe(40, [], cost.step_ms(40) + 9.0, speculating=16)
    assert cost.spec_overhead_ms(16) == pytest.approx(9.0)  # the median of the three


def test_a_prompts_catch_up_is_not_taken_for_the_price_of_speculating():
    """A request's first speculative step runs behind the drafter's catch-up over its prompt
    (queued after the prefill step): priced as the drafter over those rows, it neither sets the
    price of speculating nor bends the plain curve; unpriced, two such steps did (session 8:
    EAGLE at batch 1 stopped drafting for good)."""
    cost = StepCostModel({1: 10.0, 256: 200.0}, drafter_fraction=0.1)
    catch_up = cost.drafter_ms(120)  # a 120-token prompt through the drafter
    for _ in range(4):
        cost.observe(4, [], cost.step_ms(4) + 2.0 + catch_up, speculating=1, catch_up_rows=120)
    assert cost.spec_overhead_ms(1) == pytest.approx(2.0)
    for _ in range(10):
        cost.observe(1, [], cost.step_ms(1) + catch_up, catch_up_rows=120)
    assert cost.step_ms(1) == pytest.approx(10.0)
    unpriced = StepCostModel({1: 10.0, 256: 200.0}, drafter_fraction=0.1)
    for _ in range(4):
        unpriced.observe(4, [], unpriced.step_ms(4) + 2.0 + catch_up, speculating=1)
    assert unpriced.spec_overhead_ms(1) == pytest.approx(2.0 + catch_up)


def test_a_gain_inside_the_cost_models_error_is_not_taken():
    """min_gain: a predicted gain of a few percent is inside what the cost model gets wrong."""
    for overhead, taken in ((9.2, False), (8.0, True)):  # 2 tokens in 19.2 ms: +4%; in 18 ms: +11%
        ctl = controller(Scripted(base=10.0, per_row=0.0, spec_overhead_ms=overhead))
        train(ctl, "a", 1, k=1)  # its draft always lands
        assert (ctl.choose([Candidate("a", chain_options(1))])[0].k == 1) == taken, overhead
    assert ControllerConfig().min_gain == 1.05


def test_a_new_request_starts_from_what_every_request_did():
    """A request not measured yet expects the population's acceptance, not a fixed prior."""
    ctl = controller(Scripted(base=10.0, per_row=1.0))
    for key in range(10):
        train(ctl, key, 0, k=2, steps=30)  # every draft so far was rejected
    assert ctl.population.at(1) < 0.1
    assert ctl.choose([Candidate("new", chain_options(2))]) == [PLAIN]
    assert ctl._acc("new").at(1) == ctl.population.at(1)


def test_a_request_joining_a_batch_that_rules_drafts_out_is_admitted_detached():
    """Base 10 ms + 6 ms a row: one draft with the prior's acceptance pays in a batch of 1 and
    not in a batch of 2. Every probe_every-th request turned away is admitted anyway."""
    ctl = controller(Scripted(base=10.0, per_row=6.0), probe_every=3)
    one = SpecOption(1, 1)
    assert ctl.admits_drafts(1, one)
    assert [ctl.admits_drafts(2, one) for _ in range(6)] == [False, False, True, False, False, True]
    assert ctl.stats()["spec_detached"] == 4
    off = controller(Scripted(base=10.0, per_row=5.0), enabled=False)
    never = controller(Scripted(base=10.0, per_row=5.0), detach_hopeless=0)
    assert off.admits_drafts(2, one) and never.admits_drafts(2, one)


def test_a_drafter_level_is_priced_from_the_measured_forward_not_the_corrected_step():
    """Plain steps observed 50% over the curve (host work around the forward) bend the target's
    step cost; a drafter level inside the step costs its fraction of the forward alone."""
    cost = StepCostModel({1: 20.0, 8: 40.0}, drafter_fraction=0.1, alpha=1.0)
    cost.observe(1, [], 30.0)
    assert cost.step_ms(1) == pytest.approx(30.0)
    assert cost.drafter_ms(1) == pytest.approx(2.0)


def test_a_rows_bucket_not_seen_yet_borrows_the_nearest_seen_correction():
    """Plain steps of 1 row observed at 1.5x the bare forward (the host's work around it):
    8 rows, never observed, are priced 1.5x too rather than at the bare forward; the bucket's
    own first steps then weigh as their mean (1, 1/2, ...) until that falls to alpha. The
    nearest bucket wins, the lower on a tie."""
    cost = StepCostModel({1: 10.0, 64: 100.0}, alpha=0.1)
    for _ in range(60):
        cost.observe(1, [], 15.0)
    assert cost.step_ms(1) == pytest.approx(15.0, rel=1e-3)
    assert cost.step_ms(8) == pytest.approx(1.5 * cost._base(8), rel=1e-3)
    assert not cost.plain_measured(8) and cost.plain_measured(1)
    cost.observe(8, [], 2 * cost._base(8))  # its own first step: taken whole
    assert cost.step_ms(8) == pytest.approx(2 * cost._base(8), rel=1e-3) and cost.plain_measured(9)
    cost.observe(8, [], cost._base(8))  # the second: the mean of the two
    assert cost.step_ms(8) == pytest.approx(1.5 * cost._base(8), rel=1e-3)
    for _ in range(30):  # then an average moving alpha a step: a stall moves it by alpha only
        cost.observe(8, [], 1.5 * cost._base(8))
    cost.observe(8, [], 3.5 * cost._base(8))
    assert cost.step_ms(8) == pytest.approx(1.7 * cost._base(8), rel=1e-3)
    cost.correction[6] = 2.0  # 32-63 rows
    assert cost._correction(5) == pytest.approx(1.7) and cost._correction(7) == 2.0
    assert StepCostModel({1: 10.0}).step_ms(1) == 10.0  # nothing observed: the curve


def test_only_decode_steps_teach_the_curve():
    """A step holding a prompt chunk pays for a request's start beyond its rows: at batch 1 it
    taught the buckets a verify step falls in 1.8-1.9 where decode steps read 1.16. It teaches
    no correction and counts as no measured plain step; its bucket borrows the decode steps'."""
    cost = StepCostModel({1: 10.0, 64: 100.0}, alpha=0.1)
    for _ in range(20):
        cost.observe(1, [], 11.6)
        cost.observe(8, [], 1.9 * cost._base(8), prompt_rows=7)
    assert cost.step_ms(8) == pytest.approx(1.16 * cost._base(8), rel=1e-3)
    assert not cost.plain_measured(8) and cost.plain_measured(1)
    # A speculative step beside a prompt chunk still prices speculating, as it did.
    for _ in range(4):
        cost.observe(8, [], cost.step_ms(8) + 2.0, speculating=1, prompt_rows=4)
    assert cost.spec_overhead_ms(1) == pytest.approx(2.0)


def test_a_kind_cheaper_than_the_curve_predicts_is_priced_below_it():
    """The 1-row decode step's correction scales the forward's cost of more rows, so at batch 1
    the curve predicts a verify step above what it takes: each kind's price goes below zero
    by its own excess (chains more than trees here), bounded at half the prediction a step."""
    cost = StepCostModel({1: 10.0, 16: 25.0}, alpha=1.0)
    cost.observe(1, [], 20.0)  # correction 2
    for _ in range(4):
        cost.observe(4, [], cost.step_ms(4) - 5.0, speculating=1)
        cost.observe(8, [], cost.step_ms(8) - 2.0, speculating=1, tree=True)
    assert cost.spec_overhead_ms(1) == pytest.approx(-5.0)
    assert cost.spec_overhead_ms(1, tree=True) == pytest.approx(-2.0)
    for _ in range(8):  # steps that took nothing (a clock glitch) move it by half a prediction
        cost.observe(4, [], 1e-6, speculating=1)
    assert cost.spec_overhead_ms(1) == pytest.approx(-0.5 * cost.step_ms(4))


def test_tree_steps_and_chain_steps_learn_their_own_price():
    """EAGLE: a step with a tree pays its expansion and walk, a chains-only step an MTP step's
    work; each kind is learned apart, and a kind not seen yet is free (so it gets tried)."""
    cost = StepCostModel({1: 10.0, 16: 40.0})
    for _ in range(4):  # the first skipped, then the three a price needs
        cost.observe(2, [], 14.0, speculating=1)  # chains: 2 ms over the curve's 12 at 2 rows
    assert cost.spec_overhead_ms(1) > 0 and cost.spec_overhead_ms(1, tree=True) == 0.0
    for _ in range(4):
        cost.observe(9, [], 35.0, speculating=1, tree=True)
    chain, tree = cost.spec_overhead_ms(1), cost.spec_overhead_ms(1, tree=True)
    assert chain == pytest.approx(2.0) and tree == pytest.approx(35.0 - cost.step_ms(9))
    assert set(cost.as_dict()["spec_overhead_ms"]) == {"1", "tree 1"}
    # The controller prices a tree with the tree's overhead: here it loses to a chain.
    ctl = SpeculationController(cost, ControllerConfig(min_gain=1.0))
    ctl.tree_population.rates = [0.9, 0.9, 0.9]
    ctl.population.rates = [0.8, 0.7, 0.6]
    picked = ctl.choose([Candidate("a", tree_options(8, 3, 8))])[0]
    assert not picked.tree and picked.depth > 0


def test_a_tree_is_priced_as_its_top_chain_plus_what_its_other_branches_add():
    """With the top path's acceptance reported on tree steps, chains and trees learn on the same
    steps: the tree's own steps teach the chain (its top path) and the tree's gain. Priced apart,
    a sequence whose tree steps fell on hard text and chain steps on easy text read its chains
    as the better option; priced together, the tree is its chain plus the gain."""
    options = tree_options(6, 3, 6)
    ctl = controller(Scripted(base=10.0, per_row=0.3), min_gain=1.0)
    train(ctl, "s", 3, k=3)  # easy chain steps: all three drafts land
    for _ in range(20):
        ctl.observe("s", 3, 1, tree=True)  # hard tree steps, no top path reported
    assert ctl.choose([Candidate("s", options)]) == [SpecOption(3, 3)]
    for _ in range(30):  # the same hard text, now with the top path: it accepts 0, the tree 1
        ctl.observe("s", 3, 1, tree=True, top_accepted=0)
    assert ctl._drafted("s", 3, True) == pytest.approx(ctl._drafted("s", 3, False) + 1.0, abs=0.05)
    assert ctl._drafted("s", 3, False) < 1.2  # the chain learned the hard text too
    assert ctl.choose([Candidate("s", options)]) == [SpecOption(6, 3, tree=True)]
    # A tree never reads below its chain, and an unseen request starts from the population's gain.
    ctl.observe("t", 3, 3, tree=True, top_accepted=3)
    assert ctl.tree_gain["t"].expected() >= 0.0
    assert ctl._drafted("u", 3, True) == pytest.approx(ctl._drafted("u", 3, False)
                                                       + ctl.tree_gain_population.expected())
    ctl.forget("s")
    assert "s" not in ctl.tree_gain


def test_admission_judges_a_tree_by_the_trees_acceptance():
    """EAGLE-2's dynamic trees offer the tree alone: whether it pays at admission is read from
    the trees' population, not the chains' (which a dynamic tree never updates)."""
    ctl = controller(Scripted(base=10.0, per_row=1.0), probe_every=0)
    tree = SpecOption(8, 3, tree=True)
    ctl.population.rates = [0.0, 0.0, 0.0]
    ctl.tree_population.rates = [0.9, 0.8, 0.8]
    assert ctl.admits_drafts(2, tree)
    ctl.tree_population.rates = [0.05, 0.0, 0.0]
    assert not ctl.admits_drafts(2, tree)


def test_a_dip_in_the_measured_curve_is_smoothed_away():
    """A calibration caught 2 rows below 1 and 4 far above 3 (noise): the curve the controller
    plans with never falls with more rows, and an unbroken curve is kept as measured."""
    from overlap.speculative.controller import non_decreasing

    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert non_decreasing([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    assert non_decreasing([14.6, 13.5, 20.3, 24.5]) == pytest.approx([14.05, 14.05, 20.3, 24.5])
    cost = StepCostModel({1: 14.6, 2: 13.5, 4: 20.3, 8: 24.5, 16: 30.6})
    ms = [cost.step_ms(r) for r in range(1, 20)]
    assert all(b >= a for a, b in zip(ms, ms[1:]))
    assert cost.step_ms(16) == 30.6


def test_the_corrected_curve_never_falls_with_more_rows():
    """Buckets learn their corrections apart (at batch 1, 16-31 rows from the warm-up's prompt
    chunks at 1.16, 8-15 rows from short ones at 1.56): a step over 16 rows is predicted at
    no less than one over 15, so a verify step there is not priced below a smaller one and its
    excess is not charged to its kind's price of speculating."""
    cost = StepCostModel({1: 20.0, 8: 26.0, 16: 28.0, 32: 35.0}, alpha=1.0)
    cost.observe(8, [], 26.0 * 1.56)
    cost.observe(20, [], cost._base(20) * 1.16)
    ms = [cost.step_ms(r) for r in range(1, 40)]
    assert all(b >= a for a, b in zip(ms, ms[1:]))
    assert cost.step_ms(16) == pytest.approx(cost._base(15) * 1.56)  # the floor of the bucket below
    assert cost.step_ms(31) == pytest.approx(cost.step_ms(16))  # flat until its own catches up
    assert cost.step_ms(40) == pytest.approx(cost._base(40) * 1.16)  # then its own correction
    for _ in range(4):  # a tree step over 16 rows taking what one over 15 is predicted at plus 3
        cost.observe(16, [], cost.step_ms(15) + 3.0, speculating=1, tree=True)
    assert cost.spec_overhead_ms(1, tree=True) == pytest.approx(3.0)
    cost.observe(8, [], 26.0)  # the floor follows the lower bucket's new correction
    assert cost.step_ms(16) == pytest.approx(max(cost._base(15), cost._base(16) * 1.16))


def test_a_lookup_branchs_copied_tokens_are_counted():
    """A branch that copies 6 tokens every step (the first also the chain's) against a fixed
    price of speculating that one draft does not pay: counted, the branch's tokens make
    speculating win; a controller that saw only its chain (no branch reported) stays plain."""
    def trained(branch_rows):
        ctl = controller(Scripted(base=10.0, per_row=1.0, spec_overhead_ms=14.0))
        for _ in range(20):  # the deepest path: the branch's 6, all accepted
            ctl.observe("a", 6, 6, depth=1, branch_rows=branch_rows)
        return ctl
    counted = trained(branch_rows=6)
    rows, tokens = counted._branch("a")
    assert rows == pytest.approx(6.0) and tokens > 4.5  # 7 produced where the chain predicts 2
    assert counted.choose([Candidate("a", chain_options(1))]) == [SpecOption(1, 1)]
    assert trained(branch_rows=None).choose([Candidate("a", chain_options(1))]) == [PLAIN]
    # A new request expects what every request's branch did.
    assert counted._branch("new") == pytest.approx(counted.branch_population.expected())
    counted.forget("a")
    assert "a" not in counted.branch


def test_a_lookup_branchs_rows_are_priced():
    """A branch found on every step that wins nothing beyond the chain still costs its rows:
    in a batch of 8 on a curve where a row costs a tenth of the step, a chain of 3 whose first
    draft lands pays without the branch's 6 rows and not with them."""
    def trained(branch_rows):
        ctl = controller(Scripted(base=10.0, per_row=1.0, drafter=0.02))
        for _ in range(30):
            for key in range(8):
                ctl.observe(key, 6, 1, depth=3, branch_rows=branch_rows)
        return ctl
    cands = [Candidate(k, chain_options(3)) for k in range(8)]
    assert trained(branch_rows=6).choose(cands) == [PLAIN] * 8
    assert all(o.depth for o in trained(branch_rows=None).choose(cands))
    # No branch reported: no branch yield, for that sequence or a new one.
    unbranched = trained(branch_rows=None)
    assert unbranched._branch(0) == (0.0, 0.0) and unbranched._branch("new") == (0.0, 0.0)


def test_a_branchs_firing_is_learned_with_its_rows_when_it_fires():
    """A lookup that matches on one drafting step in four, for 8 rows: firing 0.25 (its
    average over the steps, as alpha weighs them), 8 rows when it fires; a new request reads
    the population's."""
    ctl = controller(Scripted())
    for step in range(200):
        ctl.observe("a", 3, 2, depth=3, branch_rows=8 if step % 4 == 0 else 0)
    p, rows = ctl._branch_firing("a")
    assert p == pytest.approx(0.25, abs=0.06) and rows == pytest.approx(8.0)
    assert ctl._branch_firing("new") == ctl.branch_population.firing()
    assert controller(Scripted())._branch_firing("a") == (0.0, 0.0)  # no branch seen: none fires


def test_the_count_of_branches_that_fire_is_exact_for_a_few_and_bounded_for_many():
    """Up to _Branches.EXACT branches: the Poisson-binomial law of how many fire, checked
    against enumerating every outcome. Beyond: three points with the count's mean and
    variance, so a step's price costs three lookups of the curve at any batch size."""
    rng = random.Random(7)
    ps = [rng.uniform(0.05, 0.9) for _ in range(_Branches.EXACT)]
    branches = _Branches()
    for p in ps:
        branches.add(p, 8.0)
    law = [0.0] * (len(ps) + 1)
    for fired in itertools.product([0, 1], repeat=len(ps)):
        weight = 1.0
        for f, p in zip(fired, ps):
            weight *= p if f else 1.0 - p
        law[sum(fired)] += weight
    points = dict(branches.points())
    for count, weight in enumerate(law):
        if weight > 1e-4:
            assert points[count * 8.0] == pytest.approx(weight, rel=1e-3)  # the few < 1e-4 left out
    many = _Branches()
    many.add(0.25, 8.0, times=32)
    (low, w0), (mid, w1), (high, w2) = many.points()
    assert w0 + w1 + w2 == pytest.approx(1.0)
    assert w0 * low + w1 * mid + w2 * high == pytest.approx(32 * 0.25 * 8.0)  # the mean rows
    variance = w0 * (low - mid) ** 2 + w2 * (high - mid) ** 2
    assert variance == pytest.approx(32 * 0.25 * 0.75 * 8.0 ** 2)


def test_a_branch_is_priced_on_the_steps_where_it_fires_not_at_its_mean_rows():
    """A step-shaped curve (10 ms up to 12 rows, 30 above) and a branch of 8 rows that fires
    on a quarter of the steps. A tree of 8 (9 rows) accepting 1.28x what the chain of 3 does
    costs 10 ms without its branch and 30 with it: 15 on average, where the chain (12 rows
    with its branch) costs 10 either way. Priced at the mean rows (9 + 2 = 11: 10 ms) the tree
    looked as cheap as the chain and was taken (AMD EPYC Zen 5, session 30: trees under-priced
    by ~3.6 ms a step with their branch)."""
    cost = Scripted()
    cost.step_ms = lambda rows: 10.0 if rows <= 12 else 30.0
    ctl = controller(cost)
    train(ctl, "t", 2, k=3)  # chains: the third draft misses
    for _ in range(20):
        ctl.observe("t", 3, 3, tree=True)
    ctl.branch["t"] = BranchYield(ctl.config.alpha, rows=2.0, fires=0.25, steps=20)
    options = tree_options(8, 3, 16)
    tree, chain = options[-1], options[-2]
    assert 1.2 < ctl._tokens("t", tree) / ctl._tokens("t", chain) < 1.5
    assert ctl.choose([Candidate("t", options)]) == [chain]
    ctl.branch["t"] = BranchYield(ctl.config.alpha, rows=8.0, fires=1.0, steps=20)  # a branch every step:
    assert ctl.choose([Candidate("t", options)]) == [chain]  # the tree costs 30 ms a step
    ctl.branch["t"] = BranchYield(ctl.config.alpha, rows=0.0, fires=0.0, steps=20)  # none:
    assert ctl.choose([Candidate("t", options)]) == [tree]  # the tree's 9 rows cost what the chain's do


def test_a_branch_looked_up_before_the_choice_is_priced_as_it_is():
    """The scheduler looks the branch up before the choice (Candidate.branch): the tree is
    taken on a step whose lookup found nothing (9 rows: 10 ms, as the chain) and the chain on
    one whose lookup found 8 tokens (the tree's 17 rows cost 30 ms), where priced by how often
    the branch fires (a quarter of the steps) the chain ran on both."""
    cost = Scripted()
    cost.step_ms = lambda rows: 10.0 if rows <= 12 else 30.0
    ctl = controller(cost)
    train(ctl, "t", 2, k=3)
    for _ in range(20):
        ctl.observe("t", 3, 3, tree=True)
    ctl.branch["t"] = BranchYield(ctl.config.alpha, rows=2.0, fires=0.25, steps=20)
    options = tree_options(8, 3, 16)
    tree, chain = options[-1], options[-2]
    assert ctl.choose([Candidate("t", options)]) == [chain]
    assert ctl.choose([Candidate("t", options, branch=0)]) == [tree]
    assert ctl.choose([Candidate("t", options, branch=8)]) == [chain]
    # (its branch wins nothing here either way: a tie keeps it whole)
    assert ctl.branch_cap == 8 and ctl._branch_firing("t") == (1.0, 8.0) and ctl._rows("t", chain) == 3 + 8
    assert ctl.choose([Candidate("t", options)]) == [chain]  # unknown again on the next step


def test_a_known_branch_is_cut_where_its_last_rows_cost_more_than_they_win():
    """Branches of 12 rows whose copies run on: 8 tokens on every fired step, 12 on half of
    them (the reach of rows 9-12: 0.5). Where a row costs little (batch 1) the step verifies
    all 12; in a batch of 8 where each row costs a hundredth of the step, the last rows win
    less than they cost and the branches are cut to 8 (never below a row past the drafts)."""
    def trained(cost):
        ctl = controller(cost)
        for step in range(200):
            for key in range(8):
                ctl.observe(key, 12, 12 if step % 2 else 8, depth=3, branch_rows=12)
        return ctl
    cheap = trained(Scripted(base=10.0, per_row=0.001))
    assert cheap.branch_population.reach[:8] == pytest.approx([1.0] * 8)
    assert cheap.branch_population.reach[8:] == pytest.approx([0.5] * 4, abs=0.1)
    assert cheap.choose([Candidate(0, chain_options(3), branch=12)]) == [SpecOption(3, 3)]
    assert cheap.branch_cap == 12
    # 12 rows priced whole: what the fired steps won, the chain's prediction aside
    assert cheap._branch(0)[1] == pytest.approx(cheap.branch[0].when_fired(12))
    steep = trained(Scripted(base=10.0, per_row=0.3))
    picked = steep.choose([Candidate(k, chain_options(3), branch=12) for k in range(8)])
    assert all(o.depth for o in picked) and steep.branch_cap == 8
    assert steep._branch(0) == pytest.approx((8, steep.branch[0].when_fired(8)))
    assert steep.branch[0].when_fired(12) - steep.branch[0].when_fired(8) == pytest.approx(2.0, abs=0.4)
    assert steep.choose([Candidate(0, chain_options(3), branch=0)]) and steep.branch_cap == 0
    assert SpeculationController._branch_caps([Candidate(0, chain_options(3))], 12) == [4, 8, 12]
    assert SpeculationController._branch_caps([Candidate(0, tree_options(7, 3, 7))], 2) == [2]


def test_rows_a_branch_never_verified_are_priced_as_its_copies_ran_on():
    """A branch cut to 2 rows on every fired step still prices rows 3-4: the reach of the rows
    seen, continued at their ratio (1.0, 0.8 -> 0.64, 0.512), so a cut is undone where the
    curve makes rows cheap again; and what a fired step won is learned the same cut or whole."""
    cut, whole = BranchYield(0.1), BranchYield(0.1)
    for step in range(300):
        cut.observe(2, 2.0 if step % 5 else 1.0, accepted=2 if step % 5 else 1)
        whole.observe(4, 2.0 if step % 5 else 1.0, accepted=2 if step % 5 else 1)
    assert cut.reach == pytest.approx([1.0, 0.8], abs=0.1)
    assert cut.reached(4) == pytest.approx(sum(cut.reach) + cut.reach[1] ** 2 / cut.reach[0]
                                           + cut.reach[1] ** 3 / cut.reach[0] ** 2)
    assert cut.when_fired(2) == pytest.approx(whole.when_fired(2), abs=0.2)
    assert BranchYield(0.1).reached(3) == 0.0  # nothing seen: no row wins anything yet


def test_a_known_branch_wins_what_branches_won_where_they_fired():
    """A lookup that matches on one drafting step in four and then wins 4 tokens beyond the
    chain's prediction: averaged over every drafting step it adds ~1 token, where it fired ~4;
    a step known to carry it counts the 4, one known to carry none counts nothing."""
    ctl = controller(Scripted())
    for step in range(400):
        fired = step % 4 == 0
        ctl.observe("a", 11 if fired else 3, 7 if fired else 2, depth=3, branch_rows=8 if fired else 0)
    drafted = ctl._drafted("a", 3, False)
    assert ctl.branch["a"].when_fired(8) == pytest.approx(8 - drafted, abs=0.3)
    assert ctl.branch["a"].expected()[1] == pytest.approx((8 - drafted) / 4, abs=0.4)
    ctl.choose([Candidate("a", chain_options(3), branch=8)])
    assert ctl._tokens("a", SpecOption(3, 3)) == pytest.approx(drafted + ctl.branch["a"].when_fired(8))
    ctl.choose([Candidate("a", chain_options(3), branch=0)])
    assert ctl._tokens("a", SpecOption(3, 3)) == pytest.approx(drafted)
    # A new request: what every request's branches won where they fired.
    assert BranchYield(0.1, base=ctl.branch_population).when_fired(8) == ctl.branch_population.when_fired(8)


def test_a_batch_is_not_hopeless_while_a_longer_chain_pays():
    """A price of speculating paid per step (9 ms here) that one draft's 0.9 tokens do not
    pay and a chain of 3 does: the batch does not rule drafts out, so a new request starts
    attached and a sequence left plain is not detached as hopeless. Judged by the cheapest
    option alone, both were (and at concurrency 8 on the Xeon every request then ran plain)."""
    ctl = controller(Scripted(base=10.0, per_row=0.1, spec_overhead_ms=9.0), probe_every=0)
    ctl.population.rates = [0.9, 0.9, 0.9]
    chains = chain_options(3)[1:]
    assert not ctl.admits_drafts(1, chains[0])  # one draft alone: 1.9 tokens in 19.2 ms < 1.05 in 10.1
    assert ctl.admits_drafts(1, chains)  # a chain of 3: 3.4 tokens in 19.4 ms
    assert not ctl._hopeless(chains, 1) and ctl._hopeless(chains[:1], 1)


def test_a_batch_is_judged_with_every_sequence_drafting():
    """A drafter level and the price of speculating are paid once per step, whoever drafts
    (here 3 ms and 6 ms). One request alone would not pay them in a batch of 8 plain ones,
    but 8 drafting together do: a request joining 8 is admitted attached, and a batch of 8
    that chose no drafts is not taken for one that rules them out."""
    cost = Scripted(base=20.0, per_row=0.2, spec_overhead_ms=6.0)
    cost.drafter_ms = lambda rows: 3.0 if rows else 0.0
    ctl = controller(cost, probe_every=0, detach_hopeless=3, relax=0.0)
    chains = chain_options(3)[1:]
    ctl.population.rates = [0.6, 0.6, 0.6]
    assert ctl.admits_drafts(8, chains)  # joining 7 that draft
    # Joining 7 detached ones, it would draft alone: +1.2 tokens on 8 for the whole price.
    assert not ctl.admits_drafts(1, chains, others=7)
    # 8 whose own drafts miss choose plain decoding, but the batch does not rule drafts out
    # (an average request's would pay): none is detached as hopeless.
    for key in range(8):
        train(ctl, key, 0, k=3)
    ctl.population.rates = [0.6, 0.6, 0.6]
    cands = [Candidate(key, chain_options(3)) for key in range(8)]
    for _ in range(4):
        assert ctl.choose(cands) == [PLAIN] * 8
    assert not any(ctl.should_detach(key) for key in range(8)) and sum(ctl.hopeless_streak.values()) == 0
    # Candidates capped at plain decoding (no room left) decode beside the batch, not in it:
    # one that could draft among 7 such is judged alone, and its batch rules drafts out.
    assert ctl.choose([Candidate("a", chain_options(3))] + [Candidate(i, [PLAIN]) for i in range(7)]) == [PLAIN] * 8
    assert ctl.hopeless_streak["a"] == 1


def test_with_a_branch_the_acceptance_learns_only_the_options_positions():
    """A chain of 2 beside a branch: the step's deepest path is reported (8 deep), but a miss
    past the chain's depth is the branch's. The chain's acceptance learns positions 1..2;
    what the branch copied past them is its yield."""
    ctl = controller(Scripted())
    for _ in range(30):
        ctl.observe("a", 8, 2, depth=2, branch_rows=8)  # both chain drafts land, the branch missed
    acc = ctl._acc("a")
    assert len(acc.rates) == 2 and acc.at(1) > 0.9 and acc.at(2) > 0.9
    assert acc.at(3) == ctl.population.at(3)  # never tested: the population's estimate
    for _ in range(30):
        ctl.observe("b", 8, 6, depth=2, branch_rows=8)  # the branch copied 6
    assert len(ctl._acc("b").rates) == 2 and ctl._branch("b")[1] > 3.0
    # Without a branch the reported drafts are the option's own: every position is learned.
    before = ctl.population.at(2)  # what "c", never measured, starts from
    ctl.observe("c", 4, 1)
    assert len(ctl._acc("c").rates) == 2 and ctl._acc("c").at(2) < before
