"""Bad data: every kind of bad jsonl line is counted by reason and skipped, in the stream and when
a memmap corpus is prepared; long documents are packed across rows; a damaged memmap corpus is
refused before training with one paragraph naming the file and the command that rebuilds it.

The corpora are written here byte by byte; references come from the good lines written.
"""

import json
import logging
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from lingua.data import (
    DataArgs,
    JsonlLoader,
    MemmapLoader,
    validate_data_args,
)
from lingua.data.jsonl import SKIP_REASONS, BadLine, decode_line
from lingua.data.memmap import write_memmap_corpus
from lingua.data.tokenizer import ByteTokenizer, TokenizerArgs
from lingua.errors import ConfigError
from tests.conftest import REPO, load_prepare_data, read_metrics, run_python, tiny_args
from tests.test_data import assert_steps_equal, global_step, jargs, raw_tokens, stream_docs

# Every kind of line that has nothing to train on, by the reason it is counted under.
BAD = {
    "invalid_utf8": [b'{"text": "\xff\xfe"}', b"\xff\xfe", b'{"text": "caf\xc3"}',
                     b'{"text": "lone \\ud800 surrogate"}'],  # valid JSON, no tokenizer takes it
    "invalid_json": [b'{"text": "broken', b'{"text": "a",}', b"not json", b"[" * 100_000],
    "no_text": [b'{"txt": "x"}', b'{"text": 42}', b'{"text": null}', b'{"text": ["a"]}',
                b'["text"]', b'"a string"', b"NaN"],
    "empty": [b'{"text": ""}'],
}
BAD_LINES = [raw for lines in BAD.values() for raw in lines]
N_BAD = len(BAD_LINES)


def good(text: str) -> bytes:
    return json.dumps({"text": text, "meta": {"n": len(text)}}).encode()


def write_lines(path, lines, newline=b"\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(raw + newline for raw in lines))


def test_decode_line_names_the_reason():
    for reason, lines in BAD.items():
        for raw in lines:
            with pytest.raises(BadLine) as err:
                decode_line(raw)
            assert err.value.reason == reason, raw[:40]
    assert decode_line(good("ünï €")) == "ünï €"
    assert decode_line(b'{"text": "\\ud83d\\ude00"}\r\n') == "\U0001F600"  # a valid pair
    assert decode_line(b'\xef\xbb\xbf{"text": "after a byte-order mark"}') == \
        "after a byte-order mark"
    assert decode_line(b'{"text": "   "}') == "   "  # whitespace is text


@pytest.fixture
def bad_source(tmp_path):
    """Two chunk files, good and bad lines interleaved; returns (dir, good texts, bad positions).

    Bad positions are (file, 1-based line in that file) of every counted line; blank lines are
    formatting and are neither documents nor counted."""
    src = tmp_path / "src"
    texts, bad_at = [], []
    for f, bad_lines in enumerate((BAD_LINES[:9], BAD_LINES[9:])):
        lines = [b'\xef\xbb\xbf' + good(f"f{f} first, after a BOM")]
        texts.append(f"f{f} first, after a BOM")
        for i, raw in enumerate(bad_lines):
            lines += [raw, good(f"f{f} good {i} ü"), b"", b"  \r"]
            bad_at.append((src / f"{f}.jsonl", len(lines) - 3))
            texts.append(f"f{f} good {i} ü")
        write_lines(src / f"{f}.jsonl", lines)
    assert len(bad_at) == N_BAD
    return src, texts, bad_at


def skip_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "lingua.data"]


def test_jsonl_bad_lines_counted_by_reason_and_logged_with_file_and_line(bad_source, caplog):
    src, texts, bad_at = bad_source
    caplog.set_level(logging.WARNING, logger="lingua.data")
    loader = JsonlLoader(jargs(src), 0, 1, seed=0)
    skipped, skip = [], loader.counter.skip
    loader.counter.skip = lambda path, line, err: skipped.append((path, line)) or skip(
        path, line, err)
    assert stream_docs(loader, len(texts)) == texts  # every good line, in order, once
    assert sum(loader.skipped().values()) == N_BAD
    assert loader.skipped() == {reason: len(lines) for reason, lines in BAD.items()}
    assert set(loader.skipped()) == set(SKIP_REASONS)
    # each with the line number inside its own file (past file 0 too); the first warned of once
    assert skipped == bad_at and any(path == src / "1.jsonl" for path, _ in skipped)
    [message] = skip_warnings(caplog)
    path, line = bad_at[0]
    assert message.startswith(f"skipping unusable line {line} of {path} ("), message
    # a whole sentence (issue 58: it ended at "of the lines read are")
    assert message.endswith("refused if more than 0.1 of the lines read are unusable "
                            "(data.max_skipped_fraction)"), message
    # a checkpointed position keeps the counts
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = JsonlLoader(jargs(src), 0, 1, seed=0)
    resumed.load_state_dict(state)
    assert sum(resumed.skipped().values()) == N_BAD and resumed.skipped() == loader.skipped()


