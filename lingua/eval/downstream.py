"""Downstream tasks through lm-evaluation-harness, on the model sharded as for training. lm-eval
is told it runs in one process, so every rank builds the same requests; `LinguaLM` splits each
batch over the data-parallel ranks and sums the results. Results: <dump_dir>/evals/<step>/."""

import difflib
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, TextIO

from lingua.data.tokenizer import build_tokenizer
from lingua.errors import ConfigError
from lingua.eval.evaluation import EvalArgs
from lingua.hooks import Hook
from lingua.model.weights import broadcast_object
from lingua.observe.metrics import format_duration
from lingua.parallel.distributed import DistEnv
from lingua.train.build import mixed_precision
from lingua.train.loop import evaluates_at

RESULTS_NAME = "results.json"
FEWSHOT_SEED = 1234     # lm-eval's default: the same few-shot examples as its CLI picks
BOOTSTRAP_ITERS = 1000  # resamples for the stderr of metrics without a formula (perplexity, f1...)
# lm-eval's per-task sections kept in results.json beside "results".
SECTIONS = ("n-shot", "versions", "higher_is_better", "n-samples")


def quiet_lm_eval() -> None:
    """Warnings and errors only: lm-eval's INFO lines and bars would bury the training log."""
    import lm_eval.api.task
    import tqdm

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # Bootstrap in this process, not a forked pool (a fork can hang in CUDA, NCCL, gloo threads).
    os.environ["DISABLE_MULTIPROC"] = "1"
    logging.getLogger("lm_eval.api.task").addFilter(   # its advice at each load of our tasks
        lambda record: "Custom kwargs can be passed" not in record.getMessage())
    # No switch silences the bar of building requests (TQDM_DISABLE is read when torch imports
    # tqdm): the name that module calls is bound to a silent tqdm.
    lm_eval.api.task.tqdm = functools.partial(tqdm.tqdm, disable=True)


@functools.lru_cache(maxsize=8)
def task_manager(include_path: Optional[str] = None, lm_eval_tasks: bool = True):
    """Ours, eval.include_path's and lm-eval's own (slow: thousands of YAMLs, so once a process)."""
    from lm_eval.tasks import TaskManager

    from lingua.eval.tasks import TASKS_DIR

    quiet_lm_eval()
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"eval.include_path={include_path} is not a directory. Give the folder "
                          f"that holds your lm-eval task YAMLs, or leave it unset.")
    extra = [str(include_path)] if include_path else []
    return TaskManager(include_path=[str(TASKS_DIR)] + extra, include_defaults=lm_eval_tasks)


def _load(names: List[str], include_path: Optional[str]) -> dict:
    """From the small index of ours and the user's tasks when it holds every name (fast)."""
    own = task_manager(include_path, lm_eval_tasks=False)
    if all(name in own.all_tasks for name in names):
        try:
            return own.load(list(names))
        except Exception:   # a YAML that names one of lm-eval's: the whole index resolves it
            pass
    return task_manager(include_path).load(list(names))


def check_task_names(names: List[str], include_path: Optional[str] = None) -> None:
    """Refuse unknown task names before any work, with the closest known ones."""
    if not names or all(name in task_manager(include_path, lm_eval_tasks=False).all_tasks
                        for name in names):
        return
    known = task_manager(include_path).all_tasks
    unknown = [name for name in names if name not in known]
    if unknown:
        hints = {name: difflib.get_close_matches(name, known, n=3) for name in unknown}
        hint = "; ".join(f"{name}: did you mean {', '.join(close)}?"
                         for name, close in hints.items() if close)
        raise ConfigError(
            f"eval.tasks names unknown lm-eval task(s) {unknown}. {hint + '. ' if hint else ''}"
            f"The shipped offline task is lingua_continuation; list lm-eval's with "
            f"`lm-eval ls tasks`; your own task YAMLs go in eval.include_path=DIR.")


