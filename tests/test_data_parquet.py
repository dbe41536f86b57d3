"""data.format=parquet (lingua/data/parquet.py): the same rows as jsonl over the same texts (the
reference: the jsonl loader, reading the same documents written as jsonl lines), the same rank
shares, bad-row rule and validation split, and exact resume, in the loader and through the
trainer."""

import json
import shutil
import sys

import pytest

from apps.llama import train
from lingua.data import DataArgs, build_val_batches, validate_data_args
from lingua.data.jsonl import SKIP_REASONS, SkipCounter
from lingua.data.parquet import ParquetLoader, ParquetSource
from lingua.errors import ConfigError
from tests.conftest import tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows
from tests.test_data import assert_steps_equal, global_step

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def write_both(path, values, twin=None, row_group_size=4):
    """`values` (None: a null row) as the parquet file `path` (small row groups, so that reads
    cross them) and, where `twin` is given, as the jsonl file `twin`: the reference."""
    path.parent.mkdir(parents=True, exist_ok=True)
    column = pa.array(values, pa.string())
    pq.write_table(pa.table({"id": list(range(len(values))), "text": column}), path,
                   row_group_size=row_group_size)
    if twin is not None:
        twin.parent.mkdir(parents=True, exist_ok=True)
        twin.write_text("".join(json.dumps({"text": v}) + "\n" for v in values))


def texts(prefix, n, bad_every=0):
    """n numbered documents of varied length; with bad_every, every bad_every-th is null or ""."""
    out = [f"{prefix} {i} " + "ünï " * (i % 7) for i in range(n)]
    for i in range(0, n, bad_every or n + 1):
        out[i] = None if i % 2 else ""
    return out


@pytest.fixture
def twin_corpus(tmp_path):
    """Two weighted sources (of two files and of one), bad rows among them, and a val/ split, as
    parquet under tmp_path/pq and as jsonl under tmp_path/js."""
    pq_root, js_root = tmp_path / "pq", tmp_path / "js"
    for name in ("a/a0", "a/a1", "b/b0", "val/v0"):
        values = texts(name[-2:], 30, bad_every=7) if name.startswith("val") else \
            texts(name[-2:], 13, bad_every=5)
        write_both(pq_root / f"{name}.parquet", values, js_root / f"{name}.jsonl")
    return pq_root, js_root


def args_for(root, fmt, **kw):
    kw = {"seq_len": 16, "batch_size": 2, "grad_accum": 2, "val_sequences": 6,
          "sources": {"a": 0.7, "b": 0.3}, **kw}
    return DataArgs(root=str(root), format=fmt, **kw)


@pytest.mark.parametrize("dp", [1, 2])
def test_parquet_rows_are_the_jsonl_rows_of_the_same_texts(twin_corpus, dp):
    pq_root, js_root = twin_corpus
    got_args, ref_args = args_for(pq_root, "parquet"), args_for(js_root, "jsonl")
    validate_data_args(got_args)
    # 20 steps of 4 rows of 17 tokens a rank: more than an epoch of each source
    got, got_loaders = global_step(got_args, dp, seed=3, steps=20)
    ref, ref_loaders = global_step(ref_args, dp, seed=3, steps=20)
    assert_steps_equal(got, ref)
    for g, r in zip(got_loaders, ref_loaders):
        assert g.skipped() == r.skipped() and sum(g.skipped().values()) > 0
    assert sum(sum(g.skipped().values()) for g in got_loaders) == 3 * 3   # each bad row once
    for rank in range(dp):
        got_val, ref_val = build_val_batches(got_args, rank, dp), build_val_batches(ref_args, rank,
                                                                                    dp)
        assert got_val and len(got_val) == len(ref_val)
        for g, r in zip(got_val, ref_val):
            assert g.tokens.equal(r.tokens) and g.labels.equal(r.labels) and \
                g.doc_ids.equal(r.doc_ids)


def one_epoch(source):
    got = []
    while True:
        text = source.next_text()
        if source.state["epoch"] > 0:
            return got
        got.append(text)