def test_jsonl_bad_lines_are_counted_once_over_many_epochs(bad_source, caplog):
    """skipped_lines says how many lines of the data are bad, not how often they were passed."""
    src, texts, _ = bad_source
    caplog.set_level(logging.WARNING, logger="lingua.data")
    loader = JsonlLoader(jargs(src), 0, 1, seed=0)
    assert stream_docs(loader, 3 * len(texts)) == texts * 3  # three epochs, in order
    assert loader.sources[0].state["epoch"] >= 2
    assert sum(loader.skipped().values()) == N_BAD
    assert loader.skipped() == {reason: len(lines) for reason, lines in BAD.items()}
    assert len(skip_warnings(caplog)) == 1


def test_jsonl_warnings_are_capped_with_summaries_and_too_many_bad_lines_refused(tmp_path,
                                                                                   caplog):
    src = tmp_path / "src"
    write_lines(src / "a.jsonl", [b"{bad"] * 1234 + [good(f"good {i}") for i in range(10)])
    caplog.set_level(logging.WARNING, logger="lingua.data")
    loader = JsonlLoader(jargs(src, max_skipped_fraction=1.0), 0, 1, seed=0)
    assert stream_docs(loader, 1) == ["good 0"]
    assert loader.skipped()["invalid_json"] == sum(loader.skipped().values()) == 1234
    messages = skip_warnings(caplog)
    assert len(messages) == 1 + 2  # the first line, then summaries at 100 and 1000
    assert messages[1].startswith("100 lines skipped so far") and "line 100 of" in messages[1]
    assert messages[2].startswith("1000 lines skipped so far")
    # The default 0.1: judged from the 100th line read, refused there, naming the first.
    with pytest.raises(ConfigError, match=rf"100 of the first 100 lines are unusable "
                                          rf"\({{'invalid_json': 100}}\), more than "
                                          rf"data.max_skipped_fraction=0.1; the first is line 1 "
                                          rf"of {src / 'a.jsonl'}"):
        stream_docs(JsonlLoader(jargs(src), 0, 1, seed=0), 1)
    # 10 bad of 110 passes (9%), 12 of 112 does not.
    write_lines(src / "a.jsonl", [b"{bad"] * 10 + [good(f"good {i}") for i in range(100)])
    assert len(stream_docs(JsonlLoader(jargs(src), 0, 1, seed=0), 100)) == 100
    write_lines(src / "a.jsonl", [b"{bad"] * 12 + [good(f"good {i}") for i in range(100)])
    with pytest.raises(ConfigError, match="12 of the first 1.. lines are unusable"):
        stream_docs(JsonlLoader(jargs(src), 0, 1, seed=0), 100)


def test_jsonl_source_with_no_good_line_is_a_config_error(tmp_path):
    write_lines(tmp_path / "root" / "ok" / "a.jsonl", [good("fine")] * 3)
    write_lines(tmp_path / "root" / "junk" / "a.jsonl", BAD_LINES)
    loader = JsonlLoader(jargs(tmp_path / "root", sources={"ok": 1.0, "junk": 1.0}), 0, 1, seed=0)
    with pytest.raises(ConfigError, match="junk") as err:
        for _ in range(20):
            loader.next_step()
    assert "lines skipped as bad" in str(err.value)


