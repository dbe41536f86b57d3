"""The data pipeline: the layout-invariant memmap loader, the jsonl stream, prepare_data.

References are computed here from the raw token array / the lines written, not from the loader.
"""

import dataclasses
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lingua.data import (
    DataArgs,
    JsonlLoader,
    MemmapLoader,
    build_train_loader,
    build_val_batches,
    validate_data_args,
)
from lingua.data.jsonl import SKIP_REASONS, JsonlSource, SkipCounter
from lingua.data.memmap import write_memmap_corpus
from lingua.data.tokenizer import ByteTokenizer, TokenizerArgs
from lingua.errors import ConfigError
from tests.conftest import load_prepare_data, read_metrics, run_python, tiny_args

BOS, EOS = 256, 257
ALPHABET = "abcdefghijklmnopqrstuvwxyzäöüé€ "


def random_docs(n, seed, min_len=3, max_len=40):
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(min_len, max_len)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small bytes-tokenized memmap corpus: ~60 documents of random letters, 2 splits."""
    root = tmp_path_factory.mktemp("small") / "corpus"
    train, val = random_docs(60, seed=1), random_docs(12, seed=2)
    write_memmap_corpus(root, {"train": iter(train), "val": iter(val)}, ByteTokenizer(),
                        TokenizerArgs(), source="test")
    return root


def raw_tokens(root, split="train"):
    meta = json.loads((Path(root) / "meta.json").read_text())
    return np.fromfile(Path(root) / f"{split}.bin", dtype=meta["dtype"]).astype(np.int64)


def margs(root, **kw):
    kw.setdefault("seq_len", 8)
    kw.setdefault("val_sequences", 0)
    return DataArgs(root=str(root), format="memmap", **kw)


def global_step(args, dp_size, seed=0, steps=4, loaders=None):
    """Per step: all ranks' micro-batches concatenated in rank then micro-batch order."""
    if loaders is None:
        loaders = [build_train_loader(args, r, dp_size, seed) for r in range(dp_size)]
    out = []
    for _ in range(steps):
        micro = [b for loader in loaders for b in loader.next_step()]
        out.append(tuple(torch.cat([getattr(b, k) for b in micro]) for k in
                         ("tokens", "labels", "doc_ids")))
    return out, loaders


def assert_steps_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for tx, ty in zip(x, y):
            assert tx.dtype == ty.dtype == torch.int64
            assert torch.equal(tx, ty)


# ------------------------------------------------------------------------------------------------
# memmap: layout invariance and resume


LAYOUTS = [(1, 8, 1), (2, 4, 1), (4, 2, 1), (2, 2, 2), (1, 2, 4), (8, 1, 1)]  # dp, batch, accum


@pytest.mark.parametrize("which", ["small", "corpus"])
def test_memmap_global_batch_is_layout_invariant(which, small, request):
    root = small if which == "small" else request.getfixturevalue("corpus")
    seq_len = 8 if which == "small" else 64
    steps = 12 if which == "small" else 3  # the small corpus wraps into epoch 2 within 12 steps
    ref = None
    for dp, bs, accum in LAYOUTS:
        args = margs(root, seq_len=seq_len, batch_size=bs, grad_accum=accum)
        got, loaders = global_step(args, dp, seed=7, steps=steps)
        assert all(loader.next_step()[0].tokens.shape == (bs, seq_len) for loader in loaders)
        assert all(len(loader.next_step()) == accum for loader in loaders)
        if ref is None:
            ref = got
            assert all(t.shape == (8, seq_len) for step in ref for t in step)
            assert not torch.equal(ref[0][0], ref[1][0])
        else:
            assert_steps_equal(got, ref)
    # another seed is another order
    other, _ = global_step(margs(root, seq_len=seq_len, batch_size=8), 1, seed=8, steps=1)
    assert not torch.equal(other[0][0], ref[0][0])


