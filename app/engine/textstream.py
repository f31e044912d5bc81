"""Turn generated tokens into released tokens and text, honouring stop strings.

Stop strings are matched on the generated *bytes* (UTF-8), so a stop string that spans
several tokens, or starts in the middle of one, is still found. While the tail of the
output could be the start of a stop string, the tokens that make up that tail are held
back; they are released once the match is ruled out, or dropped once it is confirmed.
A token that straddles the stop string is released with its text cut before it.

So a client never sees text that ends up not being part of the answer, and the
released tokens' bytes always add up to exactly the final text's bytes.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from typing import Generic, TypeVar

from attnlens.model.tokenizer import Tokenizer, bytes_for_display

E = TypeVar("E")  # what the caller attaches to each token (the output stage: its GeneratedToken)


@dataclass
class Released(Generic[E]):
    """One token that is part of the answer."""

    index: int  # position among generated tokens
    id: int
    text: str  # display text of the (possibly cut) token bytes
    delta: str  # exact text this token adds to the answer (may lag by a partial character)
    extra: E  # what the caller attached (logprobs, attention)


class TextStream(Generic[E]):
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stops = [s.encode("utf-8") for s in (stop or []) if s]
        self.buf = bytearray()
        self._pending: list[tuple[int, int, int, int, E]] = []  # (index, id, start, end, extra)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # exact text released so far
        self.stopped = False
        self.cut: int | None = None  # byte offset where a stop string begins
        self.unsent = ""  # end of `text` that no released token's delta carries (see finish)

    def push(self, index: int, token_id: int, extra: E) -> list[Released[E]]:
        """Add a generated token; return the tokens that can now be shown."""
        if self.stopped:
            raise RuntimeError("push after a stop string was found")
        start = len(self.buf)
        self.buf += self.tokenizer.token_bytes(token_id)
        self._pending.append((index, token_id, start, len(self.buf), extra))
        cut = self._find_stop(start)
        if cut is not None:
            self.stopped = True
            self.cut = cut
            return self._release(cut, final=True)
        return self._release(len(self.buf) - self._holdback(), final=False)

    def finish(self) -> list[Released[E]]:
        """No more tokens (length or EOS): release everything still held back."""
        if self.stopped:
            return []
        return self._release(len(self.buf), final=True)

    # --- internals ---------------------------------------------------------
    def _find_stop(self, new_start: int) -> int | None:
        best = None
        for s in self.stops:
            # only a match that ends in the new bytes can be new
            i = self.buf.find(s, max(0, new_start - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _holdback(self) -> int:
        """Length of the longest tail of the output that starts some stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), longest, -1):
                if self.buf.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _release(self, limit: int, *, final: bool) -> list[Released[E]]:
        out = []
        while self._pending:
            index, token_id, start, end, extra = self._pending[0]
            if start >= limit and final:
                self._pending.pop(0)  # lies wholly inside the stop string: dropped
                continue
            if end > limit and not final:
                break  # still might be part of a stop string
            self._pending.pop(0)
            piece = bytes(self.buf[start:min(end, limit)])
            delta = self._decoder.decode(piece, final=False)
            text = self.tokenizer.display_text(token_id) if end <= limit else bytes_for_display(piece)
            self.text += delta
            out.append(Released(index, token_id, text, delta, extra))
        if final:
            tail = self._decoder.decode(b"", final=True)  # a dangling partial character
            if tail and out:
                out[-1].delta += tail
            elif tail:  # the tokens were all released already: the caller sends it at the end
                self.unsent = tail
            self.text += tail
        return out
