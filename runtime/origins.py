"""Where each output token came from, and which text it produced: what the browser page colours.

A speculative step for one sequence emits `[d_1 .. d_a, t]`: the a drafts the target accepted
(in chain order, or along the accepted tree path) and then one token of the target's own (the
recovered token at the first rejection, or the bonus token when every draft was accepted;
terms as in overlap/speculative/rejection.py). A plain decode or a prefill's first token is one
target token. So a token's origin is its *depth*:

    0   the target's own token (plain decode, recovered or bonus)
    d   a draft accepted at depth d (1 = the first draft of its step)

It follows from (number of tokens the step kept, num_accepted), which the step output already
carries: nothing extra is computed or copied on the executor's hot path. The scheduler may keep
only a prefix of a step's tokens (a stop id or max_tokens inside the accepted drafts), and a
prefix of the list below is still right.

Text: the incremental detokenizer records, per token, where the final text ended after it
(`token_ends`). A token may add no text (half of a UTF-8 character) and the next one then adds
both; the text is credited to the token that completed it. `spans` cuts a streamed piece of text
into (length, depth) runs per token, lengths in Python characters (code points), so the ZeroMQ
`Delta` stays compact; `split_text` turns them back into strings for a front end.
"""

from __future__ import annotations

from bisect import bisect_right

TARGET = 0  # the depth of a token the target produced itself


def token_depths(num_tokens: int, num_accepted: int) -> list[int]:
    """Depth per token of one step's kept tokens: [1, 2, .., a, 0], cut to `num_tokens`."""
    accepted = min(num_accepted, num_tokens)
    return list(range(1, accepted + 1)) + [TARGET] * (num_tokens - accepted)


def spans(token_ends: list[int], depths: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """The text [start, end) as (number of characters, depth) runs, one per token that produced
    some of it. `token_ends[i]`: the text length after token i was decoded (non-decreasing);
    `depths[i]`: token i's depth. Ends past `end` (text cut by a stop string, or held back while
    it may still become one) are clipped, so the runs always add up to end - start."""
    out = []
    pos = start
    # The first token whose text reaches past `start`: everything before it was streamed already.
    for i in range(bisect_right(token_ends, start), len(token_ends)):
        stop = min(token_ends[i], end)
        if stop > pos:
            out.append((stop - pos, depths[i]))
            pos = stop
        if pos >= end:
            break
    return out


def split_text(text: str, runs: list[tuple[int, int]] | list[list[int]]) -> list[tuple[str, int]]:
    """A delta's text and its (length, depth) runs → (piece of text, depth) pairs."""
    pieces, pos = [], 0
    for length, depth in runs:
        pieces.append((text[pos: pos + length], depth))
        pos += length
    return pieces