def test_memmap_resume_on_another_layout(small):
    ref, _ = global_step(margs(small, batch_size=8), 1, steps=7)
    first, loaders4 = global_step(margs(small, batch_size=2), 4, steps=3)
    assert_steps_equal(first, ref[:3])
    states = [loader.state_dict() for loader in loaders4]
    assert all(s == states[0] for s in states)  # the state does not depend on the rank
    state = json.loads(json.dumps(states[0]))   # and survives a round trip through JSON
    loaders2 = []
    for r in range(2):
        loader = MemmapLoader(margs(small, batch_size=2, grad_accum=2), r, 2, seed=0)
        loader.load_state_dict(state)
        loaders2.append(loader)
    rest, _ = global_step(None, 2, steps=4, loaders=loaders2)
    assert_steps_equal(rest, ref[3:])


def test_memmap_load_state_rejects_other_seq_len_or_seed(small):
    state = MemmapLoader(margs(small, batch_size=2), 0, 1, seed=0).state_dict()
    with pytest.raises(ConfigError, match="seq_len"):
        MemmapLoader(margs(small, seq_len=16, batch_size=2), 0, 1, seed=0).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed"):
        MemmapLoader(margs(small, batch_size=2), 0, 1, seed=1).load_state_dict(state)
    jsonl_state = {"format": "jsonl", "dp_rank": 0, "dp_size": 1, "sources": []}
    with pytest.raises(ConfigError, match="format"):
        MemmapLoader(margs(small, batch_size=2), 0, 1, seed=0).load_state_dict(jsonl_state)


def test_loaders_have_no_worker_or_prefetch_option():
    """The loaders run in the training process: no workers whose number could change the order.
    Whoever adds such an option adds the test that 0 and 2 workers give the same batches."""
    names = [f.name for f in dataclasses.fields(DataArgs)]
    assert not [n for n in names if "worker" in n or "prefetch" in n], names


@pytest.mark.parametrize("fmt", ["memmap", "jsonl"])
def test_step_batches_depend_only_on_seed_and_layout(fmt, small, tmp_path):
    """Built twice, a loader gives the same batches, whatever the process-wide random generators
    hold and whether its state is read between steps. (memmap: the same for every layout with the
    same global batch too, see test_memmap_global_batch_is_layout_invariant; a jsonl stream is
    per data-parallel rank by design.)"""
    if fmt == "memmap":
        args = margs(small, batch_size=2, grad_accum=2)
    else:
        write_chunks(tmp_path / "root" / "a", "A", n_files=2, lines_per_file=9)
        write_chunks(tmp_path / "root" / "b", "B", n_files=1, lines_per_file=6)
        args = jargs(tmp_path / "root", sources={"a": 0.7, "b": 0.3}, batch_size=2, grad_accum=2)
    for dp in (1, 2):
        ref, _ = global_step(args, dp, seed=3, steps=6)
        random.seed(11)
        np.random.seed(11)
        torch.manual_seed(11)
        loaders = [build_train_loader(args, r, dp, seed=3) for r in range(dp)]
        again = []
        for _ in range(6):
            random.random(), np.random.rand(), torch.rand(3)
            [loader.state_dict() for loader in loaders]
            again += global_step(None, dp, steps=1, loaders=loaders)[0]
        assert_steps_equal(again, ref)
        other, _ = global_step(args, dp, seed=4, steps=6)
        assert not all(torch.equal(x[0], y[0]) for x, y in zip(other, ref))


@pytest.mark.slow
def test_same_seed_same_losses_in_two_processes(corpus, tmp_path):
    """Two runs of `python -m apps.llama.train` with the same seed and layout, fp32 on CPU: the
    same losses, bit for bit. (The same for a jsonl run, on a corpus full of bad lines, in
    test_bad_data.py.)"""
    from tests.equivalence import assert_equivalent

    for name in ("one", "two"):
        run_python("apps.llama.train", tiny_args(corpus, tmp_path / name))
    assert [r["step"] for r in read_metrics(tmp_path / "one")] == [1, 2, 3, 4, 5]
    assert_equivalent(tmp_path / "two", tmp_path / "one", rtol=0)  # final weights included


# ------------------------------------------------------------------------------------------------
# memmap: what the samples are


