"""Tokenizers: round trips, special ids, and the errors a wrong setting gives.

Every model file is built here from scratch in tmp_path (no download): a tiktoken ranks file
written by hand, a sentencepiece model and a HF BPE trained on a few lines.
"""

import base64
import json

import pytest

from lingua.data.tokenizer import (
    ByteTokenizer,
    TokenizerArgs,
    build_tokenizer,
    check_tokenizer_args,
)
from lingua.errors import ConfigError

TEXTS = ["the quick brown fox jumps over the lazy dog",
         "hello world, this is a test of the tokenizer",
         "pack my box with five dozen liquor jugs",
         "then the other thing: 12345 and 678"]
NON_ASCII = "naïve café — 日本語 🙂 ok"


# ------------------------------------------------------------------------------------------------
# bytes


def test_bytes_round_trip_and_specials():
    tok = build_tokenizer(TokenizerArgs())
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    for text in TEXTS + [NON_ASCII, ""]:
        ids = tok.encode(text)
        # the reference: UTF-8 bytes framed by BOS and EOS
        assert ids == [256] + list(text.encode("utf-8")) + [257]
        assert tok.decode(ids) == text
    assert tok.encode("ab", add_bos=False, add_eos=False) == [97, 98]
    assert tok.encode("ab", add_bos=True, add_eos=False) == [256, 97, 98]
    assert tok.encode("ab", add_bos=False, add_eos=True) == [97, 98, 257]
    # specials anywhere are dropped by decode, multi-byte characters split by them survive
    euro = list("€".encode())
    assert tok.decode([256, 256, 104, 105, 257, 256]) == "hi"
    assert tok.decode(euro[:1] + [257] + euro[1:]) == "€"


# ------------------------------------------------------------------------------------------------
# tiktoken

MERGES = [b"th", b"the", b" t", b"he"]


@pytest.fixture
def tiktoken_file(tmp_path):
    path = tmp_path / "ranks.tiktoken"
    tokens = [bytes([i]) for i in range(256)] + MERGES
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n"
                            for rank, t in enumerate(tokens)))
    return path


def test_tiktoken_from_ranks_file(tiktoken_file):
    tok = build_tokenizer(TokenizerArgs("tiktoken", str(tiktoken_file)))
    n = 256 + len(MERGES)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 1, n + 2)
    the, th = 256 + MERGES.index(b"the"), 256 + MERGES.index(b"th")
    # "the" is merged through "th"; the split pattern keeps the space apart from the word
    assert tok.encode("the", add_bos=False, add_eos=False) == [the]
    assert tok.encode("the the", add_bos=False, add_eos=False) == [the, 32, the]
    assert tok.encode("thx", add_bos=False, add_eos=False) == [th, ord("x")]
    for text in TEXTS + [NON_ASCII]:
        ids = tok.encode(text)
        assert ids[0] == n and ids[-1] == n + 1
        assert all(0 <= i < n for i in ids[1:-1])
        assert len(ids) - 2 <= len(text.encode("utf-8"))
        assert tok.decode(ids) == text
    # special-token text in a document is plain text, not a special id
    ids = tok.encode("<|begin_of_text|>x", add_bos=False, add_eos=False)
    assert n not in ids and tok.decode(ids) == "<|begin_of_text|>x"
    assert tok.decode([n, the, n + 1, the]) == "thethe"


def test_tiktoken_file_fixed_in_place_loads(tiktoken_file):
    # Nothing remembers a file by its path: an empty one is a clean error, the valid one
    # written over it then loads, and so does a smaller one written over that.
    good = tiktoken_file.read_bytes()
    tiktoken_file.write_bytes(b"")
    with pytest.raises(ConfigError, match="empty or not tiktoken BPE ranks") as err:
        build_tokenizer(TokenizerArgs("tiktoken", str(tiktoken_file)))
    assert str(tiktoken_file) in str(err.value)
    tiktoken_file.write_bytes(good)
    assert build_tokenizer(TokenizerArgs("tiktoken", str(tiktoken_file))).vocab_size == 262
    tiktoken_file.write_bytes(b"".join(good.splitlines(keepends=True)[:256]))
    assert build_tokenizer(TokenizerArgs("tiktoken", str(tiktoken_file))).vocab_size == 258


