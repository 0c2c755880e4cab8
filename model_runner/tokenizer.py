"""ByteTokenizer: text <-> UTF-8 bytes, plus BOS and EOS.

Ids 0..255 are bytes, BOS=256, EOS=257; vocab_size=258 fits every preset's vocab. A random-weight
model's vocab is larger: the engine samples only output_ids(), and decode() skips any id that is
not a byte (token-id prompts may hold them).
"""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    BOS = 256
    EOS = 257
    vocab_size = 258

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def output_ids(self) -> list[int]:
        """The ids an engine samples from: newline, printable ASCII and EOS -- each decodes to visible
        text on its own (or ends the answer), whatever the model's vocabulary size."""
        return [10, *range(32, 127), self.EOS]

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special and out-of-range ids are dropped, broken UTF-8 becomes U+FFFD."""
        return bytes(i for i in map(int, ids) if 0 <= i < 256).decode("utf-8", errors="replace")