def test_check_jsonl_lines_fits_its_advice_to_the_case(tmp_path):
    """Every line bad: the file and the first bad line's problem, and no word of ranks, whatever
    the number of ranks. Usable lines that miss a rank (rank r reads lines r, r+dp, ..., blank
    lines keeping their place): that advice, which only more than one rank can need."""
    root, chunk = tmp_path / "c", tmp_path / "c" / "0.jsonl"
    write_lines(root / "val" / "v.jsonl", [good("held out")])
    write_lines(chunk, [b"", b"not json", b'{"txt": 1}'])
    for dp in (1, 4):
        with pytest.raises(ConfigError) as err:
            JsonlLoader.check_ranks(jargs(root, val_sequences=2), dp)
        message = str(err.value)
        assert f"line 2 of {chunk}: invalid JSON" in message, message
        assert "'invalid_json': 1, 'no_text': 1" in message and "rank" not in message
    write_lines(chunk, [b"not json", good("one"), b"", good("three"), good("four")])
    JsonlLoader.check_ranks(jargs(root, val_sequences=2), 1)
    JsonlLoader.check_ranks(jargs(root, val_sequences=2), 2)   # lines 1, 3 (and 4, 0-based) read
    with pytest.raises(ConfigError) as err:
        JsonlLoader.check_ranks(jargs(root, val_sequences=2), 4)
    assert "has 3 usable line(s) for 4 data-parallel ranks" in str(err.value)
    assert "rank 2 would get none" in str(err.value)
    assert "fewer data-parallel ranks" in str(err.value)
    write_lines(root / "val" / "v.jsonl", [b'{"text": ""}'])
    JsonlLoader.check_ranks(jargs(root, val_sequences=0), 1)   # no validation: val/ is not read
    with pytest.raises(ConfigError, match=r"validation data in .*'empty': 1.*val_sequences=0"):
        JsonlLoader.check_ranks(jargs(root, val_sequences=2), 1)


def test_jsonl_resume_from_a_state_without_file_start(bad_source):
    """Positions saved before the per-file line number was kept still resume exactly."""
    src, _, _ = bad_source
    ref, _ = global_step(None, 1, steps=12, loaders=[JsonlLoader(jargs(src), 0, 1, seed=0)])
    first = JsonlLoader(jargs(src), 0, 1, seed=0)
    got, _ = global_step(None, 1, steps=6, loaders=[first])
    state = json.loads(json.dumps(first.state_dict()))
    assert state["sources"][0]["file"] == 1  # stopped inside the second file
    for source in state["sources"]:
        del source["file_start"]
    del state["skipped_by_reason"]
    resumed = JsonlLoader(jargs(src), 0, 1, seed=0)
    resumed.load_state_dict(state)
    assert resumed.sources[0].state["file_start"] == first.sources[0].state["file_start"]
    rest, _ = global_step(None, 1, steps=6, loaders=[resumed])
    assert_steps_equal(got + rest, ref)


def test_jsonl_long_document_is_packed_across_rows_and_steps(tmp_path):
    long_text = "".join(chr(ord("a") + i % 26) for i in range(20_000)) + " the end"
    write_lines(tmp_path / "src" / "a.jsonl",
                [good("short one"), good(long_text), good("short two")])
    args = jargs(tmp_path / "src", seq_len=16, batch_size=4, grad_accum=2)
    loader = JsonlLoader(args, 0, 1, seed=0)
    encoded, encode = [], loader.tokenizer.encode
    loader.tokenizer.encode = lambda text: encoded.append(text) or encode(text)
    assert stream_docs(loader, 3) == ["short one", long_text, "short two"]
    # ~160 steps take slices of one tokenization per document read (5 here: the stream reads
    # into the next epoch), not one per step: what a wall-clock bound here guarded, less reliably.
    assert len(encoded) <= 6 and encoded[:3] == ["short one", long_text, "short two"], len(encoded)
    # the long document's tokens carry one document id from row to row
    loader = JsonlLoader(args, 0, 1, seed=0)
    docs = torch.cat([b.doc_ids.flatten() for _ in range(40) for b in loader.next_step()])
    assert set(docs.tolist()) == {0, 1} and (docs == 1).sum() > 40 * 8 * 16 - 20
    # a checkpoint taken inside the long document resumes exactly
    state = json.loads(json.dumps(loader.state_dict()))
    assert len(state["buffer"]) > 10_000
    rest, _ = global_step(None, 1, steps=5, loaders=[loader])
    resumed = JsonlLoader(args, 0, 1, seed=0)
    resumed.load_state_dict(state)
    again, _ = global_step(None, 1, steps=5, loaders=[resumed])
    assert_steps_equal(again, rest)


# ------------------------------------------------------------------------------------------------
# setup/prepare_data.py on bad lines, and the memmap corpus it writes