def window_index(raw, seq_len):
    """tokens of window w (as bytes) -> w, for the windows of seq_len+1 tokens at w*seq_len."""
    n = (len(raw) - 1) // seq_len
    index = {raw[w * seq_len:w * seq_len + seq_len].tobytes(): w for w in range(n)}
    assert len(index) == n, "test corpus windows must be distinct"
    return index, n


def test_memmap_rows_match_raw_tokens_and_epochs(small):
    seq_len = 8
    raw = raw_tokens(small)
    index, n = window_index(raw, seq_len)
    doc_ref = np.cumsum(raw == BOS) - 1  # document of each position: count of BOS so far
    assert raw[0] == BOS and doc_ref[-1] == 59
    loader = MemmapLoader(margs(small, batch_size=5, grad_accum=2), 0, 1, seed=3)
    seen = []
    while len(seen) < 2 * n + 5:
        for batch in loader.next_step():
            for tokens, labels, docs in zip(batch.tokens.numpy(), batch.labels.numpy(),
                                            batch.doc_ids.numpy()):
                w = index[tokens.tobytes()]
                start = w * seq_len
                assert np.array_equal(tokens, raw[start:start + seq_len])
                assert np.array_equal(labels, raw[start + 1:start + seq_len + 1])
                assert np.array_equal(labels[:-1], tokens[1:])
                assert np.array_equal(docs, doc_ref[start:start + seq_len])
                # a document change happens exactly where a BOS token starts one
                assert np.array_equal(np.diff(docs) != 0, tokens[1:] == BOS)
                assert np.all(np.diff(docs) >= 0)
                seen.append(w)
    epoch1, epoch2, epoch3 = seen[:n], seen[n:2 * n], seen[2 * n:]
    assert sorted(epoch1) == list(range(n)) and sorted(epoch2) == list(range(n))
    assert epoch1 != epoch2 and epoch1 != list(range(n))
    assert epoch3 != epoch2[:len(epoch3)]
    assert n % 10 != 0  # so an epoch ends inside a step, and the next step spans two epochs
    assert loader.state_dict()["samples_consumed"] == len(seen)


def test_memmap_doc_ids_on_embedded_corpus(corpus):
    loader = MemmapLoader(margs(corpus, seq_len=256, batch_size=16), 0, 1, seed=0)
    batch = loader.next_step()[0]
    assert torch.equal(batch.labels[:, :-1], batch.tokens[:, 1:])
    changes = batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1]
    assert torch.equal(changes, batch.tokens[:, 1:] == BOS)
    assert changes.any()  # docstrings are shorter than 16 windows of 256 bytes
    assert int(batch.tokens.max()) <= EOS and int(batch.tokens.min()) >= 0


# ------------------------------------------------------------------------------------------------
# memmap: validation data and validation errors


