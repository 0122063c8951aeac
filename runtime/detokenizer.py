"""Incremental detokenization and stop strings.

Text is emitted only once it is final: a token can be half of a multi-byte UTF-8 character
(decoding alone gives U+FFFD) and byte-level BPE merges can change how earlier tokens read,
so we decode a small window (prefix_offset..end) and emit what extends past read_offset, the
scheme vLLM and TGI use. Stop strings are matched on the emitted text, and text is held back
while it could still be the start of a stop string. `token_ends` records where the final text
ended after each output token, so text can be credited to the token that produced it
(runtime/origins.py).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        # Start the window a few tokens back so the first output token decodes in context.
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self.text = ""  # all output text that is final
        self.sent = 0  # how much of self.text has been handed out
        self.token_ends: list[int] = []  # [i]: len(self.text) after output token i was decoded
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; return the new text that is safe to show."""
        for tok in token_ids:
            if self.stopped:
                break
            self.ids.append(tok)
            self._decode_one()
            self.token_ends.append(len(self.text))
        return self._take(final=False)

    def flush(self) -> str:
        """The request ended: hand out whatever is still held back."""
        return self._take(final=True)

    def _decode_one(self) -> None:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset: self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            self._check_stop()

    def _check_stop(self) -> None:
        for s in self.stop:
            # Search only where a new match can be: near the end of the text.
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                return

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped and self.stop:
            end -= self._held_back()
        delta = self.text[self.sent: end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
