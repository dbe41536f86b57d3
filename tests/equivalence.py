"""The one comparison every layout and resume test goes through.

A parallel layout (or a resumed run) must compute what one process computes. Per-step losses
alone cannot show it: AdamW divides each gradient by its own running size and the trainer clips
the global norm, so a gradient 2x too large moves the losses by less than 1e-5 while the
gradient norm moves by exactly 2x. So `assert_equivalent` compares, against the reference run:
  - every logged step: the same steps, none missing, extra or repeated, and at least one;
  - at each of them the loss and the gradient norm before clipping (and the validation loss
    and any other keys asked for, where the reference has them);
  - after the last step, every tensor of the model's final checkpoint (parameters, and buffers
    such as MoE's expert bias) by name: the sum and the sum of squares of the full tensor,
    gathered by DCP from whatever shards the layout wrote.
`assert_resumed` adds what a resume test must show: where the run resumed (its log line) and
that the steps before it were kept, not computed again.

tests/test_catches.py injects bugs into a real run and checks that these functions fail.
"""

import json
import math
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

# fp32, CPU: a layout changes only the order of sums (sharded matmuls, reductions), ~1e-7.
RTOL = 1e-5


def read_rows(dump_dir) -> list:
    """metrics.jsonl as a list of dicts; a missing, empty or cut file is an assertion error."""
    path = Path(dump_dir) / "metrics.jsonl"
    assert path.is_file(), f"{path} is missing: the run logged nothing"
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except ValueError as err:
            raise AssertionError(
                f"{path}:{number} is not a JSON line (a cut file?): {line[:200]!r}") from err
    assert rows, f"{path} is empty: no step was logged"
    return rows


def final_checkpoint(dump_dir, step: int) -> Path:
    """The checkpoint a run saved after its last step (checkpoint.save_final, the default)."""
    ckpt = Path(dump_dir) / "checkpoints" / str(step)
    assert (ckpt / ".metadata").is_file(), (
        f"{ckpt} is not a complete checkpoint: the run must save after its last step "
        f"(checkpoint.save_final=true)")
    return ckpt


def model_checksums(ckpt_dir) -> dict:
    """{tensor name: (sum, sum of squares, sum |x|)} of every 'model.*' tensor in a DCP
    checkpoint, read in this process (no process group) from the checkpoint's metadata and
    shards."""
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    assert state, f"{ckpt_dir} holds no model tensors"
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
    sums = {}
    for key, tensor in state.items():
        t = tensor.double()
        # sum |x| scales the tolerance of the sum, which may be near zero by cancellation.
        sums[key[len("model."):]] = (t.sum().item(), t.pow(2).sum().item(), t.abs().sum().item())
    return sums


def _close(got: float, want: float, rtol: float, scale: Optional[float] = None) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return abs(got - want) <= rtol * (abs(want) if scale is None else scale)


def assert_same_rows(rows: list, reference: list, rtol: float = RTOL, keys=("loss", "grad_norm"),
                     prefixes: Optional[dict] = None, what: str = "run",
                     tight_steps: int = 0) -> None:
    """Step by step: the same steps, and `keys` (plus 'val_loss' and every key starting with a
    prefix in `prefixes` {prefix: rtol}, where the reference has them) within rtol. Steps up to
    `tight_steps` are held to RTOL for every key, whatever rtol and prefixes allow: a float8
    run equals its reference until the weights differ in a bit (tests/test_float8_moe.py)."""
    assert reference, "the reference run logged no step"
    assert rows, f"the {what} logged no step"
    steps, want_steps = [r["step"] for r in rows], [r["step"] for r in reference]
    assert steps == want_steps, (f"the {what} logged steps {steps}, the reference {want_steps} "
                                 f"(missing, extra or repeated steps)")
    prefixes = prefixes or {}
    for got, want in zip(rows, reference):
        tight = want["step"] <= tight_steps
        checks = {k: RTOL if tight else rtol for k in keys}
        if "val_loss" in want:
            checks["val_loss"] = RTOL if tight else rtol
        for prefix, prefix_rtol in prefixes.items():
            matching = sorted(k for k in want if k.startswith(prefix))
            assert matching, f"step {want['step']}: the reference has no '{prefix}*' key"
            extra = sorted(k for k in got if k.startswith(prefix) and k not in want)
            assert not extra, f"step {got['step']}: the {what} logged {extra}, the reference not"
            checks.update({k: RTOL if tight else prefix_rtol for k in matching})
        for key, tol in checks.items():
            assert key in got, f"step {got['step']}: the {what} did not log {key!r}"
            assert key in want, f"step {want['step']}: the reference did not log {key!r}"
            assert _close(got[key], want[key], tol), (
                f"step {got['step']}: {key} = {got[key]!r} in the {what}, {want[key]!r} in the "
                f"reference (relative difference "
                f"{abs(got[key] - want[key]) / max(abs(want[key]), 1e-30):.2e}"
                f" > {tol:g})")