def check_layout(dims, where: str) -> None:
    if dims.pp > 1 or dims.cp > 1:
        raise ConfigError(
            f"{where}: downstream tasks run on layouts without pipeline or context parallelism "
            f"(distributed.pp={dims.pp}, distributed.cp={dims.cp}). Evaluate each checkpoint in "
            f"its own job instead (eval.mode=async, or python -m apps.<app>.eval <checkpoint> "
            f"distributed.pp=1 distributed.cp=1: the checkpoint reshards to any layout).")


def load_tasks(names: List[str], include_path: Optional[str] = None) -> dict:
    """lm-eval's task objects, their data read or downloaded now, before the model is built."""
    check_task_names(names, include_path)
    try:
        return _load(names, include_path)["tasks"]
    except Exception as err:  # datasets raises ConnectionError, OSError, DatasetNotFoundError...
        raise ConfigError(
            f"Could not load the data of eval.tasks={list(names)}: {type(err).__name__}: "
            f"{str(err).strip()[:600]}\nlm-eval's tasks (other than the shipped "
            f"lingua_continuation) download their data from the Hugging Face hub the first time; "
            f"this machine could not. Run the same command once where there is network (the data "
            f"is then cached in ~/.cache/huggingface, or HF_HOME), or evaluate "
            f"eval.tasks=[lingua_continuation]. Nothing was written.") from None


def results_path(dump_dir, step: int) -> Path:
    return Path(dump_dir) / "evals" / str(step) / RESULTS_NAME


def read_results(dump_dir, step: int) -> dict:
    path = results_path(dump_dir, step)
    return json.loads(path.read_text()) if path.is_file() else {}


def missing_tasks(dump_dir, step: int, names: List[str]) -> List[str]:
    done = read_results(dump_dir, step).get("results", {})
    return [name for name in names if name not in done]


def flat_metrics(results: dict, names: Optional[List[str]] = None) -> Dict[str, float]:
    """{"acc,none": v} -> {"eval/<task>/acc": v}; another filter is kept as a suffix
    (exact_match,strict-match -> exact_match_strict-match). Non-numbers are left out."""
    flat = {}
    for task, values in results.get("results", {}).items():
        if names is not None and task not in names:
            continue
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            flat[f"eval/{task}/{metric if filt == 'none' else metric + '_' + filt}"] = float(value)
    return flat


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_results(dump_dir, step: int, new: dict, meta: dict) -> None:
    """Atomically (a reader sees the old file or the new one); tasks already there are kept."""
    path = results_path(dump_dir, step)
    merged = read_results(dump_dir, step) or {
        "step": step, **{section: {} for section in ("results",) + SECTIONS}, "runs": []}
    for section in ("results",) + SECTIONS:
        for task, value in (new.get(section) or {}).items():
            merged.setdefault(section, {}).setdefault(task, value)
    merged.setdefault("runs", []).append({**meta, "tasks": sorted(new.get("results", {}))})
    from lm_eval.utils import handle_non_serializable

    _atomic_write(path, json.dumps(merged, indent=2, default=handle_non_serializable) + "\n")
    for task, rows in (new.get("samples") or {}).items():   # eval.log_samples
        _atomic_write(path.parent / "samples" / f"{task}.jsonl", "".join(
            json.dumps(row, default=handle_non_serializable) + "\n" for row in rows))


