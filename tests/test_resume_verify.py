"""Resume verifies the newest checkpoint with every rank reading its share of the files (not rank 0
alone reading all of it while the others wait under the collective timeout), and all ranks agree
on the checkpoint they resume from."""

import builtins
import io
import json
import os
import threading
from pathlib import Path

import pytest

from apps.llama import train
from lingua import checkpoint
from lingua.checkpoint import integrity
from tests.conftest import run_torchrun, tiny_args


def fake_checkpoint(dump, step: int, saved_ranks: int = 2):
    """A checkpoint directory with the files a `saved_ranks`-rank save writes, and its manifest."""
    ckpt = checkpoint.checkpoints_dir(dump) / str(step)
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(os.urandom(300))
    (ckpt / "config.yaml").write_text("steps: 10\n")
    for r in range(saved_ranks):
        (ckpt / f"__{r}_0.distcp").write_bytes(os.urandom(4000 + 1000 * r))
        (ckpt / f"train_state_rank{r}.pt").write_bytes(os.urandom(200))
    integrity.write_manifest(ckpt)
    return ckpt


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def manifest_of(ckpt) -> dict:
    return json.loads((ckpt / integrity.MANIFEST).read_text())["files"]


@pytest.mark.parametrize("saved_ranks", [1, 3, 4, 8])
def test_the_checksum_shares_cover_every_file_exactly_once(tmp_path, saved_ranks):
    files = manifest_of(fake_checkpoint(tmp_path, 1, saved_ranks))
    total, largest = sum(f["size"] for f in files.values()), max(f["size"] for f in files.values())
    for world_size in range(1, 6):
        shares = [integrity.crc_share(files, r, world_size) for r in range(world_size)]
        names = [name for share in shares for name in share]
        assert sorted(names) == sorted(files), (world_size, shares)
        # Balanced by bytes: no rank reads more than its part plus one file.
        assert max(sum(files[n]["size"] for n in share) for share in shares) <= (
            total / world_size + largest)


def test_each_damaged_file_is_found_by_exactly_one_rank(tmp_path):
    ckpt = fake_checkpoint(tmp_path, 4, saved_ranks=3)
    files = manifest_of(ckpt)
    for name in sorted(files):
        flip_a_byte(ckpt / name)
        found = [r for r in range(3) if integrity.verify_share(ckpt, r, 3) is not None]
        owner = [r for r in range(3) if name in integrity.crc_share(files, r, 3)]
        assert found == owner and len(owner) == 1, name
        assert name in integrity.verify_share(ckpt, owner[0], 3)
        flip_a_byte(ckpt / name)  # back


def test_sizes_are_checked_by_the_rank_whose_share_the_file_is(tmp_path):
    """Not by every rank: at 1,000 ranks that is a stat of every file by each (a metadata
    storm). Together the ranks still check every file's size."""
    ckpt = fake_checkpoint(tmp_path, 4)
    files = manifest_of(ckpt)
    with open(ckpt / "__1_0.distcp", "r+b") as f:
        f.truncate(10)
    found = [r for r in range(3) if integrity.verify_share(ckpt, r, 3) is not None]
    assert found == [r for r in range(3)
                     if "__1_0.distcp" in integrity.crc_share(files, r, 3)]
    assert "__1_0.distcp has 10 bytes" in integrity.verify_share(ckpt, found[0], 3)
    (ckpt / "__1_0.distcp").unlink()
    assert "__1_0.distcp is missing" in integrity.verify_share(ckpt, found[0], 3)
    (ckpt / integrity.MANIFEST).unlink()
    assert all("manifest.json is missing" in integrity.verify_share(ckpt, r, 3)
               for r in range(3))


