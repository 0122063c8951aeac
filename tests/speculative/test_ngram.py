"""The n-gram drafter: its lookups, and its history, which must follow every token of the
sequence (an accepted draft included) for the lookups to find what came before."""

from overlap.batch import SeqOutput, SeqWork
from overlap.speculative.base import FinishedStep
from overlap.speculative.ngram import NgramProposer, lookup


def test_lookup_continues_the_latest_match_of_the_longest_suffix():
    history = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    assert lookup(history, 3, 1, 3) == [7, 5, 2]  # "2 3" last seen before 7 (n = 2; "5 2 3" never)
    assert lookup(history, 1, 1, 1) == [7]
    assert lookup([4, 5, 6], 2, 1, 3) == []


def test_a_match_that_runs_into_the_end_repeats_its_period():
    # "9 4 5" three back: the copy is 9 4 5 again, and again (period 3), not 3 tokens only.
    assert lookup([1, 9, 4, 5, 9, 4, 5], 7, 1, 3) == [9, 4, 5, 9, 4, 5, 9]
    assert lookup([2, 7, 7], 4, 1, 3) == [7, 7, 7, 7]  # a 1-token loop: "7" one back
    assert lookup([1, 2, 3, 1, 2], 2, 1, 3) == [3, 1]  # room before the end: as before
    assert lookup([1, 2, 3, 1, 2], 5, 1, 3) == [3, 1, 2, 3, 1]


def test_history_keeps_accepted_drafts_and_restarts_after_a_recompute():
    ngram = NgramProposer(vocab_size=100)

    def step(seq: SeqWork, out: SeqOutput) -> list[int]:
        ngram.catch_up(FinishedStep([seq], [out], [0]))
        return ngram.history[0]

    # Prefill [1..5] samples 6; a decode of 6 verifies drafts 7 8 9: 7 and 8 accepted, 10
    # recovered; then 10 with 3 drafts, all accepted, and the bonus 14.
    assert step(SeqWork(0, [1, 2, 3, 4, 5], 0, [0], True, draft=True), SeqOutput(0, [6])) == [1, 2, 3, 4, 5, 6]
    assert step(SeqWork(0, [6], 5, [0], True, num_spec_tokens=3, draft=True),
                SeqOutput(0, [7, 8, 10], 3, 2)) == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert step(SeqWork(0, [10], 8, [0], True, num_spec_tokens=3, draft=True),
                SeqOutput(0, [11, 12, 13, 14], 3, 3)) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]
    # Preempted, recomputed from position 0 (a different sample this time).
    assert step(SeqWork(0, [1, 2, 3, 4, 5, 6], 0, [0], True, draft=True), SeqOutput(0, [9])) == [1, 2, 3, 4, 5, 6, 9]