# ------------------------------------------------------------------------------------------------
# sentencepiece


def train_sentencepiece(tmp_path, **overrides):
    import sentencepiece

    data = tmp_path / "sp_train.txt"
    data.write_text("\n".join(TEXTS * 20) + "\n")
    prefix = tmp_path / ("sp_" + "_".join(f"{k}{v}" for k, v in overrides.items()))
    kwargs = dict(input=str(data), model_prefix=str(prefix), vocab_size=60, model_type="bpe",
                  unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=1.0,
                  minloglevel=2)
    kwargs.update(overrides)
    sentencepiece.SentencePieceTrainer.train(**kwargs)
    return prefix.with_suffix(".model")


def test_sentencepiece_round_trip(tmp_path):
    import sentencepiece

    path = train_sentencepiece(tmp_path)
    tok = build_tokenizer(TokenizerArgs("sentencepiece", str(path)))
    ref = sentencepiece.SentencePieceProcessor(model_file=str(path))
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 60)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [1] + ref.encode(text) + [2]
        assert tok.decode(ids) == text
    assert tok.encode(TEXTS[0], add_bos=False, add_eos=False) == ref.encode(TEXTS[0])


def test_sentencepiece_without_bos_is_rejected(tmp_path):
    path = train_sentencepiece(tmp_path, bos_id=-1)
    with pytest.raises(ConfigError, match="BOS"):
        build_tokenizer(TokenizerArgs("sentencepiece", str(path)))


# ------------------------------------------------------------------------------------------------
# Hugging Face tokenizers


def train_hf(tmp_path, specials=("<s>", "</s>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TEXTS * 10, trainer)
    path = tmp_path / f"tokenizer{len(specials)}.json"
    tok.save(str(path))
    return path


def test_hf_round_trip(tmp_path):
    from tokenizers import Tokenizer

    path = train_hf(tmp_path)
    ref = Tokenizer.from_file(str(path))
    tok = build_tokenizer(TokenizerArgs("hf", str(path)))
    assert tok.bos_id == ref.token_to_id("<s>") and tok.eos_id == ref.token_to_id("</s>")
    assert tok.bos_id != tok.eos_id
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True)
    for text in TEXTS + [NON_ASCII]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        assert ids[1:-1] == ref.encode(text, add_special_tokens=False).ids
        assert tok.bos_id not in ids[1:-1] and tok.eos_id not in ids[1:-1]
        assert tok.decode(ids) == text
    # the merges learnt something: common words take fewer tokens than bytes
    assert len(tok.encode(TEXTS[0])) - 2 < len(TEXTS[0])


def test_hf_specials_from_tokenizer_config(tmp_path):
    from tokenizers import Tokenizer

    # <s> and </s> exist, but the config beside tokenizer.json names other tokens: it wins
    path = train_hf(tmp_path, specials=("<s>", "</s>", "<|im_start|>", "<|im_end|>"))
    ref = Tokenizer.from_file(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "lstrip": False}}))
    tok = build_tokenizer(TokenizerArgs("hf", str(path)))
    assert tok.bos_id == ref.token_to_id("<|im_start|>") != ref.token_to_id("<s>")
    assert tok.eos_id == ref.token_to_id("<|im_end|>") != ref.token_to_id("</s>")
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]
    # a config naming no usable token (null, or a token the vocabulary lacks) falls back
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<nope>"}))
    tok = build_tokenizer(TokenizerArgs("hf", str(path)))
    assert (tok.bos_id, tok.eos_id) == (ref.token_to_id("<s>"), ref.token_to_id("</s>"))


def test_hf_without_bos_is_rejected(tmp_path):
    path = train_hf(tmp_path, specials=("<pad>",))
    with pytest.raises(ConfigError, match="BOS"):
        build_tokenizer(TokenizerArgs("hf", str(path)))


# ------------------------------------------------------------------------------------------------
# errors