def test_a_read_error_is_damage_not_a_crash(tmp_path, monkeypatch):
    """A rank that raised instead of answering would leave the others waiting in the agreement."""
    ckpt = fake_checkpoint(tmp_path, 4)

    def failing(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(integrity, "crc32", failing)
    assert "cannot be read" in integrity.verify_share(ckpt, 0, 1)
    assert "cannot be read" in integrity.verify(ckpt)


def test_one_process_walks_back_to_the_newest_intact_checkpoint(tmp_path, caplog):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    newest = fake_checkpoint(tmp_path, 6)
    (newest.parent / "8.tmp-abcd").mkdir()   # an unfinished save is no candidate
    assert checkpoint.newest_verified(tmp_path) == newest
    flip_a_byte(newest / "__0_0.distcp")
    flip_a_byte(newest.parent / "4" / ".metadata")
    assert checkpoint.newest_verified(tmp_path) == newest.parent / "2"
    assert (f"skipping damaged checkpoint {newest}: {newest / '__0_0.distcp'} is damaged"
            in caplog.text)
    assert f"{newest.parent / '4' / '.metadata'} is damaged" in caplog.text
    assert checkpoint.newest_verified(tmp_path / "nothing") is None
    assert sorted(p.name for p in newest.parent.iterdir()) == ["2", "4", "6", "8.tmp-abcd"]


def test_pruning_counts_intact_checkpoints_only(tmp_path, caplog):
    """A checkpoint damaged since resume is moved aside by the next save's pruning and not
    counted by `keep`; one damaged again at the same step gets a name of its own."""
    root = checkpoint.checkpoints_dir(tmp_path)
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    (root / "4.damaged").mkdir()
    with open(root / "4" / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    integrity.prune(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["2", "4.damaged", "4.damaged-2", "6"]
    assert f"damaged checkpoint {root / '4'}: {root / '4' / '__0_0.distcp'} has 10" in caplog.text
    assert [p.name for p in checkpoint.list_complete(tmp_path)] == ["2", "6"]


@pytest.mark.distributed
def test_two_ranks_skip_a_checkpoint_only_rank_1_finds_damaged(tmp_path):
    dump, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    older = fake_checkpoint(dump, 2)
    newer = fake_checkpoint(dump, 4)
    files = manifest_of(newer)
    damaged = integrity.crc_share(files, 1, 2)[0]
    flip_a_byte(newer / damaged)
    # Rank 0's own share is intact: only the agreement makes it skip the checkpoint.
    assert integrity.verify_share(newer, 0, 2) is None
    assert integrity.verify_share(newer, 1, 2) is not None

    proc = run_torchrun(2, "tests.workers.verify_worker", [str(dump), str(out)], timeout=120)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["choice"] for r in results] == [older.name, older.name]
    # No file was read twice; the intact checkpoint was read whole, between the two ranks (a rank
    # stops reading its share of a checkpoint at the first damaged file).
    read = [name for r in results for name in r["read"]]
    assert len(read) == len(set(read))
    assert (sorted(n for n in read if n.startswith("2/"))
            == sorted(f"2/{n}" for n in manifest_of(older)))
    assert f"4/{damaged}" in results[1]["read"] and f"4/{damaged}" not in results[0]["read"]
    assert (f"[rank0] lingua.checkpoint.integrity: skipping damaged checkpoint {newer}: "
            f"{newer / damaged} is damaged") in proc.stdout, proc.stdout[-3000:]
    # Said once, by rank 0.
    assert "[rank1] lingua.checkpoint.integrity: skipping" not in proc.stdout
    # Moved aside once, by rank 0, after rank 1 had read its damaged share (it named the damage).
    assert sorted(p.name for p in older.parent.iterdir()) == ["2", "4.damaged"]


@pytest.mark.distributed
def test_more_ranks_than_the_save_had_and_no_intact_checkpoint(tmp_path):
    """3 ranks verify a 2-rank save: the shares follow the manifest, not the saving layout; with
    every checkpoint damaged, all ranks agree that there is none to resume from."""
    dump, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    only = fake_checkpoint(dump, 2, saved_ranks=2)
    damaged = integrity.crc_share(manifest_of(only), 2, 3)[0]
    flip_a_byte(only / damaged)
    run_torchrun(3, "tests.workers.verify_worker", [str(dump), str(out)], timeout=120)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["choice"] for r in results] == [None, None, None]
    assert f"2/{damaged}" in results[2]["read"]


def test_keep_counts_intact_checkpoints_only(corpus, tmp_path, capfd):
    """A truncated newest checkpoint is skipped at resume, said once, and moved aside, so the next
    save prunes down to `keep` intact checkpoints instead of deleting an intact one for it."""
    dump = tmp_path / "run"
    train.main(tiny_args(corpus, dump, "checkpoint.every=2", "checkpoint.keep=2", steps=4))
    shard = checkpoint.checkpoints_dir(dump) / "4" / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    capfd.readouterr()
    train.main(tiny_args(corpus, dump, "checkpoint.keep=2", steps=5))   # resumes at 2, saves 5
    log = "".join(capfd.readouterr())
    assert [p.name for p in checkpoint.list_complete(dump)] == ["2", "5"]
    assert sorted(p.name for p in checkpoint.checkpoints_dir(dump).iterdir()) == [
        "2", "4.damaged", "5"]
    assert log.count("skipping damaged checkpoint") == 1, log[-3000:]
    assert f"skipping damaged checkpoint {shard.parent}: {shard} has" in log
    assert f"moved it to {shard.parent}.damaged (delete that to free its space)" in log


class ThreadRanks:
    """`world_size` ranks as threads of this process: `gather` is an all-gather over them, and
    `touched[r]` the paths rank r stat-ed, listed or opened (a thread-local rank says whose)."""

    def __init__(self, world_size: int, monkeypatch):
        self.world_size, self.slots = world_size, [None] * world_size
        self.barrier = threading.Barrier(world_size)
        self.local = threading.local()
        self.touched = [[] for _ in range(world_size)]
        for module, name in ((os, "stat"), (os, "listdir"), (os, "scandir"), (io, "open"),
                             (builtins, "open")):
            monkeypatch.setattr(module, name, self.recording(getattr(module, name)))

    def recording(self, real):
        def call(path, *args, **kwargs):
            rank = getattr(self.local, "rank", None)
            if rank is not None and isinstance(path, (str, os.PathLike)):
                self.touched[rank].append(Path(path))
            return real(path, *args, **kwargs)
        return call

    def gather(self, obj) -> list:
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()   # nobody overwrites a slot before all have read it
        return everyone

    def run(self, fn) -> list:
        """fn(rank) on every rank, together; the results in rank order."""
        results = [None] * self.world_size

        def rank_main(rank):
            self.local.rank = rank
            results[rank] = fn(rank)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        return results


def test_each_rank_touches_only_its_share_of_the_files(tmp_path, monkeypatch):
    """At resume no rank stats, opens or lists every file (1,000 ranks doing so are a metadata
    storm): rank 0 lists the candidates and reads their manifests, each rank stats and reads its
    share of the files; a damaged newer checkpoint is still found, by the rank whose share it is."""
    older = fake_checkpoint(tmp_path, 2, saved_ranks=8)
    newer = fake_checkpoint(tmp_path, 4, saved_ranks=8)
    damaged = integrity.crc_share(manifest_of(newer), 3, 4)[0]
    flip_a_byte(newer / damaged)
    ranks = ThreadRanks(4, monkeypatch)
    chosen = ranks.run(lambda r: checkpoint.newest_verified(tmp_path, r, 4, gather=ranks.gather))
    assert chosen == [older] * 4
    root = checkpoint.checkpoints_dir(tmp_path)
    for r, touched in enumerate(ranks.touched):
        for ckpt in (older, newer):
            files = manifest_of(ckpt)
            mine = {p.name for p in touched if p.parent == ckpt}
            share = set(integrity.crc_share(files, r, 4))
            assert mine == share | ({integrity.MANIFEST} if r == 0 else set()), (r, ckpt)
            assert len(share) <= len(files) // 2
        listed = [p for p in touched if p == root]
        assert (len(listed) > 0) == (r == 0), r


def test_a_listing_that_fails_on_rank_0_fails_on_every_rank(tmp_path, monkeypatch):
    """Rank 0 alone lists the checkpoints: its failure must reach the others, not leave them
    waiting for a list that never comes (4 ranks simulated as threads, as above)."""
    from lingua.errors import RunError

    def unreadable(root):
        raise PermissionError(13, "Permission denied", str(root))

    monkeypatch.setattr(integrity, "step_dirs", unreadable)
    barrier, slots, errors = threading.Barrier(4), [None] * 4, [None] * 4

    def gather_for(rank):
        def gather(obj):
            slots[rank] = obj
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out
        return gather

    def resume(rank):
        try:
            checkpoint.newest_verified(tmp_path, rank, 4, gather=gather_for(rank))
        except RunError as err:
            errors[rank] = str(err)

    threads = [threading.Thread(target=resume, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(e is not None and "cannot be listed" in e and "Permission denied" in e
               for e in errors), errors