def test_two_ranks_read_disjoint_rows_covering_one_rank(twin_corpus):
    pq_root, _ = twin_corpus
    one = one_epoch(ParquetSource("a", pq_root / "a", 0, 1, SkipCounter(SKIP_REASONS)))
    assert one == [t for t in texts("a0", 13, 5) + texts("a1", 13, 5) if t]   # in name order
    counters = [SkipCounter(SKIP_REASONS) for _ in range(2)]
    ranks = [one_epoch(ParquetSource("a", pq_root / "a", r, 2, counters[r])) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == sorted(one) and not set(ranks[0]) & set(ranks[1])
    # rank r: rows r, r + 2, ... of the files concatenated (13 rows: file a1 starts at row 13)
    rows = texts("a0", 13, 5) + texts("a1", 13, 5)
    assert ranks[1] == [t for t in rows[1::2] if t]
    assert sum(c.count for c in counters) == 6


def test_bad_rows_are_counted_by_reason_and_too_many_refused(tmp_path, caplog):
    write_both(tmp_path / "pq" / "x.parquet", ["fine", None, "", "also fine"])
    source = ParquetSource("", tmp_path / "pq", 0, 1, SkipCounter(SKIP_REASONS))
    assert one_epoch(source) == ["fine", "also fine"]
    assert source.counter.nonzero == {"no_text": 1, "empty": 1}
    assert f"skipping unusable line 2 of {tmp_path / 'pq' / 'x.parquet'} (no_text" in caplog.text
    write_both(tmp_path / "many" / "x.parquet", [None] * 20 + ["text"] * 100)
    loader = ParquetLoader(DataArgs(root=str(tmp_path / "many"), format="parquet", seq_len=16,
                                    max_skipped_fraction=0.1), 0, 1, seed=0)
    with pytest.raises(ConfigError, match="max_skipped_fraction"):
        for _ in range(100):
            loader.next_step()


def test_parquet_loader_resumes_exactly(twin_corpus):
    args = args_for(twin_corpus[0], "parquet")
    for rank in range(2):
        straight, _ = global_step(args, 1, steps=6, loaders=[ParquetLoader(args, rank, 2, 5)])
        first = ParquetLoader(args, rank, 2, 5)
        got, _ = global_step(args, 1, steps=3, loaders=[first])
        resumed = ParquetLoader(args, rank, 2, 5)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert resumed.skipped() == first.skipped()
        rest, _ = global_step(args, 1, steps=3, loaders=[resumed])
        assert_steps_equal(got + rest, straight)


def test_checks_name_the_problem(tmp_path, monkeypatch):
    write_both(tmp_path / "pq" / "x.parquet", ["a", "b"])
    (tmp_path / "pq" / "junk.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match="junk.parquet is not a parquet file"):
        validate_data_args(DataArgs(root=str(tmp_path / "pq"), format="parquet", val_sequences=0))
    (tmp_path / "pq" / "junk.parquet").unlink()
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "pq" / "other.parquet")
    with pytest.raises(ConfigError, match=r'other.parquet has no "text" column'):
        validate_data_args(DataArgs(root=str(tmp_path / "pq"), format="parquet", val_sequences=0))
    with pytest.raises(ConfigError, match=r"val holds no \*.parquet"):
        validate_data_args(DataArgs(root=str(tmp_path / "pq"), format="parquet"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)   # as if not installed
    with pytest.raises(ConfigError, match="pip install pyarrow"):
        validate_data_args(DataArgs(root=str(tmp_path / "pq"), format="parquet", val_sequences=0))


def test_trainer_resumes_a_parquet_run_bit_exactly(tmp_path, capfd):
    docs = [f"document {i}: " + "the quick brown fox " * (1 + i % 9) for i in range(120)]
    write_both(tmp_path / "corpus" / "train.parquet", docs[:100], row_group_size=16)
    write_both(tmp_path / "corpus" / "val" / "val.parquet", docs[100:])
    dump, straight = tmp_path / "run", tmp_path / "straight"
    args = tiny_args(tmp_path / "corpus", dump, "data.format=parquet", "checkpoint.every=2",
                     "checkpoint.keep=0", steps=4)
    assert train.main(args) == 0
    shutil.copytree(dump, straight)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / "4")   # as if it died after step 2's checkpoint
    capfd.readouterr()
    assert train.main(args) == 0
    assert_resumed(dump, "".join(capfd.readouterr()), 2, first)
    assert_equivalent(dump, straight, rtol=0)   # bit-identical losses and final weights
