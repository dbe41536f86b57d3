"""Downstream tasks (HellaSwag, ARC, PIQA, ... or the shipped lingua_continuation) through
EleutherAI's lm-evaluation-harness, on the model as it is sharded for training.

`LinguaLM` (lingua/eval/lm_eval_model.py) is an `lm_eval.api.model.TemplateLM` backed by our model:
lm- eval builds the requests, we score them. Every rank of the layout takes part and no rank gathers
a full copy of the model: lm-eval is told it runs in one process (rank 0 of 1), so every rank builds
the same request list in the same order, and each batch of `eval.batch_size x dp` requests is split
over the data-parallel ranks (tensor-parallel peers score the same share; FSDP gathers each block's
weights as in training). The per-request results are summed over the data-parallel ranks, so every
rank ends with all of them and lm-eval computes the same metrics everywhere; rank 0 writes them.
Because the batches are the same whatever the layout, so are the results (up to float rounding):
tests/test_downstream.py checks one process against dp_shard=2 and tp=2, and against lm-eval's own
HFLM on our Hugging Face export.

    loglikelihood          longest first, right-padded (causal attention: padding after a
                           sequence never reaches it, so no mask is needed), left-truncated to
                           model.max_seq_len as HFLM does
    loglikelihood_rolling  lm-eval's disjoint rolling windows, BOS as the first context
    generate_until         greedy decoding with the KV cache, one request per data-parallel rank
                           at a time, in lockstep (FSDP needs every rank in every forward); stops
                           at a stop sequence, EOS or the token budget

Results go to <dump_dir>/evals/<step>/results.json (with eval.log_samples, each example's
requests and responses to samples/<task>.jsonl beside it; each task of a step is computed once: a
later evaluation of that step adds the tasks it lacks) and as eval/<task>/<metric> values in
metrics.jsonl and wandb (DownstreamHook inline, lingua/eval/eval_cli.py otherwise). With a
`Progress` on stderr (the evaluation command's, unless logging.quiet), rank 0 says how far each
request type is: tasks, requests done out of all, time left.
Pipeline and context parallelism are not supported here: an evaluation job reshards the
checkpoint to a layout without them (DCP loads any layout).
"""

import difflib
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, TextIO

import torch

from lingua.data.tokenizer import build_tokenizer
from lingua.errors import ConfigError
from lingua.eval.evaluation import EvalArgs
from lingua.hooks import Hook
from lingua.observe.metrics import format_duration
from lingua.parallel.distributed import DistEnv
from lingua.train.build import mixed_precision
from lingua.train.loop import evaluates_at

logger = logging.getLogger("eval")

RESULTS_NAME = "results.json"
FEWSHOT_SEED = 1234     # lm-eval's default: the same few-shot examples as its CLI picks
BOOTSTRAP_ITERS = 1000  # resamples for the stderr of metrics without a formula (perplexity, f1...)
# lm-eval's per-task sections kept in results.json beside "results".
SECTIONS = ("n-shot", "versions", "higher_is_better", "n-samples")


class _DropRepeatedAdvice(logging.Filter):
    # lm-eval advises on --metadata for every task with a custom_dataset (ours), at each load.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def quiet_lm_eval() -> None:
    """lm-eval's INFO lines and progress bars, at every evaluation of a training run, would
    bury the training log: keep its warnings and errors only."""
    import lm_eval.api.task
    import tqdm

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # lm-eval's switch for its bootstrapped stderrs, otherwise computed in a pool of cpu_count()
    # processes forked from this one (CUDA, NCCL and gloo threads: a fork can hang or crash in
    # them, and on every node it oversubscribes the cores). Same resamples, same values.
    os.environ["DISABLE_MULTIPROC"] = "1"
    logging.getLogger("lm_eval.api.task").addFilter(_DropRepeatedAdvice())
    # Its progress bars too: lm-eval has no switch for the one of building requests, and
    # TQDM_DISABLE is read when torch imports tqdm, before we could set it. So the name that
    # module calls is bound to a silent tqdm (nothing else is touched; LinguaLM silences its own).
    lm_eval.api.task.tqdm = functools.partial(tqdm.tqdm, disable=True)


@functools.lru_cache(maxsize=8)
def task_manager(include_path: Optional[str] = None, lm_eval_tasks: bool = True):
    """lm-eval's task index of ours (lingua/eval/tasks), a directory of the user's own task YAMLs
    (eval.include_path) and, with lm_eval_tasks, lm-eval's own tasks. Indexing lm-eval's reads
    its ~15,000 YAMLs (5-15 s on 2 cores), once a process; ours alone takes a millisecond."""
    from lm_eval.tasks import TaskManager

    from lingua.eval.tasks import TASKS_DIR

    quiet_lm_eval()
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"eval.include_path={include_path} is not a directory. Give the folder "
                          f"that holds your lm-eval task YAMLs, or leave it unset.")
    extra = [str(include_path)] if include_path else []
    return TaskManager(include_path=[str(TASKS_DIR)] + extra, include_defaults=lm_eval_tasks)


def _load(names: List[str], include_path: Optional[str]) -> dict:
    """task_manager(...).load(names) from the index of ours and the user's tasks when it holds
    every name, else (a task of lm-eval's, or one of ours that includes one) from the whole."""
    own = task_manager(include_path, lm_eval_tasks=False)
    if all(name in own.all_tasks for name in names):
        try:
            return own.load(list(names))
        except Exception:   # a YAML that names one of lm-eval's: the whole index resolves it
            pass
    return task_manager(include_path).load(list(names))


