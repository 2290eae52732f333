"""Text between two tokenizers: the target's committed tokens as the draft's tokens, and the draft's text as
the target's tokens (a draft of another family drafting through text: runtime/decoding/text_draft.py).

Nothing here decides what is emitted: the target verifies every proposal, so a bridge that guesses a boundary
wrongly costs acceptance, never exactness. What each piece owns:
- `TargetText`: the committed target tokens it has read and their text, decoded incrementally (a token that ends
  inside a UTF-8 character adds its text once the character is whole);
- `DraftView`: the draft's tokens for that text, and anchors where the draft's tokenization is settled, so each
  step re-encodes only the text after the last anchor (O(window), not O(context));
- `target_proposal`: the drafted text as target tokens that continue the committed ones at their boundary.
Special tokens are text both ways (`<|im_end|>` decodes to its string, which the other tokenizer reads as its
own special token where it has one).
"""
from __future__ import annotations

from os.path import commonprefix

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

WINDOW = 48  # draft tokens re-encoded past the last anchor before a new anchor is sought
ANCHOR_TRIES = 8  # splits tried per update: text with none near the end waits for more text
LOOKBEHIND = 4  # committed target tokens re-encoded with the drafted text, to find the boundary in context


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TargetText:
    """The committed target tokens read so far (`ids`) and their text; `ends[i]`: len(text) after token i."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.ends: list[int] = []
        self.text = ""
        self._stream = DecodeStream(skip_special_tokens=False)

    def sync(self, committed: list[int]) -> int:
        """Reads `committed` (the conversation the target holds); returns how much of the earlier text stays."""
        n = len(self.ids)
        kept = len(self.text)
        if n > len(committed) or (n and committed[n - 1] != self.ids[-1]):
            old = self.text
            self._replay(committed[: common_prefix(self.ids, committed)])
            kept = len(commonprefix([old, self.text]))
        for token in committed[len(self.ids):]:
            self._push(int(token))
        return kept

    def rewind(self, length: int) -> None:
        if length < len(self.ids):
            self._replay(self.ids[:length])

    def _replay(self, ids: list[int]) -> None:
        # a decode stream cannot step back: read the kept tokens again (only when the conversation changes)
        self.ids, self.ends, self.text = [], [], ""
        self._stream = DecodeStream(skip_special_tokens=False)
        for token in ids:
            self._push(token)

    def _push(self, token: int) -> None:
        self.text += self._stream.step(self.tokenizer, token) or ""
        self.ids.append(token)
        self.ends.append(len(self.text))


class DraftView:
    """The draft's tokens for the target's text (`ids`), then whatever it drafted after them. `anchors`:
    (text offset, draft tokens) pairs where ids[:tokens] is exactly the draft's encoding of text[:offset]
    and the rest of the text encodes on its own to the tokens after them."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.anchors: list[tuple[int, int]] = [(0, 0)]

    def update(self, text: str, kept_text: int) -> int:
        """Makes `ids` the draft's tokens for `text`, whose first `kept_text` characters are unchanged since the
        last update; returns how many of the earlier ids stay (the rows of the draft's cache that stay valid)."""
        while self.anchors[-1][0] > kept_text:
            self.anchors.pop()
        offset, start = self.anchors[-1]
        encoding = self.tokenizer.encode(text[offset:], add_special_tokens=False)
        tail = encoding.ids
        kept = start + common_prefix(self.ids[start:], tail)
        self.ids = self.ids[:start] + tail
        if len(tail) > WINDOW:
            self._anchor(text[offset:], encoding.offsets, offset, start)
        return kept

    def _anchor(self, segment: str, offsets: list[tuple[int, int]], offset: int, start: int) -> None:
        """Settles the tokens of `segment` but the last WINDOW / 2 at a split both halves of which encode on their
        own to the same tokens (a split inside a word, a character or a merge is not one)."""
        tail = self.ids[start:]
        first = len(tail) - WINDOW // 2
        for k in range(first, max(0, first - ANCHOR_TRIES), -1):
            end = offsets[k - 1][1]
            if not offsets[k - 1][0] < end <= offsets[k][0]:
                continue
            if self.tokenizer.encode(segment[:end], add_special_tokens=False).ids == tail[:k] and \
                    self.tokenizer.encode(segment[end:], add_special_tokens=False).ids == tail[k:]:
                self.anchors.append((offset + end, start + k))
                return


def drafted_text(tokenizer: Tokenizer, context: list[int], drafted: list[int]) -> str:
    """The text `drafted` adds after `context` (the draft's last few tokens, so that a decoder that joins
    pieces by their neighbours sees them); a character not yet whole is left out."""
    stream = DecodeStream(skip_special_tokens=False)
    for token in context:
        stream.step(tokenizer, token)
    return "".join(stream.step(tokenizer, token) or "" for token in drafted)


def target_proposal(tokenizer: Tokenizer, target: TargetText, text: str) -> list[int]:
    """`text`, drafted after the committed text, as the target tokens that would follow the committed ones.
    Encoded with the last LOOKBEHIND committed tokens' text where that reproduces them (a boundary the
    encoding keeps, so context-dependent splits come out as the target makes them); where the encoding
    merges across the boundary (the committed end is inside a token of the drafted text's encoding) that
    token is one the target cannot emit after its own, and the text alone is encoded from the boundary."""
    n = len(target.ids)
    start = max(0, n - LOOKBEHIND)
    base = target.ends[start - 1] if start else 0
    together = tokenizer.encode(target.text[base:] + text, add_special_tokens=False).ids
    if together[: n - start] == target.ids[start:]:
        return together[n - start:]
    return tokenizer.encode(text, add_special_tokens=False).ids
