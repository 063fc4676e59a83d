"""Tokenizer wrapper: encode/decode, and streaming pieces that add up to the full text."""

from __future__ import annotations

import pytest
from support.checkpoints import make_tokenizer_json
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from client.tokenizer import TextTokenizer, TokenizerError, load_tokenizer

CORPUS = [
    "héllo wörld, the quick brown fox jumps over the lazy dog",
    "日本語のテキスト and emoji 🙂🚀 mixed with ascii",
    "Tessera turns idle GPUs into one swarm. Ça marche très bien!",
]


def byte_level_bpe(vocab_size: int = 300) -> TextTokenizer:
    """Byte-level BPE (GPT-2 / Llama 3 / Qwen2 style): characters split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return TextTokenizer.from_json(tok.to_str())


def metaspace_bpe() -> TextTokenizer:
    """SentencePiece style (Llama 2 / Mistral): a lone word piece drops its leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    return TextTokenizer.from_json(tok.to_str())


def stream_pieces(tokenizer: TextTokenizer, ids: list[int], prompt: list[int]) -> list[str]:
    decoder = tokenizer.stream(prompt)
    pieces = [decoder.push(token) for token in ids]
    pieces.append(decoder.flush())
    return pieces


@pytest.mark.parametrize("factory", [byte_level_bpe, metaspace_bpe])
@pytest.mark.parametrize("text", CORPUS)
def test_streamed_pieces_add_up_to_the_decoded_text(factory, text) -> None:
    tokenizer = factory()
    ids = tokenizer.encode(text)
    prompt, generated = ids[:3], ids[3:]
    pieces = stream_pieces(tokenizer, generated, prompt)
    full = tokenizer.decode(prompt + generated)
    assert tokenizer.decode(prompt) + "".join(pieces) == full
    # Never a half character on screen while more bytes are coming.
    assert not any("\ufffd" in piece for piece in pieces)


def test_byte_level_holds_back_a_split_character() -> None:
    tokenizer = byte_level_bpe(vocab_size=257)  # just the bytes: every emoji is 4 tokens
    ids = tokenizer.encode("🙂")
    assert len(ids) == 4
    decoder = tokenizer.stream()
    assert [decoder.push(t) for t in ids] == ["", "", "", "🙂"]


def test_metaspace_keeps_spaces_between_streamed_words() -> None:
    tokenizer = metaspace_bpe()
    ids = tokenizer.encode("the quick brown fox")
    pieces = stream_pieces(tokenizer, ids[1:], ids[:1])
    assert tokenizer.decode(ids[:1]) + "".join(pieces) == "the quick brown fox"


def test_word_level_round_trip_and_special_tokens() -> None:
    tokenizer = TextTokenizer.from_json(make_tokenizer_json(64))
    ids = tokenizer.encode("hello world the swarm")
    assert tokenizer.vocab_size == 64
    assert all(0 <= t < 64 for t in ids)
    assert tokenizer.token_id("</s>") == 2
    assert tokenizer.decode([*ids, 2]) == tokenizer.decode(ids)  # special skipped


def test_no_tokenizer_means_token_ids_only() -> None:
    assert load_tokenizer(b"") is None
    assert load_tokenizer(make_tokenizer_json(16).encode()) is not None


def test_a_broken_tokenizer_file_says_so() -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json cannot be loaded"):
        TextTokenizer.from_json(b'{"not": "a tokenizer"}')
