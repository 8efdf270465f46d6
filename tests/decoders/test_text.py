"""forge_text: stop/bad word lists, logit bias, and streaming-safe incremental detokenization."""

from __future__ import annotations

import numpy as np
import pytest

from forge.in_triton import forge_text

TEXTS = ["The capital of France is Paris.", "  two  spaces\nand a\ttab", "héllo wörld — 日本語 🙂 naïve café",
         "x", " leading space"]


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request, tokenizer_dirs):
    return forge_text.load_tokenizer(str(tokenizer_dirs[request.param]))


def test_token_bytes_understands_both_tokenizer_styles(tokenizer_dirs):
    modes = {kind: forge_text.TokenBytes(forge_text.load_tokenizer(str(path))).mode
             for kind, path in tokenizer_dirs.items()}
    assert modes == {"byte_level": "bytelevel", "sentencepiece": "metaspace"}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_streamed_pieces_concatenate_to_the_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=True)
    full = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    detok = forge_text.IncrementalDetokenizer(forge_text.TokenBytes(tokenizer))
    pieces = [detok.push(ids[k:k + chunk]) for k in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(pieces) == full
    assert all("\ufffd" not in piece for piece in pieces)  # no character is ever split


def test_pieces_after_a_prompt_keep_their_leading_space(tokenizer_dirs):
    """The SentencePiece case that loses spaces when every token is decoded on its own."""
    tokenizer = forge_text.load_tokenizer(str(tokenizer_dirs["sentencepiece"]))
    codec = forge_text.TokenBytes(tokenizer)
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=True)
    answer = tokenizer.encode(" Paris. héllo 🙂", add_special_tokens=False)
    naive = "".join(tokenizer.decode([t], skip_special_tokens=True) for t in answer)
    assert not naive.startswith(" ")  # what decoding token by token gives
    pieces = b"".join(codec.bytes_of([t], at_start=False) for t in answer)
    whole = tokenizer.decode(prompt + answer, skip_special_tokens=True)
    assert whole == tokenizer.decode(prompt, skip_special_tokens=True) + pieces.decode("utf-8")


def test_stateless_pieces_join_as_bytes(tokenizer):
    """The ensemble's postprocessing has no state: its byte pieces join exactly, even inside a character."""
    codec = forge_text.TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXTS[2], add_special_tokens=False)
    joined = codec.bytes_of(ids[:1], at_start=True) + b"".join(codec.bytes_of([t], at_start=False) for t in ids[1:])
    assert joined.decode("utf-8") == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_out_of_vocabulary_ids_are_skipped(tokenizer):
    codec = forge_text.TokenBytes(tokenizer, skip_special_tokens=True)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    noisy = [tokenizer.eos_token_id] + ids + [len(tokenizer) + 7, -1, tokenizer.eos_token_id]
    assert codec.bytes_of(noisy, at_start=True) == b"hello world"
    assert forge_text.decode(tokenizer, noisy, skip_special_tokens=True) == "hello world"
    keep = forge_text.TokenBytes(tokenizer, skip_special_tokens=False)
    assert keep.bytes_of(noisy, at_start=True).decode().endswith(tokenizer.eos_token)


def test_unknown_decoders_fall_back_to_contextual_decode(tmp_path):
    """A WordPiece tokenizer (no byte mapping) still streams whole words with their spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(["hello world streaming words"] * 20,
                            trainers.WordPieceTrainer(vocab_size=80, special_tokens=["[UNK]", "[SEP]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]")
    codec = forge_text.TokenBytes(fast)
    assert codec.mode == "decode"
    ids = fast.encode("hello world streaming", add_special_tokens=False)
    detok = forge_text.IncrementalDetokenizer(codec)
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == "hello world streaming"


def test_word_list_layout(tokenizer):
    hello = tokenizer.encode("hello", add_special_tokens=False)
    world = tokenizer.encode(" world", add_special_tokens=False)
    lists = forge_text.word_list([[b"hello", b" world", b""], []], 2, tokenizer)
    assert lists.dtype == np.int32 and lists.shape == (2, 2, len(hello) + len(world))
    assert lists[0, 0].tolist() == hello + world
    assert lists[0, 1].tolist()[:2] == [len(hello), len(hello) + len(world)]
    assert set(lists[0, 1, 2:].tolist()) <= {-1}
    assert set(lists[1, 1].tolist()) == {-1}  # no words: offsets all -1
    extra = forge_text.word_list(None, 1, tokenizer, extra_ids=[7])
    assert extra[0].tolist() == [[7], [1]]


def test_embedding_bias(tokenizer):
    bias = forge_text.embedding_bias([[b"hello", b"world"]], [[2.0, -1.5]], 500, tokenizer)
    assert bias.shape == (1, 500) and bias.dtype == np.float32
    for token in tokenizer.encode("hello", add_special_tokens=False):
        assert bias[0, token] >= 2.0 - 1.5
    with pytest.raises(ValueError, match="must|has 2 entries"):
        forge_text.embedding_bias([[b"a", b"b"]], [[1.0]], 500, tokenizer)


@pytest.mark.parametrize("value, default, expected", [
    ("true", False, True), ("FALSE", True, False), ("1", False, True), ("", True, True),
    (None, False, False), ("${add_special_tokens}", True, True), (True, False, True),
])
def test_parse_bool(value, default, expected):
    assert forge_text.parse_bool(value, default) is expected