def test_prepare_jsonl_counts_bad_lines_by_reason_once(bad_source, tmp_path, caplog):
    src, texts, bad_at = bad_source
    long_text = "x" * 5000 + "ü"
    with open(src / "1.jsonl", "ab") as f:
        f.write(good("pad") + b"\n" + good(long_text) + b"\n")
    texts = texts + ["pad", long_text]
    caplog.set_level(logging.WARNING, logger="lingua.data")
    out = tmp_path / "out"
    args = ["jsonl", str(src), "--out", str(out), "--val-fraction", "0.5"]
    assert load_prepare_data().main(args) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped_lines"] == N_BAD
    assert meta["skipped_by_reason"] == {reason: len(lines) for reason, lines in BAD.items()}
    assert len(skip_warnings(caplog)) == 1  # the val pass reads the same lines but is quiet
    assert skip_warnings(caplog)[0].startswith(
        f"skipping unusable line {bad_at[0][1]} of {bad_at[0][0]}")
    tok = ByteTokenizer()
    train = [t for i, t in enumerate(texts) if i % 2]
    assert train[-1] == long_text
    assert raw_tokens(out).tolist() == [t for text in train for t in tok.encode(text)]
    # the long document spans many windows; the loader reads it with one document id throughout
    args = DataArgs(root=str(out), format="memmap", seq_len=16, batch_size=64, val_sequences=0)
    validate_data_args(args)
    loader = MemmapLoader(args, 0, 1, seed=0)
    assert sum(loader.skipped().values()) == 0 and set(loader.skipped()) == set(SKIP_REASONS)
    batch = loader.next_step()[0]
    last_doc = len(train) - 1
    inside = (batch.doc_ids == last_doc).all(dim=1)
    assert inside.sum() >= 10 and (batch.tokens[inside] == ord("x")).float().mean() > 0.9


@pytest.fixture
def memmap_corpus(tmp_path):
    """A small bytes-tokenized memmap corpus (uint16 tokens), train and val."""
    root = tmp_path / "corpus"
    docs = [f"document number {i} " * (3 + i % 5) for i in range(80)]
    write_memmap_corpus(root, {"train": iter(docs[:60]), "val": iter(docs[60:])}, ByteTokenizer(),
                        TokenizerArgs(), source="test")
    return root


def test_plain_data_logs_its_tokenizer_and_vocabulary_on_rank_0(bad_source, memmap_corpus,
                                                                 caplog):
    """Issue 58: the log names the tokenizer that reads the data, as chat data's does."""
    src = bad_source[0]
    caplog.set_level(logging.INFO, logger="lingua.data")
    JsonlLoader(jargs(src), 0, 1, seed=0)
    MemmapLoader(corpus_args(memmap_corpus), 0, 1, seed=0)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "jsonl data: the bytes tokenizer (258 tokens)" in lines
    assert f"memmap data: {memmap_corpus}, tokenized by the bytes tokenizer (258 tokens)" in lines
    caplog.clear()
    JsonlLoader(jargs(src), 1, 2, seed=0)   # another data-parallel rank says nothing
    MemmapLoader(corpus_args(memmap_corpus), 1, 2, seed=0)
    assert not [r for r in caplog.records if r.levelno == logging.INFO]