def check_task_names(names: List[str], include_path: Optional[str] = None) -> None:
    """Refuse unknown task names before any work, with the closest known ones."""
    if not names:
        return
    if all(name in task_manager(include_path, lm_eval_tasks=False).all_tasks for name in names):
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
    """lm-eval's task objects (their data read or downloaded now, before the model is built).
    A task whose data cannot be fetched is a ConfigError that says so."""
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


def _results_path(dump_dir, step: int) -> Path:
    return Path(dump_dir) / "evals" / str(step) / RESULTS_NAME


def read_results(dump_dir, step: int) -> dict:
    """The results already written for `step` ({} if none): {"results": {task: {...}}, ...}."""
    path = _results_path(dump_dir, step)
    return json.loads(path.read_text()) if path.is_file() else {}


def missing_tasks(dump_dir, step: int, names: List[str]) -> List[str]:
    done = read_results(dump_dir, step).get("results", {})
    return [name for name in names if name not in done]


def flat_metrics(results: dict, names: Optional[List[str]] = None) -> Dict[str, float]:
    """lm-eval's {"results": {task: {"acc,none": v, "acc_stderr,none": s, ...}}} ->
    {"eval/<task>/acc": v, "eval/<task>/acc_stderr": s}; a filter other than "none" is kept as a
    suffix (exact_match,strict-match -> exact_match_strict-match). Non-numbers are left out."""
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
    """Add the new tasks' results to evals/<step>/results.json (atomically: a reader sees the
    old file or the new one). Tasks already there are kept as they are."""
    path = _results_path(dump_dir, step)
    merged = read_results(dump_dir, step) or {"step": step, "results": {}, "n-shot": {},
                                              "versions": {}, "higher_is_better": {},
                                              "n-samples": {}, "runs": []}
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
    """One metrics.jsonl line from a process other than the training loop (an evaluation job):
    a single O_APPEND write, so it never interleaves with the trainer's lines on a local or
    POSIX file system."""
    line = (json.dumps(row) + "\n").encode()
    fd = os.open(Path(dump_dir) / "metrics.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


class Progress:
    """Progress lines of an evaluation on `stream` (stderr; None: silent). Per request type: a
    line after its first batch (the first time left), then one every EVERY_S seconds at most,
    and one at its end; never one per request, which would bury the log."""

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
    """Run lm-eval's tasks `names` (checked by load_tasks) with the model as this rank holds
    it; every rank calls it and gets the results ({"results": {task: {metric: value}}, ...}).
    The model is in eval mode for the duration and back as it was afterwards. `progress`:
    where rank 0 says how far it is (None: nowhere)."""
    from lm_eval import evaluator

    from lingua.eval.lm_eval_model import LinguaLM  # lm-eval is optional: only evaluation needs it

    if not names:
        return {}
    was_training = model.training
    model.eval()
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    # lm-eval's evaluate(), not simple_evaluate(): the latter reseeds the global RNGs (the
    # training run's) and runs pip, conda, git and nvidia-smi for an environment report.
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
        # Every rank computes the metrics (lm-eval sees one process each); rank 0's are kept, so
        # only rank 0 bootstraps stderrs (in this process: quiet_lm_eval).
        results = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit,
                                     log_samples=args.log_samples,
                                     bootstrap_iters=BOOTSTRAP_ITERS if env.rank == 0 else 0)
    finally:
        model.train(was_training)
    # Every rank computed the same results; rank 0's (their plain sections: the task configs
    # hold functions) are everyone's.
    samples = (results or {}).get("samples") if env.rank == 0 else None
    if results is not None:
        results = {k: results[k] for k in SECTIONS + ("results",) if k in results}
    if env.world_size > 1:
        shared = [results if env.rank == 0 else None]
        torch.distributed.broadcast_object_list(shared, src=0)
        results = shared[0]
    results = dict(results or {})
    if samples is not None:   # rank 0 writes them; no need to send them around
        results["samples"] = samples
    return results


class DownstreamHook(Hook):
    """eval.tasks with eval.mode=inline: the tasks on the training ranks at evaluation steps,
    as eval/<task>/<metric> values in the step's row. Tasks the step already has results for
    (a resumed run going over the step again) are read back, not run again."""

    def __init__(self):
        self.tokenizer = None     # built for the first evaluation

    def after_step(self, run, step: int) -> None:
        e = run.args.eval
        if e.tasks and e.mode == "inline" and evaluates_at(run.args, step):
            run.eval_fields.update(self.downstream_metrics(run))

    def downstream_metrics(self, run) -> dict:
        args, env = run.args, run.env
        # Every rank must run the same tasks: rank 0 reads what is already there.
        todo = [missing_tasks(run.dump_dir, run.step, args.eval.tasks)]
        if env.world_size > 1:
            torch.distributed.broadcast_object_list(todo, src=0)
        todo = todo[0]
        if todo:
            if self.tokenizer is None:
                self.tokenizer = build_tokenizer(args.data.tokenizer)
            results = evaluate_tasks(
                run.parts[0], self.tokenizer, env, args.eval, args.model.max_seq_len, todo,
                autocast=lambda: mixed_precision(args, env, run.parts))
            if env.is_main:
                write_results(run.dump_dir, run.step, results,
                              {"inline": True, "layout": str(env.dims), "limit": args.eval.limit,
                               "num_fewshot": args.eval.num_fewshot})
        if not env.is_main:
            return {}
        return flat_metrics(read_results(run.dump_dir, run.step), args.eval.tasks)
