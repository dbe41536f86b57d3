"""Step time around a checkpoint save: synchronous (lingua.checkpoint.save) vs
checkpoint.async_save (lingua.checkpoint.save_async), on the benchmark model.

    python benchmarks/checkpoint_async.py [--dtype bf16|fp32] [--after 4] [--rounds 3] [--dir DIR]
                                          [--threads N]

One process trains the model of benchmarks/llama_cpu.py (~36M parameters, AdamW: a checkpoint of
about 0.44 GB with fp32 weights and optimizer state) and times windows of 1 + `after` steps: the
save step (its training step, then the save: all of it for `save`, the copy to CPU memory for
`save_async`), the `after` steps that follow, each ending with the step-boundary check the trainer
makes (PendingSave.finish(block=False)), and the wait for a write still running at the window's
end, where the trainer waits before the next save. The same window with no save is the baseline.
Sync, async and no save alternate in every round so drift in machine load hits all three; each
figure is the median over rounds. Prints, per mode, the save step's time, the mean time of the
steps after it, the window's total and its cost over the no-save window, then the ratio of the
async to the sync cost, with this CPU's model and flags. Checkpoints go to --dir (default: a
temporary directory on the disk of /tmp): DCP writes with fsync, so the disk's speed counts.
--threads sets the training's threads (default: torch's, one per core); fewer than the cores
leaves the background write a core of its own, as on a GPU node, where the host's cores are
mostly idle during a step. The load average before and after is printed: other work on the
machine slows the steps and the writes alike.
"""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from llama_cpu import SHAPE, cpu_description, median  # run as python benchmarks/checkpoint_async.py

from lingua import checkpoint, optim
from lingua.checkpoint import integrity
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.observe import metrics
from lingua.optim import adamw

MODES = ("sync", "async", "none")


class Trainer:
    """The training step of benchmarks/llama_cpu.py: forward, cross-entropy, backward, clip and a
    fused AdamW step (bf16: autocast compute, fp32 weights and optimizer state)."""

    def __init__(self, args: LlamaArgs, dtype: str, batch: int, seq_len: int):
        torch.manual_seed(0)
        self.model = Transformer(args)
        self.optimizer = torch.optim.AdamW(adamw.param_groups(self.model, 0.1), lr=1e-4,
                                           fused=True)
        self.tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1))
        self.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16,
                                               enabled=dtype == "bf16")
        self.step_count = 0

    def step(self) -> None:
        with self.autocast():
            logits = self.model(self.tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 self.tokens[:, 1:].flatten())
        loss.backward()
        optim.clip_grad_norm([self.model], 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1


def window(trainer: Trainer, mode: str, after: int, dump_dir: Path) -> dict:
    """Seconds of the save step, of each step after it and of the whole window."""
    parts, optimizers = [trainer.model], [trainer.optimizer]
    start = time.perf_counter()
    trainer.step()
    pending = None
    if mode == "sync":
        checkpoint.save(dump_dir, trainer.step_count, parts, optimizers,
                        {"step": trainer.step_count}, "benchmark: true\n", 0, 1, keep=1)
    elif mode == "async":
        pending = checkpoint.save_async(dump_dir, trainer.step_count, parts, optimizers,
                                        {"step": trainer.step_count}, "benchmark: true\n", 0, 1,
                                        keep=1)
    save_step = time.perf_counter() - start
    finished_after = 0 if pending is None else None
    later = []
    for i in range(after):
        t0 = time.perf_counter()
        trainer.step()
        if pending is not None and pending.finish(block=False) is not None:
            pending, finished_after = None, i + 1
        later.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if pending is not None:
        pending.finish(block=True)
    waited = time.perf_counter() - t0
    total = time.perf_counter() - start
    if mode != "none":
        saved = dump_dir / "checkpoints" / str(trainer.step_count - after)
        assert integrity.verify(saved) is None
    return {"save_step": save_step, "later": sum(later) / len(later), "waited": waited,
            "total": total, "finished_after": finished_after}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="default: bf16 where this CPU has bf16 instructions, else fp32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--after", type=int, default=4, help="steps timed after the save step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=None, help="training threads")
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)
    load_before = os.getloadavg()[0]
    cli.dtype = cli.dtype or ("fp32" if metrics.cpu_bf16_emulated() else "bf16")

    args = LlamaArgs(**SHAPE, max_seq_len=cli.seq_len)
    trainer = Trainer(args, cli.dtype, cli.batch, cli.seq_len)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    for _ in range(cli.warmup):
        trainer.step()
    root = Path(tempfile.mkdtemp(prefix="ckpt_async_", dir=cli.dir))
    results = {mode: [] for mode in MODES}
    size = 0
    try:
        # A first save of each kind outside the timings (DCP's first call imports and plans).
        for mode in ("sync", "async"):
            window(trainer, mode, 1, root / f"warmup_{mode}")
        size = sum(p.stat().st_size for p in (root / "warmup_sync" / "checkpoints").rglob("*")
                   if p.is_file())
        for r in range(cli.rounds):
            for mode in MODES:   # alternated, so drift in machine load hits each mode
                dump = root / f"round{r}_{mode}"
                results[mode].append(window(trainer, mode, cli.after, dump))
                shutil.rmtree(dump, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"model {n_params / 1e6:.1f}M params, batch {cli.batch} x {cli.seq_len}, {cli.dtype}, "
          f"{torch.get_num_threads()} training threads on {os.cpu_count()} cores, checkpoint "
          f"{size / 1e9:.2f} GB in {root.parent}; {cpu_description()}; load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"window: the save step + {cli.after} steps (+ the wait for an unfinished write); "
          f"median of {cli.rounds} rounds")
    base = median([w["total"] for w in results["none"]])
    cost = {}
    for mode in MODES:
        runs = results[mode]
        total = median([w["total"] for w in runs])
        cost[mode] = total - base
        line = (f"{mode:>5}: save step {median([w['save_step'] for w in runs]) * 1e3:7.0f} ms, "
                f"steps after {median([w['later'] for w in runs]) * 1e3:6.0f} ms each, window "
                f"{total * 1e3:7.0f} ms")
        if mode != "none":
            line += f", cost over no save {cost[mode] * 1e3:6.0f} ms"
        if mode == "async":
            done = [w["finished_after"] for w in runs]
            line += (f" (write finished at step boundary {done} after the save; "
                     f"wait at the end {median([w['waited'] for w in runs]) * 1e3:.0f} ms)")
        print(line)
    print(f"ratio async/sync of the save's cost to training: "
          f"{cost['async'] / cost['sync']:.3f}" if cost["sync"] > 0 else
          "the synchronous save cost nothing measurable: no ratio")


if __name__ == "__main__":
    main()