def corpus_args(root, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("val_sequences", 4)
    return DataArgs(root=str(root), format="memmap", **kw)


def damage(root, how: str):
    """Damage the corpus at root as `how` says; returns the file the error must name."""
    train, docs, meta_path = root / "train.bin", root / "train.docs.npy", root / "meta.json"
    meta = json.loads(meta_path.read_text())
    if how == "short":          # whole tokens missing at the end: an interrupted copy
        train.write_bytes(train.read_bytes()[:-200])
    elif how == "odd_size":     # not a whole number of uint16 tokens
        train.write_bytes(train.read_bytes()[:-201])
    elif how == "long":
        train.write_bytes(train.read_bytes() + b"\0\0")
    elif how == "missing_bin":
        train.unlink()
    elif how == "val_short":
        (root / "val.bin").write_bytes((root / "val.bin").read_bytes()[:-3])
        return root / "val.bin"
    elif how == "docs_truncated":
        docs.write_bytes(docs.read_bytes()[:-5])
        return docs
    elif how == "docs_missing":
        docs.unlink()
        return docs
    elif how == "docs_garbage":
        docs.write_bytes(b"this is no npy file")
        return docs
    elif how == "docs_count":
        np.save(docs, np.load(docs)[:-1])
        return docs
    elif how == "docs_order":
        starts = np.load(docs)
        np.save(docs, starts[::-1].copy())
        return docs
    elif how == "meta_no_split":
        del meta["splits"]["train"]
        meta_path.write_text(json.dumps(meta))
        return meta_path
    elif how == "meta_no_tokenizer":
        del meta["tokenizer"]
        meta_path.write_text(json.dumps(meta))
        return meta_path
    elif how == "meta_list":
        meta_path.write_text("[]")
        return meta_path
    elif how == "meta_truncated":
        meta_path.write_text(meta_path.read_text()[:-10])
        return meta_path
    else:
        raise AssertionError(how)
    return train


DAMAGE = ["short", "odd_size", "long", "missing_bin", "val_short", "docs_truncated",
          "docs_missing", "docs_garbage", "docs_count", "docs_order", "meta_no_split",
          "meta_no_tokenizer", "meta_list", "meta_truncated"]


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_memmap_corpus_is_refused_naming_file_and_fix(memmap_corpus, how):
    named = damage(memmap_corpus, how)
    with pytest.raises(ConfigError) as err:
        validate_data_args(corpus_args(memmap_corpus))
    message = str(err.value)
    assert str(named) in message and "setup/prepare_data.py" in message, message
    assert "\n" not in message  # one paragraph
    if how == "odd_size":
        assert "not a whole number of uint16 tokens" in message and "truncated" in message
    if how == "short":
        assert "truncated" in message and "whole number" not in message
    if not how.startswith("val") and not how.startswith("meta_no_tok"):
        with pytest.raises(ConfigError, match=re.escape(named.name)):
            MemmapLoader(corpus_args(memmap_corpus), 0, 1, seed=0)


def test_damaged_token_ids_are_caught_when_read(memmap_corpus):
    train = memmap_corpus / "train.bin"
    tokens = np.fromfile(train, dtype=np.uint16)
    tokens[100:110] = 60_000  # same size, so only the ids themselves tell
    tokens.tofile(train)
    validate_data_args(corpus_args(memmap_corpus))
    loader = MemmapLoader(corpus_args(memmap_corpus, batch_size=64), 0, 1, seed=0)
    with pytest.raises(ConfigError, match="token id 60000 at position 10[0-9]") as err:
        for _ in range(10):
            loader.next_step()
    assert str(train) in str(err.value) and "setup/prepare_data.py" in str(err.value)


def test_rebuild_hint_is_a_command_that_works(tmp_path, bad_source):
    src, _, _ = bad_source
    out = tmp_path / "prepared"
    prepare_data = load_prepare_data()
    assert prepare_data.main(["jsonl", str(src), "--out", str(out)]) == 0
    good_bytes = (out / "train.bin").read_bytes()
    damage(out, "short")
    with pytest.raises(ConfigError) as err:
        validate_data_args(corpus_args(out, val_sequences=0))
    command = re.search(r"`python setup/prepare_data.py (jsonl [^`]*)`", str(err.value)).group(1)
    proc = subprocess.run([sys.executable, "setup/prepare_data.py", *shlex.split(command)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (out / "train.bin").read_bytes() == good_bytes
    validate_data_args(corpus_args(out, val_sequences=0))


def test_embedded_corpus_hint_says_remove_and_rebuild(corpus, tmp_path):
    root = tmp_path / "embedded"
    shutil.copytree(corpus, root)
    damage(root, "odd_size")
    with pytest.raises(ConfigError) as err:
        validate_data_args(corpus_args(root))
    assert f"rm -r {root} && python setup/prepare_data.py embedded --out {root}" in str(err.value)


# ------------------------------------------------------------------------------------------------
# end to end: python -m apps.llama.train


@pytest.mark.parametrize("how", ["short", "odd_size", "docs_truncated"])
def test_train_refuses_a_damaged_memmap_corpus_before_starting(memmap_corpus, tmp_path, how):
    named = damage(memmap_corpus, how)
    dump = tmp_path / "run"
    # "Before starting" is shown by what is not there (no dump_dir: nothing was written, no
    # model built), not by a time limit a busy machine could miss; the timeout is a hang guard.
    proc = run_python("apps.llama.train", tiny_args(memmap_corpus, dump), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err  # one paragraph
    assert str(named) in err and "setup/prepare_data.py" in err
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not dump.exists()


def bad_jsonl_corpus(root):
    """Two sources for data.sources and a val/ directory. Source `a` holds every kind of bad line
    early (all are read within the first step), then a document 50 times seq_len long; neither
    source is read to its end in 5 steps, so each bad line is seen exactly once."""
    lines, bad_at = [good("a first")], {}
    for i, raw in enumerate(BAD_LINES):
        lines.append(raw)
        bad_at.setdefault(next(r for r, bad in BAD.items() if raw in bad), len(lines))
        if i % 2:
            lines.append(b"")  # blank lines between some: not documents, not counted
    lines += [good("a after the bad lines"), good("long " + "0123456789" * 320)]
    lines += [good(f"a {i} " * 8) for i in range(60)]
    write_lines(root / "a" / "a.chunk.00.jsonl", lines, newline=b"\r\n")
    write_lines(root / "b" / "b.chunk.00.jsonl", [good(f"b {i} " * 8) for i in range(80)])
    write_lines(root / "val" / "v.jsonl", [b"{bad val line"] + [good(f"v {i} " * 8)
                                                                for i in range(40)])
    return root / "a" / "a.chunk.00.jsonl", bad_at


@pytest.fixture(scope="module")
def bad_jsonl_runs(tmp_path_factory):
    """The same jsonl run on the bad corpus, twice."""
    tmp = tmp_path_factory.mktemp("bad_jsonl")
    first_file, bad_at = bad_jsonl_corpus(tmp / "corpus")
    runs = []
    for name in ("one", "two"):
        dump = tmp / name
        args = tiny_args(tmp / "corpus", dump, "data.format=jsonl", "data.sources={a:1.0,b:1.0}")
        runs.append((run_python("apps.llama.train", args), read_metrics(dump)))
    return first_file, bad_at, runs


@pytest.mark.slow
def test_train_on_jsonl_with_every_kind_of_bad_line(bad_jsonl_runs):
    first_file, bad_at, [(proc, rows), _] = bad_jsonl_runs
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(r["loss"]) for r in rows)
    assert [r["skipped_lines"] for r in rows] == [N_BAD] * 5
    log = proc.stdout + proc.stderr
    assert "Traceback" not in log
    assert bad_at["invalid_utf8"] == 2   # (the lines end in \r\n)
    # the first bad line is warned of once, by its line number in its file; the rest counted
    assert f"skipping unusable line 2 of {first_file} (invalid_utf8: invalid UTF-8" in log
    assert log.count("skipping unusable line") == 2   # and once for the validation data's
    assert f"skipping unusable line 1 of {first_file.parent.parent / 'val' / 'v.jsonl'}" in log


def test_jsonl_run_is_bit_identical_twice(bad_jsonl_runs):
    """Same seed and layout, fp32 on CPU: the same losses, bit for bit, bad lines and all."""
    _, _, [(_, one), (_, two)] = bad_jsonl_runs
    assert [r["loss"] for r in one] == [r["loss"] for r in two]
    assert [r["grad_norm"] for r in one] == [r["grad_norm"] for r in two]
    assert [r["skipped_lines"] for r in one] == [r["skipped_lines"] for r in two]


@pytest.mark.parametrize("world_size", [1, 2])
def test_train_refuses_jsonl_without_lines_for_its_ranks_before_writing(tmp_path, world_size):
    """Every line bad (one rank), or one usable line for two ranks: refused before the run
    directory exists, with the advice that fits the case."""
    from tests.test_bad_config import check_refused, run_case

    root, dump = tmp_path / "corpus", tmp_path / "run"
    write_lines(root / "val" / "v.jsonl", [good("held out " * 20)])
    write_lines(root / "0.jsonl", [b"not json", b'{"txt": 1}']
                + [good("the only document")] * (world_size > 1))
    env = {"WORLD_SIZE": str(world_size)} if world_size > 1 else {}
    proc = run_case("apps.llama.train", tiny_args(root, dump, "data.format=jsonl"), env)
    if world_size == 1:
        message = check_refused(proc, f"line 1 of {root / '0.jsonl'}: invalid JSON")
        assert "rank" not in message, message
    else:
        check_refused(proc, "rank 1 would get none. Train on fewer data-parallel ranks")
    assert not dump.exists()