def append_metrics_row(dump_dir, row: dict) -> None:
    """A single O_APPEND write, so it never interleaves with the trainer's lines."""
    line = (json.dumps(row) + "\n").encode()
    fd = os.open(Path(dump_dir) / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Progress:
    """Progress lines on `stream` (None: silent), one every EVERY_S seconds at most."""

    EVERY_S = 10.0

    def __init__(self, stream: Optional[TextIO] = None):
        self.stream = stream
        self.start("", 0, "")

    def say(self, message: str) -> None:
        if self.stream is not None:
            print(f"eval: {message}", file=self.stream, flush=True)

    def start(self, tasks: str, total: int, what: str) -> None:
        self.tasks, self.total, self.what, self.done = tasks, total, what, 0
        self.t0, self.last = time.perf_counter(), None

    def advance(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.last is not None and now - self.last < self.EVERY_S and self.done < self.total:
            return
        self.last, elapsed = now, now - self.t0
        left = elapsed / max(self.done, 1) * (self.total - self.done)
        eta = f" | eta {format_duration(left)}" if self.done < self.total else ""
        self.say(f"{self.tasks}: {self.what} {self.done}/{self.total} "
                 f"({100 * self.done / max(self.total, 1):.0f}%) | elapsed "
                 f"{format_duration(elapsed)}{eta}")


def evaluate_tasks(model, tokenizer, env: DistEnv, args: EvalArgs, max_length: int,
                   names: List[str], autocast: Callable = None,
                   progress: Optional[Progress] = None) -> dict:
    """Collective: every rank calls it and gets the same results."""
    from lm_eval import evaluator

    from lingua.eval.lm_eval_model import LinguaLM  # lm-eval is optional: only evaluation needs it

    if not names:
        return {}
    was_training = model.training
    model.eval()
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    # evaluate(), not simple_evaluate(): that reseeds the run's RNGs, runs pip/git/nvidia-smi.
    loaded = _load(names, args.include_path)
    lm = LinguaLM(model, tokenizer, env, args, max_length, autocast, progress or Progress(),
                  tasks=loaded["tasks"])
    for task in loaded["tasks"].values():   # few-shot settings as simple_evaluate makes them
        if args.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=args.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    lm.progress.say(f"building the requests of {', '.join(names)}")
    try:
        # Every rank computes the metrics; only rank 0's are kept, so only it bootstraps stderrs.
        results = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit,
                                     log_samples=args.log_samples,
                                     bootstrap_iters=BOOTSTRAP_ITERS if env.rank == 0 else 0)
    finally:
        model.train(was_training)
    # Every rank computed the same: rank 0's plain sections (configs hold functions) are everyone's.
    samples = (results or {}).get("samples") if env.rank == 0 else None
    if results is not None:
        results = {k: results[k] for k in SECTIONS + ("results",) if k in results}
    if env.world_size > 1:
        results = broadcast_object(results if env.rank == 0 else None)
    results = dict(results or {})
    if samples is not None:   # rank 0 writes them; no need to send them around
        results["samples"] = samples
    return results


class DownstreamHook(Hook):
    """eval.mode=inline; tasks the step already has results for (a resume) are not run again."""

    def __init__(self):
        self.tokenizer = None     # built for the first evaluation
        self.fields: dict = {}    # the evaluation step's results, for its row

    def after_step(self, view, step: int) -> None:
        e = view.args.eval
        if e.tasks and e.mode == "inline" and evaluates_at(view.args, step):
            self.fields = self.downstream_metrics(view)

    def metrics(self, view, row: dict) -> None:
        row.update(self.fields)
        self.fields = {}

    def downstream_metrics(self, view) -> dict:
        args, env, dump_dir = view.args, view.env, view.args.dump_dir
        # Every rank must run the same tasks: rank 0 reads what is already there.
        todo = broadcast_object(missing_tasks(dump_dir, view.step, args.eval.tasks))
        if todo:
            if self.tokenizer is None:
                self.tokenizer = build_tokenizer(args.data.tokenizer)
            results = evaluate_tasks(
                view.parts[0], self.tokenizer, env, args.eval, args.model.max_seq_len, todo,
                autocast=lambda: mixed_precision(args, env, view.parts))
            if env.is_main:
                write_results(dump_dir, view.step, results,
                              {"inline": True, "layout": str(env.dims), "limit": args.eval.limit,
                               "num_fewshot": args.eval.num_fewshot})
        if not env.is_main:
            return {}
        return flat_metrics(read_results(dump_dir, view.step), args.eval.tasks)
