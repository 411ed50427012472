"""From a growing token sequence to released text: whole characters, and never a stop string.

Both front ends stream text (the OpenAI API, and gRPC ``Generate`` with ``include_text``), so they
must not cut a multi-byte character in two nor (OpenAI) send the start of a stop string they may
have to take back.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.tokenizer import Tokenizer


class IncrementalText:
    """Turns a growing token sequence into released text: whole characters, no stop string.

    Characters come from the tokenizer's own incremental decoder (``Tokenizer.decode_stream``:
    ``tokenizers``' ``DecodeStream`` for a model tokenizer, an incremental UTF-8 decoder for the
    byte tokenizer), which holds tokens back while their text ends inside a character. A tail
    that could begin a stop string is held back too; once a stop string appears, the text before
    it is released and ``is_stopped`` is set.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._stream = tokenizer.decode_stream()
        self._stop = tuple(stop)
        self._num_tokens = 0
        self._unreleased_text = ""  # decoded, not yet released: may begin a stop string
        self.is_stopped = False

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that became final (possibly empty)."""
        if self.is_stopped:
            return ""
        self._num_tokens += len(token_ids)
        self._unreleased_text += self._stream.push(token_ids)
        return self._release(is_final=False)

    def finish(self) -> str:
        """The generation ended: release everything left, incomplete characters included."""
        if self.is_stopped:
            return ""
        self._unreleased_text += self._stream.finish()
        return self._release(is_final=True)

    def _release(self, *, is_final: bool) -> str:
        """Release the unreleased text up to a stop string, or up to a tail that may begin one.

        No stop string can begin in text released earlier: that text never ended in a stop
        string's prefix, so searching the unreleased text alone is enough.
        """
        text = self._unreleased_text
        match = self._first_stop()
        if match is not None:
            self.is_stopped = True
            end = match
        elif is_final:
            end = len(text)
        else:
            end = len(text) - self._held_tail_chars()
        self._unreleased_text = "" if self.is_stopped else text[end:]
        return text[:end]

    def _first_stop(self) -> int | None:
        """Where the stop string that completes first begins (the earliest one on a tie).

        "Completes first" (smallest end) is what a character-by-character check would find, so
        the result does not depend on how the text was split into chunks.
        """
        best: tuple[int, int] | None = None
        for stop in self._stop:
            begin = self._unreleased_text.find(stop)
            if begin >= 0 and (best is None or (begin + len(stop), begin) < best):
                best = (begin + len(stop), begin)
        return best[1] if best is not None else None

    def _held_tail_chars(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._unreleased_text
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
