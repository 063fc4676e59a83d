"""Text <-> token ids with the model's own ``tokenizer.json`` (from ``GetModel``).

A model imported without a tokenizer still works with token ids only: ``load_tokenizer``
returns None and callers pass ``token_ids`` and print ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

# decode() emits U+FFFD for a multi-byte character cut in half; wait for the rest of it.
_INCOMPLETE = "\ufffd"


class TokenizerError(ValueError):
    """The tokenizer file is unusable or the text cannot be encoded."""


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_json(cls, data: bytes | str) -> TextTokenizer:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        try:
            return cls(Tokenizer.from_str(text))
        except Exception as err:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"the model's tokenizer.json cannot be loaded: {err}") from err

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def stream(self, prompt_ids: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self, prompt_ids)


def load_tokenizer(data: bytes) -> TextTokenizer | None:
    """None when the model has no tokenizer (empty ``tokenizer_json``)."""
    return TextTokenizer.from_json(data) if data else None


class IncrementalDecoder:
    """Turns generated ids into text pieces whose concatenation equals ``decode(all ids)``.

    Decoding one token at a time is wrong for most tokenizers: SentencePiece drops the
    leading space of a lone word piece, and byte-level BPE splits UTF-8 characters across
    tokens. So each step decodes a window that starts one token before the unread part and
    emits only the new suffix, holding back text while it ends in half a character.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        # Context from the prompt's tail makes the first generated piece decode correctly.
        self._ids: list[int] = list(prompt_ids)[-1:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text it completes (possibly "")."""
        self._ids.append(token_id)
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_INCOMPLETE):
            piece = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return piece
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character shows as U+FFFD)."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]