def assert_same_checksums(got: dict, want: dict, rtol: float = RTOL, what: str = "run") -> None:
    assert set(got) == set(want), (
        f"final checkpoints hold different tensors: only in the {what}: "
        f"{sorted(set(got) - set(want))}; only in the reference: {sorted(set(want) - set(got))}")
    for name in sorted(want):
        (s, sq, _), (ws, wsq, wl1) = got[name], want[name]
        assert _close(sq, wsq, rtol), (
            f"final {name}: sum of squares {sq!r} in the {what}, {wsq!r} in the reference "
            f"(relative difference {abs(sq - wsq) / max(abs(wsq), 1e-30):.2e} > {rtol:g})")
        assert _close(s, ws, rtol, scale=wl1), (
            f"final {name}: sum {s!r} in the {what}, {ws!r} in the reference (difference "
            f"{abs(s - ws):.3g} > {rtol:g} x sum|x| = {rtol * wl1:.3g})")


def assert_equivalent(dump_dir, reference_dir, rtol: float = RTOL, keys=("loss", "grad_norm"),
                      prefixes: Optional[dict] = None, tight_steps: int = 0) -> None:
    """The run in dump_dir computed what the reference run computed: every logged step's loss and
    gradient norm, and the tensors of the checkpoint saved after the last step (see the module
    docstring); steps up to tight_steps at RTOL (assert_same_rows)."""
    rows, reference = read_rows(dump_dir), read_rows(reference_dir)
    assert_same_rows(rows, reference, rtol, keys, prefixes, tight_steps=tight_steps)
    last = reference[-1]["step"]
    assert_same_checksums(model_checksums(final_checkpoint(dump_dir, last)),
                          model_checksums(final_checkpoint(reference_dir, last)), rtol)


def resumed_line(dump_dir, step: int) -> str:
    """What the trainer logs when it resumes from dump_dir's checkpoint of `step`."""
    return f"resumed from {Path(dump_dir) / 'checkpoints' / str(step)} (step {step})"


def assert_resumed(dump_dir, log: str, step: int, rows_before: list) -> None:
    """The second run in dump_dir resumed from its checkpoint of `step` (its log says so) and did
    not compute steps 1..step again: their rows are exactly those the first run wrote (rows
    carry wall-clock timings, so a recomputed step would not be byte-equal), and every later
    step is logged once."""
    assert resumed_line(dump_dir, step) in log, (
        f"the run did not log '{resumed_line(dump_dir, step)}'; its log ends:\n{log[-3000:]}")
    rows = read_rows(dump_dir)
    kept = [r for r in rows if r["step"] <= step]
    first = [r for r in rows_before if r["step"] <= step]
    assert first, f"the first run logged no step up to {step}"
    assert kept == first, (f"steps up to {step} were computed again after resuming (their rows "
                           f"changed), or lost")
    later = [r["step"] for r in rows if r["step"] > step]
    assert later == sorted(set(later)), f"steps after {step} logged more than once: {later}"