@pytest.mark.parametrize("val_sequences", [8, 10])
def test_memmap_val_batches_same_for_every_layout(small, val_sequences):
    seq_len = 8
    raw = raw_tokens(small, "val")
    n_windows = (len(raw) - 1) // seq_len
    assert n_windows >= 12
    for dp in (1, 2, 4):
        args = margs(small, batch_size=3, val_sequences=val_sequences)
        per_rank = [build_val_batches(args, r, dp) for r in range(dp)]
        counts = [sum(b.tokens.shape[0] for b in batches) for batches in per_rank]
        n = (val_sequences // dp) * dp
        assert counts == [n // dp] * dp
        assert len({len(batches) for batches in per_rank}) == 1  # same number of batches
        assert all(b.tokens.shape[0] <= 3 for batches in per_rank for b in batches)
        tokens = torch.cat([b.tokens for batches in per_rank for b in batches]).numpy()
        labels = torch.cat([b.labels for batches in per_rank for b in batches]).numpy()
        # the first n windows in order, whatever the layout
        ref = np.stack([raw[w * seq_len:w * seq_len + seq_len + 1] for w in range(n)])
        assert np.array_equal(tokens, ref[:, :-1]) and np.array_equal(labels, ref[:, 1:])
    assert build_val_batches(margs(small, val_sequences=0), 0, 1) == []


def test_fewer_validation_sequences_than_ranks_validate_one_a_rank(small, caplog):
    """Not an empty share (val_loss NaN): one sequence a rank, said once (by rank 0); a
    validation set smaller than that is refused with the fix."""
    args = margs(small, batch_size=3, val_sequences=2)
    with caplog.at_level("WARNING"):
        per_rank = [build_val_batches(args, r, 4) for r in range(4)]
    assert [sum(b.tokens.shape[0] for b in batches) for batches in per_rank] == [1] * 4
    assert caplog.text.count("data.val_sequences=2 is fewer than the 4 data-parallel ranks") == 1
    windows = (len(raw_tokens(small, "val")) - 1) // 8
    with pytest.raises(ConfigError, match="fewer validation sequences of data.seq_len=8 tokens "
                                          f"than the {windows + 1} data-parallel ranks"):
        build_val_batches(args, 0, windows + 1)


def test_validate_memmap_accepts_a_good_corpus(small, corpus):
    validate_data_args(margs(small, val_sequences=4))
    validate_data_args(margs(corpus, seq_len=64, val_sequences=8))


def test_validate_truncated_train_bin(small, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(small, root)
    train = root / "train.bin"
    train.write_bytes(train.read_bytes()[:-10])
    with pytest.raises(ConfigError) as err:
        validate_data_args(margs(root))
    assert str(train) in str(err.value) and "truncated" in str(err.value)
    with pytest.raises(ConfigError, match="train.bin"):
        MemmapLoader(margs(root), 0, 1, seed=0)
    train.unlink()
    with pytest.raises(ConfigError, match="train.bin"):
        validate_data_args(margs(root))


def test_validate_tokenizer_mismatch(small, tmp_path):
    tok_file = tmp_path / "tokenizer.json"
    tok_file.write_text("{}")  # exists: the mismatch is caught before any file is parsed
    with pytest.raises(ConfigError, match="bytes") as err:
        validate_data_args(margs(small, tokenizer=TokenizerArgs("hf", str(tok_file))))
    assert "hf" in str(err.value)


def write_ranks(path, merges):
    """A tiktoken ranks file: the 256 single bytes then `merges`."""
    import base64

    tokens = [bytes([i]) for i in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


def test_validate_same_kind_other_vocabulary(tmp_path):
    from lingua.data.tokenizer import build_tokenizer

    used = TokenizerArgs("tiktoken", str(write_ranks(tmp_path / "a.tiktoken", [b"th", b"the"])))
    root = tmp_path / "corpus"
    write_memmap_corpus(root, {"train": iter(random_docs(40, 1)), "val": iter(random_docs(9, 2))},
                        build_tokenizer(used), used, source="test")
    assert json.loads((root / "meta.json").read_text())["vocab_size"] == 256 + 2 + 2
    validate_data_args(margs(root, tokenizer=used, val_sequences=2))
    other = write_ranks(tmp_path / "b.tiktoken", [b"th"])
    with pytest.raises(ConfigError, match="vocabulary") as err:
        validate_data_args(margs(root, tokenizer=TokenizerArgs("tiktoken", str(other))))
    assert str(other) in str(err.value) and "260" in str(err.value)


def test_validate_missing_and_empty_dir(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=str(missing)):
        validate_data_args(margs(missing))
    # a missing embedded corpus is fine when it will be built on first use
    validate_data_args(dataclasses.replace(margs(missing), prepare_embedded=True))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="empty"):
        validate_data_args(margs(empty))
    with pytest.raises(ConfigError, match="meta.json"):
        MemmapLoader(margs(empty), 0, 1, seed=0)
    (empty / "junk.txt").write_text("x")
    with pytest.raises(ConfigError, match="meta.json"):
        validate_data_args(margs(empty))


def test_validate_seq_len_longer_than_split(small):
    with pytest.raises(ConfigError, match="seq_len"):
        validate_data_args(margs(small, seq_len=10 ** 6))


# ------------------------------------------------------------------------------------------------
# jsonl stream


def write_chunks(directory, prefix, n_files, lines_per_file, bad=()):
    """Chunk files with numbered texts; `bad` lines (raw bytes) are appended to the first file."""
    directory.mkdir(parents=True, exist_ok=True)
    texts = []
    for f in range(n_files):
        with open(directory / f"{prefix}.chunk.{f:02d}.jsonl", "wb") as out:
            for i in range(lines_per_file):
                text = f"{prefix} f{f} l{i} ünï"
                texts.append(text)
                out.write(json.dumps({"text": text, "id": len(texts)}).encode() + b"\n")
            if f == 0:
                out.writelines(raw + b"\n" for raw in bad)
    return texts


def jargs(root, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("batch_size", 2)
    kw.setdefault("val_sequences", 0)
    return DataArgs(root=str(root), format="jsonl", **kw)


def stream_docs(loader, n_docs):
    """Read steps until n_docs complete documents came out; decode them (bytes tokenizer)."""
    stream = []
    while stream.count(EOS) < n_docs:
        for b in loader.next_step():
            rows = torch.cat([b.tokens[:, :1], b.labels], dim=1)  # rows are back to back
            assert torch.equal(b.labels[:, :-1], b.tokens[:, 1:])
            stream += rows.flatten().tolist()
    docs, current = [], None
    for t in stream:
        if t == BOS:
            current = []
        elif t == EOS:
            docs.append(bytes(current).decode("utf-8"))
            current = None
        else:
            current.append(t)
    return docs[:n_docs]


BAD_LINES = [b'{"text": "broken', b'{"txt": "no text field"}', b'{"text": 42}',
             b'{"text": "\xff\xfe"}', b"\xff\xfe", b'["text"]']


@pytest.mark.parametrize("dp", [2, 4])
def test_jsonl_every_line_once_per_epoch(tmp_path, dp):
    texts = write_chunks(tmp_path / "src", "doc", n_files=3, lines_per_file=7, bad=BAD_LINES)
    # 21 good lines + 6 bad ones; a blank line in the middle of a file is skipped, not counted
    with open(tmp_path / "src" / "doc.chunk.01.jsonl", "ab") as f:
        f.write(b"\n" + json.dumps({"text": "after blank"}).encode() + b"\n")
    texts.insert(14, "after blank")  # after file 1's lines, before file 2's
    counters = [SkipCounter(SKIP_REASONS) for _ in range(dp)]
    sources = [JsonlSource("", tmp_path / "src", r, dp, counters[r]) for r in range(dp)]
    per_rank = []
    for source in sources:
        got = []
        while True:
            text = source.next_text()
            if source.state["epoch"] > 0:
                break
            got.append(text)
        per_rank.append((got, text))
    everything = [t for got, _ in per_rank for t in got]
    assert sorted(everything) == sorted(texts) and len(everything) == len(texts)
    assert sum(c.count for c in counters) == len(BAD_LINES)
    # epoch 2 starts again with each rank's first line
    assert all(first == got[0] for got, first in per_rank)
    # the loader gives the same documents in the same order, packed into rows
    for r in range(dp):
        loader = JsonlLoader(jargs(tmp_path / "src"), r, dp, seed=0)
        assert stream_docs(loader, len(per_rank[r][0])) == per_rank[r][0]
        assert sum(loader.skipped().values()) == counters[r].count


def test_jsonl_malformed_lines_are_counted_and_good_lines_used(tmp_path):
    texts = write_chunks(tmp_path / "src", "doc", n_files=1, lines_per_file=3, bad=BAD_LINES)
    with open(tmp_path / "src" / "doc.chunk.00.jsonl", "ab") as f:
        f.write(json.dumps({"text": "last good"}).encode() + b"\n")
    loader = JsonlLoader(jargs(tmp_path / "src"), 0, 1, seed=0)
    assert stream_docs(loader, 4) == texts + ["last good"]
    assert sum(loader.skipped().values()) == len(BAD_LINES)
    assert loader.state_dict()["skipped_lines"] == len(BAD_LINES)


def test_jsonl_source_weights(tmp_path):
    write_chunks(tmp_path / "root" / "big", "A", n_files=2, lines_per_file=50)
    write_chunks(tmp_path / "root" / "small", "B", n_files=1, lines_per_file=30)
    args = jargs(tmp_path / "root", sources={"big": 0.8, "small": 0.2}, seq_len=63, batch_size=8)
    validate_data_args(args)
    docs = stream_docs(JsonlLoader(args, 0, 1, seed=0), 2000)
    assert len(docs) == 2000 and all(d[0] in "AB" for d in docs)
    frac = sum(d.startswith("A") for d in docs) / len(docs)
    assert abs(frac - 0.8) < 0.04, frac  # binomial sd is 0.009
    # and without weights every source counts the same
    args = jargs(tmp_path / "root", seq_len=63, batch_size=8)
    docs = stream_docs(JsonlLoader(args, 0, 1, seed=0), 1000)
    frac = sum(d.startswith("A") for d in docs) / len(docs)
    assert abs(frac - 0.5) < 0.06, frac


def test_jsonl_exact_resume(tmp_path):
    write_chunks(tmp_path / "root" / "a", "A", n_files=2, lines_per_file=9, bad=BAD_LINES[:2])
    write_chunks(tmp_path / "root" / "b", "B", n_files=1, lines_per_file=5)
    args = jargs(tmp_path / "root", sources={"a": 0.6, "b": 0.4}, seq_len=24, batch_size=3,
                 grad_accum=2)
    for rank in range(2):
        ref = JsonlLoader(args, rank, 2, seed=5)
        ref_steps, _ = global_step(None, 1, steps=6, loaders=[ref])
        first = JsonlLoader(args, rank, 2, seed=5)
        got, _ = global_step(None, 1, steps=3, loaders=[first])
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
        resumed = JsonlLoader(args, rank, 2, seed=5)
        resumed.load_state_dict(state)
        assert sum(resumed.skipped().values()) == sum(first.skipped().values())
        rest, _ = global_step(None, 1, steps=3, loaders=[resumed])
        assert_steps_equal(got + rest, ref_steps)
        # a state from another layout (or another rank) is refused
        for dp_rank, dp_size in ((rank, 4), (1 - rank, 2), (0, 1)):
            with pytest.raises(ConfigError, match="layout"):
                JsonlLoader(args, dp_rank, dp_size, seed=5).load_state_dict(state)
    with pytest.raises(ConfigError):
        JsonlLoader(args, 0, 1, seed=5).load_state_dict(
            {"format": "memmap", "samples_consumed": 0, "seq_len": 24, "seed": 5})


def test_jsonl_validation_data(tmp_path):
    root = tmp_path / "root"
    write_chunks(root / "train", "T", n_files=2, lines_per_file=5)
    val_texts = write_chunks(root / "val", "V", n_files=2, lines_per_file=6)
    args = jargs(root, seq_len=16, batch_size=2, val_sequences=8)
    validate_data_args(args)
    # train never reads the val directory
    assert all(d.startswith("T") for d in stream_docs(JsonlLoader(args, 0, 1, seed=0), 20))
    # the reference: val texts packed back to back into rows of seq_len+1
    stream = [t for text in val_texts for t in ByteTokenizer().encode(text)]
    rows = torch.tensor(stream[:8 * 17]).reshape(8, 17)
    for dp in (1, 2, 4):
        per_rank = [build_val_batches(args, r, dp) for r in range(dp)]
        assert len({sum(len(b.tokens) for b in bs) for bs in per_rank}) == 1
        tokens = torch.cat([b.tokens for bs in per_rank for b in bs])
        labels = torch.cat([b.labels for bs in per_rank for b in bs])
        assert torch.equal(tokens, rows[:, :-1]) and torch.equal(labels, rows[:, 1:])


def test_jsonl_validate_errors(tmp_path):
    root = tmp_path / "root"
    write_chunks(root, "T", n_files=1, lines_per_file=3)
    with pytest.raises(ConfigError, match="val"):
        validate_data_args(jargs(root, val_sequences=4))
    validate_data_args(jargs(root, val_sequences=0))
    with pytest.raises(ConfigError, match="nosuch"):
        validate_data_args(jargs(tmp_path, sources={"nosuch": 1.0}))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ConfigError, match="jsonl"):
        validate_data_args(jargs(tmp_path / "emptydir"))
    with pytest.raises(ConfigError, match="format"):
        validate_data_args(DataArgs(root=str(root), format="arrow"))


# ------------------------------------------------------------------------------------------------
# setup/prepare_data.py


@pytest.fixture(scope="module")
def prepare_data():
    return load_prepare_data()


def test_prepare_jsonl_with_val_dir(tmp_path, prepare_data, capsys):
    src = tmp_path / "src"
    train_texts = write_chunks(src, "doc", n_files=2, lines_per_file=20, bad=BAD_LINES)
    val_texts = write_chunks(src / "val", "val", n_files=1, lines_per_file=10, bad=BAD_LINES[:1])
    out = tmp_path / "out"
    assert prepare_data.main(["jsonl", str(src), "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped_lines"] == len(BAD_LINES) + 1
    tok = ByteTokenizer()
    for split, texts in (("train", train_texts), ("val", val_texts)):
        ref = [t for text in texts for t in tok.encode(text)]
        assert meta["splits"][split] == {"tokens": len(ref), "docs": len(texts)}
        assert raw_tokens(out, split).tolist() == ref
        starts = np.load(out / f"{split}.docs.npy")
        assert np.array_equal(starts, np.cumsum([0] + [len(tok.encode(t)) for t in texts])[:-1])
    # readable by the loader
    args = margs(out, seq_len=16, batch_size=4, val_sequences=4)
    validate_data_args(args)
    batch = MemmapLoader(args, 0, 1, seed=0).next_step()[0]
    assert batch.tokens.shape == (4, 16)
    assert len(build_val_batches(args, 0, 1)) == 1


def test_prepare_jsonl_val_fraction(tmp_path, prepare_data, capsys):
    src = tmp_path / "src"
    texts = write_chunks(src, "doc", n_files=1, lines_per_file=30, bad=BAD_LINES)
    out = tmp_path / "out"
    assert prepare_data.main(["jsonl", str(src / "doc.chunk.00.jsonl"), "--out", str(out),
                              "--val-fraction", "0.25"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped_lines"] == len(BAD_LINES)  # counted once, not once per split
    tok = ByteTokenizer()
    val, train = texts[::4], [t for i, t in enumerate(texts) if i % 4]
    for split, ref_texts in (("train", train), ("val", val)):
        assert raw_tokens(out, split).tolist() == [t for x in ref_texts for t in tok.encode(x)]
        assert meta["splits"][split]["docs"] == len(ref_texts)


def test_prepare_jsonl_val_means_a_directory_inside_the_input(tmp_path, prepare_data, capsys):
    # an ancestor directory named val/ does not make every file a validation file
    src = tmp_path / "val" / "corpus"
    texts = write_chunks(src, "doc", n_files=1, lines_per_file=4)
    held_out = write_chunks(src / "val", "held", n_files=1, lines_per_file=2)
    out = tmp_path / "out"
    assert prepare_data.main(["jsonl", str(src), "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["docs"] == len(texts)
    assert meta["splits"]["val"]["docs"] == len(held_out)
    # files given one by one: those in a val/ directory are the validation split
    out2 = tmp_path / "out2"
    assert prepare_data.main(["jsonl", str(src / "doc.chunk.00.jsonl"),
                              str(src / "val" / "held.chunk.00.jsonl"), "--out", str(out2)]) == 0
    assert raw_tokens(out2).tolist() == raw_tokens(out).tolist()
    assert raw_tokens(out2, "val").tolist() == raw_tokens(out, "val").tolist()


def test_empty_split_is_a_config_error(tmp_path, prepare_data, capsys):
    src = tmp_path / "src"
    write_chunks(src / "val", "held", n_files=1, lines_per_file=2)
    write_chunks(src, "empty", n_files=1, lines_per_file=0)
    out = tmp_path / "out"
    assert prepare_data.main(["jsonl", str(src), "--out", str(out)]) == 0
    assert json.loads((out / "meta.json").read_text())["splits"]["train"]["tokens"] == 0
    with pytest.raises(ConfigError, match="train split"):
        validate_data_args(margs(out, val_sequences=1))


def test_prepare_jsonl_errors(tmp_path, prepare_data, capsys):
    assert prepare_data.main(["jsonl", str(tmp_path / "none.jsonl"), "--out",
                              str(tmp_path / "o")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_embedded_corpus_is_deterministic(corpus, tmp_path, prepare_data, capsys):
    out = tmp_path / "again"
    assert prepare_data.main(["embedded", "--out", str(out)]) == 0
    for name in ("train.bin", "val.bin", "train.docs.npy", "val.docs.npy", "meta.json"):
        assert (out / name).read_bytes() == (corpus / name).read_bytes(), name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "bytes" and meta["splits"]["train"]["tokens"] > 100_000
    raw = raw_tokens(out)
    starts = np.load(out / "train.docs.npy")
    assert np.array_equal(np.flatnonzero(raw == BOS), starts)
    assert np.array_equal(np.flatnonzero(raw == EOS), np.append(starts[1:], len(raw)) - 1)
    # a second call leaves the prepared corpus alone
    before = (out / "train.bin").stat().st_mtime_ns
    assert prepare_data.main(["embedded", "--out", str(out)]) == 0
    assert (out / "train.bin").stat().st_mtime_ns == before


def test_ensure_embedded_corpus_loses_a_race_cleanly(tmp_path, monkeypatch):
    import lingua.data as data

    root = tmp_path / "data" / "embedded"

    def build_while_another_process_wins(out):
        # the other process finishes its build and renames it into place while we write ours
        meta = write_memmap_corpus(out, {"train": iter(["ours"]), "val": iter(["x"])},
                                   ByteTokenizer(), TokenizerArgs(), source="loser")
        write_memmap_corpus(root, {"train": iter(["theirs"]), "val": iter(["y"])},
                            ByteTokenizer(), TokenizerArgs(), source="winner")
        return meta

    monkeypatch.setattr(data, "build_embedded_corpus", build_while_another_process_wins)
    assert data.ensure_embedded_corpus(root) == root
    assert json.loads((root / "meta.json").read_text())["source"] == "winner"
    assert sorted(p.name for p in root.parent.iterdir()) == ["embedded"]  # no temporary left
    # a path that exists but is no corpus is an error naming it, not a silent success
    junk = tmp_path / "junk"
    (junk / "sub").mkdir(parents=True)
    monkeypatch.setattr(data, "build_embedded_corpus",
                        lambda out: write_memmap_corpus(out, {"train": iter(["a"])},
                                                        ByteTokenizer(), TokenizerArgs(), "t"))
    with pytest.raises(ConfigError, match=str(junk)):
        data.ensure_embedded_corpus(junk)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "junk"]


def test_write_once_leaves_nothing_behind_when_writing_fails(tmp_path):
    """A failure inside `write` (a full disk, Ctrl-C) is raised as it is, and neither the
    directory nor its temporary is left: the next call starts afresh."""
    from lingua.data.batch import write_once

    def fail(tmp):
        (tmp / "half").mkdir(parents=True)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_once(tmp_path / "out", "done", fail, "the test directory")
    assert list(tmp_path.iterdir()) == []
    made = write_once(tmp_path / "out", "done",
                      lambda tmp: tmp.mkdir() or (tmp / "done").write_text("x") and "made", "t")
    assert made == "made" and (tmp_path / "out" / "done").is_file()
    assert write_once(tmp_path / "out", "done", fail, "t") is None   # there: not written again


def test_the_corpus_finds_every_def_in_ast_walks_order():
    """The embedded corpus walks statements only; ast.walk over a tree with defs nested in every
    kind of statement list gives the same defs in the same order."""
    import ast

    from lingua.data.batch import statements

    source = '''
def a():
    if x:
        def b(): pass
    else:
        class C:
            def d(self): pass
try:
    def e(): pass
except E:
    def f(): pass
else:
    def g(): pass
finally:
    async def h(): pass
match x:
    case 1:
        def i(): pass
for y in z:
    def j(): pass
with w:
    def k(): pass
'''
    tree = ast.parse(source)
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    names = [node.name for node in statements(tree) if isinstance(node, defs)]
    assert names == [node.name for node in ast.walk(tree) if isinstance(node, defs)]
    assert sorted(names) == sorted("abCdefghijk")
