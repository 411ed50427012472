"""From a growing token sequence to released text: whole characters, and never a stop string.

The OpenAI front end (``router.http_generation``) streams text, so it must not cut a multi-byte
character in two nor send the start of a stop string it may have to take back.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.tokenizer import Tokenizer

_MAX_HELD_TOKENS = 8
"""Tokens held back at most while their text ends in an incomplete UTF-8 sequence."""
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalText:
    """Turns a growing token sequence into released text: whole characters, no stop string.

    Text is decoded over a small window of already-decoded tokens (the previous chunk) so that
    tokenizers whose pieces decode differently at the start of a sequence still give the right
    text. Tokens whose text ends in an incomplete UTF-8 sequence (U+FFFD) wait for the next
    tokens, up to ``_MAX_HELD_TOKENS``. A tail that could begin a stop string is held back too;
    once a stop string appears, the text before it is released and ``is_stopped`` is set.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window: an earlier clean boundary
        self._read_offset = 0  # tokens before this are decoded
        self._unreleased_text = ""  # decoded, not yet released: may begin a stop string
        self.is_stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text that became final (possibly empty)."""
        if self.is_stopped:
            return ""
        self._token_ids.extend(token_ids)
        self._unreleased_text += self._decode_new(is_final=False)
        return self._release(is_final=False)

    def finish(self) -> str:
        """The generation ended: release everything left, incomplete characters included."""
        if self.is_stopped:
            return ""
        self._unreleased_text += self._decode_new(is_final=True)
        return self._release(is_final=True)

    def _decode_new(self, *, is_final: bool) -> str:
        ids = self._token_ids
        if len(ids) == self._read_offset:
            return ""
        decode = self._tokenizer.decode
        end, full = self._clean_end(is_final=is_final)
        if end == self._read_offset:
            return ""
        context = decode(ids[self._prefix_offset : self._read_offset])
        if full.startswith(context):
            new_text = full[len(context) :]
        else:
            new_text = decode(ids[self._read_offset : end])
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return new_text

    def _clean_end(self, *, is_final: bool) -> tuple[int, str]:
        """The largest token count whose text does not end in an incomplete character, and
        that text (decoded from ``_prefix_offset``); ``_read_offset`` if none within reach.

        A chunk may end inside a character and the next one too, so backing off a few tokens
        (not holding the whole chunk) is what keeps text flowing. After ``_MAX_HELD_TOKENS``
        pending tokens, or at the end, the text is taken as it is (U+FFFD included).
        """
        ids = self._token_ids
        decode = self._tokenizer.decode
        full = decode(ids[self._prefix_offset :])
        if is_final or not full.endswith(_REPLACEMENT_CHAR):
            return len(ids), full
        lowest_end = max(self._read_offset + 1, len(ids) - _MAX_HELD_TOKENS)
        for end in range(len(ids) - 1, lowest_end - 1, -1):
            text = decode(ids[self._prefix_offset : end])
            if not text.endswith(_REPLACEMENT_CHAR):
                return end, text
        if len(ids) - self._read_offset >= _MAX_HELD_TOKENS:
            return len(ids), full
        return self._read_offset, ""

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
