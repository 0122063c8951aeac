"""Token origins (runtime/origins.py): each output token's depth (0 = the target's own token,
d = a draft accepted at depth d) and the text it produced, through the detokenizer, the request
state, the in-process engine and the ZeroMQ message, with no browser involved."""

import msgspec
import pytest

from overlap.config import CacheConfig, EngineConfig, SpecConfig
from overlap.models.loading import load_tokenizer
from runtime.engine import Engine
from runtime.frontend import RequestState
from runtime.messages import Delta, SamplingParams
from runtime.origins import spans, split_text, token_depths


@pytest.mark.parametrize("num_tokens,num_accepted,want", [
    (1, 0, [0]),  # a plain decode step, or the first token after prefill
    (4, 3, [1, 2, 3, 0]),  # three drafts accepted, then the bonus token
    (3, 2, [1, 2, 0]),  # two accepted, then the recovered token at the first rejection
    (2, 3, [1, 2]),  # the scheduler kept a prefix (max_tokens / a stop id inside the drafts)
    (3, 3, [1, 2, 3]),
    (0, 0, []),  # a prefill chunk that samples nothing
])
def test_token_depths(num_tokens, num_accepted, want):
    assert token_depths(num_tokens, num_accepted) == want


def test_spans_cut_streamed_text_per_token():
    # token i's text ends at ends[i]: "ab" (token 0), "" (token 1: half a character), "cde"
    # (token 2, completing it), "f" (token 3)
    ends, depths = [2, 2, 5, 6], [0, 1, 2, 0]
    assert spans(ends, depths, 0, 6) == [(2, 0), (3, 2), (1, 0)]
    assert spans(ends, depths, 2, 5) == [(3, 2)]  # the second delta starts where the first ended
    assert spans(ends, depths, 0, 4) == [(2, 0), (2, 2)]  # held back (a possible stop string): clipped
    assert spans(ends, depths, 3, 3) == []
    assert split_text("abcdef", spans(ends, depths, 0, 6)) == [("ab", 0), ("cde", 2), ("f", 0)]


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return load_tokenizer(smol_dir)


def _feed(state: RequestState, steps: list[tuple[list[int], int, str | None]]):
    """Apply (token ids, num_accepted, finish reason) steps; collect the pieces and depths."""
    pieces, depths = [], []
    for ids, accepted, finish in steps:
        got = state.on_tokens(ids, finish, num_drafts=3 if accepted else 0, num_accepted=accepted)
        assert sum(n for n, _ in got.spans) == len(got.text)
        pieces += split_text(got.text, got.spans)
        depths += got.token_depths
    return pieces, depths


def test_request_state_credits_text_to_the_token_that_produced_it(tokenizer):
    words = tokenizer.encode(" one two three four five six")
    assert len(words) == 6
    state = RequestState("r", tokenizer, tokenizer.encode("Count:"), SamplingParams())
    steps = [(words[:1], 0, None), (words[1:5], 3, None), (words[5:], 0, "length")]
    pieces, depths = _feed(state, steps)
    assert depths == [0, 1, 2, 3, 0, 0]
    assert pieces == [(" one", 0), (" two", 1), (" three", 2), (" four", 3), (" five", 0), (" six", 0)]
    assert "".join(p for p, _ in pieces) == state.text == " one two three four five six"


def test_a_character_split_across_tokens_goes_to_the_token_that_completes_it(tokenizer):
    ids = tokenizer.encode(" 🦒 ok")
    emoji = [i for i in range(1, len(ids) + 1) if tokenizer.decode(ids[:i]) == " 🦒"][0]
    assert emoji > 1, "the emoji should take several byte tokens"
    state = RequestState("r", tokenizer, tokenizer.encode("Hi"), SamplingParams())
    # Every token of the emoji and the rest arrive as one accepted chain, then a target token.
    pieces, depths = _feed(state, [(ids[:emoji], emoji, None), (ids[emoji:], 0, "stop")])
    assert depths[:emoji] == list(range(1, emoji + 1))
    assert pieces[0] == (" 🦒", emoji)  # no piece for the tokens holding half a character
    assert "".join(p for p, _ in pieces) == " 🦒 ok"


def test_a_stop_string_cuts_the_pieces_too(tokenizer):
    words = tokenizer.encode(" alpha beta gamma delta")
    state = RequestState("r", tokenizer, tokenizer.encode("Go:"), SamplingParams(stop=[" gam"]))
    pieces, _ = _feed(state, [(words[:2], 0, None), (words[2:], 2, None)])
    assert state.finish_reason == "stop"
    assert "".join(p for p, _ in pieces) == state.text == " alpha beta"


def test_the_zmq_delta_carries_origins_and_old_clients_ignore_them():
    d = Delta("r", "ab cd", [5, 6], token_depths=[1, 0], spans=[(2, 1), (3, 0)])
    wire = msgspec.msgpack.encode(d)
    assert msgspec.msgpack.decode(wire, type=Delta) == d

    class OldDelta(msgspec.Struct, tag="delta", frozen=True, omit_defaults=True):
        request_id: str
        text: str
        token_ids: list[int]
        finish_reason: str | None = None
        stats: dict | None = None

    assert msgspec.msgpack.decode(wire, type=OldDelta).text == "ab cd"
    # Without origins (an older server) the fields are simply absent: nothing extra on the wire.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Delta("r", "x", [1])), type=Delta).spans == []


def test_engine_depths_match_the_acceptance_stats(tiny_dirs):
    """n-gram drafting on a repetitive prompt: accepted drafts show up as depths 1..k, each
    step's tokens read [1, .., a, 0], and the pieces add up to the text."""
    engine = Engine(EngineConfig(model=str(tiny_dirs["target"]), cache=CacheConfig(page_size=16, num_pages=64),
                                 spec=SpecConfig(method="ngram", num_spec_tokens=3)), progress=False)
    prompt = [101, 102, 103, 104, 105] * 6
    deltas = list(engine.stream(prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
    depths = [d for delta in deltas for d in delta.token_depths]
    assert len(depths) == 40 == sum(len(delta.token_ids) for delta in deltas)
    stats = deltas[-1].stats
    assert sum(d > 0 for d in depths) == stats["accepted_tokens"] > 0
    for delta in deltas:
        a = sum(d > 0 for d in delta.token_depths)
        assert delta.token_depths == token_depths(len(delta.token_ids), a)
        assert sum(n for n, _ in delta.spans) == len(delta.text)
    assert "".join(p for delta in deltas for p, _ in split_text(delta.text, delta.spans)) == \
        "".join(delta.text for delta in deltas)