def test_missing_path_names_the_kind():
    for kind in ("tiktoken", "sentencepiece", "hf"):
        with pytest.raises(ConfigError, match=f"kind={kind}") as err:
            build_tokenizer(TokenizerArgs(kind, None))
        assert "data.tokenizer.path" in str(err.value)


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.model"
    for kind in ("tiktoken", "sentencepiece", "hf"):
        with pytest.raises(ConfigError) as err:
            check_tokenizer_args(TokenizerArgs(kind, str(missing)))
        assert str(missing) in str(err.value)
        with pytest.raises(ConfigError):
            build_tokenizer(TokenizerArgs(kind, str(missing)))
    # a directory is not a tokenizer file either
    with pytest.raises(ConfigError, match=str(tmp_path)):
        build_tokenizer(TokenizerArgs("hf", str(tmp_path)))


def test_unknown_kind_names_it():
    with pytest.raises(ConfigError, match="wordpiece") as err:
        build_tokenizer(TokenizerArgs("wordpiece", None))
    assert "bytes" in str(err.value)  # the message lists the valid kinds


def test_file_of_the_wrong_kind(tmp_path, tiktoken_file):
    hf_file = train_hf(tmp_path)
    sp_file = train_sentencepiece(tmp_path)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\xffnot a tokenizer\n" * 10)
    cases = [("sentencepiece", hf_file), ("hf", sp_file), ("hf", tiktoken_file),
             ("tiktoken", hf_file), ("sentencepiece", tiktoken_file), ("tiktoken", junk),
             ("hf", junk), ("sentencepiece", junk)]
    for kind, path in cases:
        with pytest.raises(ConfigError) as err:
            build_tokenizer(TokenizerArgs(kind, str(path)))
        assert str(path) in str(err.value), (kind, path, err.value)
    # sanity: the same files load under their own kind
    json.loads(hf_file.read_text())
    build_tokenizer(TokenizerArgs("hf", str(hf_file)))
    build_tokenizer(TokenizerArgs("sentencepiece", str(sp_file)))
    build_tokenizer(TokenizerArgs("tiktoken", str(tiktoken_file)))


def test_a_path_that_disagrees_with_the_kind_is_refused_before_loading(tmp_path, tiktoken_file):
    """Issue 58: kind=bytes with a tokenizer file (the debug presets' kind and a user's path)
    trained on byte ids with the file ignored; a file the kind does not read is refused at
    config time too, each naming both keys and the kind that reads the file."""
    hf_file = train_hf(tmp_path)
    sp_file = train_sentencepiece(tmp_path)
    cases = [("bytes", hf_file, "hf"), ("bytes", sp_file, "tiktoken or sentencepiece"),
             ("tiktoken", hf_file, "hf"), ("sentencepiece", hf_file, "hf"),
             ("hf", sp_file, "tiktoken or sentencepiece"),
             ("hf", tiktoken_file, "tiktoken or sentencepiece")]
    for kind, path, fix in cases:
        with pytest.raises(ConfigError) as err:
            check_tokenizer_args(TokenizerArgs(kind, str(path)))
        message = str(err.value)
        assert f"data.tokenizer.kind={kind}" in message and str(path) in message, message
        assert f"Set data.tokenizer.kind={fix}" in message, message
    for kind, path in [("hf", hf_file), ("sentencepiece", sp_file), ("tiktoken", tiktoken_file)]:
        check_tokenizer_args(TokenizerArgs(kind, str(path)))
    # a run saved before this check (kind bytes, a stray path) still reads back as bytes
    assert build_tokenizer(TokenizerArgs("bytes", str(hf_file))).vocab_size == 258


def test_a_vocabulary_past_the_embedding_names_the_value_to_set(tmp_path):
    """Issue 58 point 9: a new tokenizer's vocabulary is not read into model.vocab_size; the
    refusal names the tokenizer, its vocabulary and the value to type."""
    from types import SimpleNamespace

    from lingua.train.app import check_vocab

    path = train_hf(tmp_path)   # 320 tokens
    args = SimpleNamespace(data=SimpleNamespace(tokenizer=TokenizerArgs("hf", str(path))),
                           model=SimpleNamespace(vocab_size=258),
                           checkpoint=SimpleNamespace(init_from=None))
    with pytest.raises(ConfigError, match=f"The tokenizer \\(hf {path}\\) has 320 tokens but "
                                          f"model.vocab_size=258: .* set model.vocab_size=320"):
        check_vocab(args)
    args.model.vocab_size = 320
    check_vocab(args)
