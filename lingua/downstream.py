"""Downstream tasks (HellaSwag, ARC, PIQA, ... or the shipped lingua_continuation) through
EleutherAI's lm-evaluation-harness, on the model as it is sharded for training.

`LinguaLM` is an `lm_eval.api.model.TemplateLM` backed by our model: lm-eval builds the
requests, we score them. Every rank of the layout takes part and no rank gathers a full copy of
the model: lm-eval is told it runs in one process (rank 0 of 1), so every rank builds the same
request list in the same order, and each batch of `eval.batch_size x dp` requests is split over
the data-parallel ranks (tensor-parallel peers score the same share; FSDP gathers each block's
weights as in training). The per-request results are summed over the data-parallel ranks, so
every rank ends with all of them and lm-eval computes the same metrics everywhere; rank 0 writes
them. Because the batches are the same whatever the layout, so are the results (up to float
rounding): tests/test_downstream.py checks one process against dp_shard=2 and tp=2, and
against lm-eval's own HFLM on our Hugging Face export.

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
metrics.jsonl and wandb (lingua/trainer.py inline, lingua/eval_cli.py otherwise). With a
`Progress` on stderr (the evaluation command's, unless logging.quiet), rank 0 says how far each
request type is: tasks, requests done out of all, time left.
Pipeline and context parallelism are not supported here: an evaluation job reshards the
checkpoint to a layout without them (DCP loads any layout).
"""

import contextlib
import difflib
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, TextIO, Tuple

import torch

from lingua import distributed
from lingua.distributed import DistEnv
from lingua.errors import ConfigError
from lingua.evaluation import EvalArgs
from lingua.metrics import format_duration

logger = logging.getLogger("eval")

RESULTS_NAME = "results.json"
FEWSHOT_SEED = 1234     # lm-eval's default: the same few-shot examples as its CLI picks
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
    logging.getLogger("lm_eval.api.task").addFilter(_DropRepeatedAdvice())
    # Its progress bars too: lm-eval has no switch for the one of building requests, and
    # TQDM_DISABLE is read when torch imports tqdm, before we could set it. So the name that
    # module calls is bound to a silent tqdm (nothing else is touched; LinguaLM silences its own).
    lm_eval.api.task.tqdm = functools.partial(tqdm.tqdm, disable=True)


@functools.lru_cache(maxsize=4)
def task_manager(include_path: Optional[str] = None):
    """lm-eval's task index: its own tasks, ours (lingua/eval_tasks) and a directory of the
    user's own task YAMLs (eval.include_path). Indexing reads every YAML: ~5 s, once."""
    from lm_eval.tasks import TaskManager

    from lingua.eval_tasks import TASKS_DIR

    quiet_lm_eval()
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"eval.include_path={include_path} is not a directory. Give the folder "
                          f"that holds your lm-eval task YAMLs, or leave it unset.")
    return TaskManager(include_path=[str(TASKS_DIR)] + ([str(include_path)] if include_path else []))


def check_task_names(names: List[str], include_path: Optional[str] = None) -> None:
    """Refuse unknown task names before any work, with the closest known ones."""
    if not names:
        return
    known = task_manager(include_path).all_tasks
    unknown = [name for name in names if name not in known]
    if unknown:
        hints = {name: difflib.get_close_matches(name, known, n=3) for name in unknown}
        hint = "; ".join(f"{name}: did you mean {', '.join(close)}?" for name, close in hints.items()
                         if close)
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
        return task_manager(include_path).load(list(names))["tasks"]
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


def task_label(requests) -> str:
    """The tasks lm-eval's requests come from (it sends all tasks' requests of a type at once)."""
    names = sorted({getattr(req, "task_name", None) or "?" for req in requests})
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def _lm_base():
    from lm_eval.api.model import TemplateLM

    return TemplateLM


class LinguaLM(_lm_base()):
    """lm-eval's view of our model (module docstring). `model` is the whole (unpipelined) model
    as this rank holds it: a plain module, or sharded by FSDP2 / TP."""

    def __init__(self, model, tokenizer, env: DistEnv, args: EvalArgs, max_length: int,
                 autocast: Callable = None, progress: Optional[Progress] = None):
        super().__init__()
        self.model, self.tok, self.env, self.args = model, tokenizer, env, args
        self._max_length = max_length
        self.autocast = autocast
        self.device_ = env.device
        self.progress = progress or Progress()
        self._tasks = ""   # the tasks of the requests being scored (Progress's lines)

    # lm-eval sees one process: every rank builds every request (module docstring).
    @property
    def rank(self):
        return 0

    @property
    def world_size(self):
        return 1

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id   # the context of an empty context, as HFLM uses BOS

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        add_bos = self.args.add_bos if add_special_tokens is None else add_special_tokens
        return self.tok.encode(string, add_bos=add_bos, add_eos=False)

    def tok_decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._tasks = task_label(requests)
        return super().loglikelihood(requests, disable_tqdm=True)   # no bar in a training log

    # -- the model ------------------------------------------------------------------------------

    def _logits(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """[b, s] -> logits [b, s, vocab] in the model's dtype, whole on every rank (only the
        continuations' rows are turned to fp32: a batch of 128k-vocabulary logits is GBs)."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad(), (self.autocast() if self.autocast else contextlib.nullcontext()):
            out = self.model(tokens.to(self.device_), cache=cache)
        if isinstance(out, tuple):  # an app whose forward returns more than the logits
            out = out[0]
        if isinstance(out, DTensor):  # vocabulary-sharded logits (loss parallel)
            out = out.full_tensor()
        return out

    def _share(self, n: int) -> range:
        """This data-parallel rank's slice of a global batch of n requests."""
        per_rank = -(-n // self.env.dp_size)
        start = self.env.dp_rank * per_rank
        return range(min(start, n), min(start + per_rank, n))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              what: str = "loglikelihood requests",
                              **kwargs) -> List[Tuple[float, bool]]:
        """[(key, context ids, continuation ids)] -> [(sum of the continuation's log-probs,
        whether greedy decoding gives the continuation)], in the requests' order."""
        self.progress.start(self._tasks, len(requests), what)
        inputs = []
        for _, context, continuation in requests:
            if not continuation:
                raise ConfigError("lm-eval asked for the log-likelihood of an empty continuation; "
                                  "the task's doc_to_choice / doc_to_target gave an empty string.")
            ids = (list(context) + list(continuation))[-(self._max_length + 1):][:-1]
            inputs.append((ids, list(continuation)))
        order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i][0]), i))
        results: List[Optional[Tuple[float, bool]]] = [None] * len(inputs)
        global_batch = self.args.batch_size * self.env.dp_size
        for start in range(0, len(order), global_batch):
            chunk = order[start:start + global_batch]
            mine = [chunk[j] for j in self._share(len(chunk))]
            scores = torch.zeros(len(chunk), 2, dtype=torch.float64, device=self.device_)
            if mine:
                longest = max(len(inputs[i][0]) for i in mine)
                batch = torch.zeros(len(mine), longest, dtype=torch.long)
                for row, i in enumerate(mine):
                    ids = inputs[i][0]
                    batch[row, :len(ids)] = torch.tensor(ids)
            else:  # nothing left for this rank: it still joins the forward (FSDP collectives)
                batch = torch.full((1, 1), self.tok.bos_id, dtype=torch.long)
            logits = self._logits(batch)
            offset = self._share(len(chunk)).start
            for row, i in enumerate(mine):
                ids, continuation = inputs[i]
                n = len(continuation)
                logprobs = torch.log_softmax(logits[row, len(ids) - n:len(ids)].float(), dim=-1)
                target = torch.tensor(continuation, device=logprobs.device)
                scores[offset + row, 0] = logprobs.gather(-1, target[:, None]).sum().double()
                scores[offset + row, 1] = float(bool((logprobs.argmax(-1) == target).all()))
            distributed.all_reduce_sum(scores, self.env, dims=("dp",))
            for j, i in enumerate(chunk):
                results[i] = (scores[j, 0].item(), bool(scores[j, 1].item()))
            self.progress.advance(len(chunk))
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        """The whole text's log-likelihood (perplexity tasks), window by window, each window
        conditioned on what precedes it, BOS as the first token's context."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False),
                    prefix_token=self.prefix_token_id, max_seq_len=self._max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owner.append(index)
        totals = [0.0] * len(requests)
        self._tasks = task_label(requests)
        scored = self._loglikelihood_tokens(windows, what="loglikelihood_rolling windows")
        for index, (logprob, _) in zip(owner, scored):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        """Greedy continuations, cut at the first stop sequence (module docstring)."""
        jobs = []
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample") and gen_kwargs.get("temperature", 1.0) > 0:
                logger.warning("a task asked for sampling (%s); lingua's evaluation decodes "
                               "greedily", gen_kwargs)
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = min(int(gen_kwargs.get("max_gen_toks", self.args.max_gen_tokens)),
                         self.args.max_gen_tokens, self._max_length - 1)
            ids = self.tok_encode(context)[-(self._max_length - budget):]
            jobs.append((ids, [s for s in until if s], budget))
        order = sorted(range(len(jobs)), key=lambda i: (-len(jobs[i][0]), i))
        texts = [""] * len(jobs)
        dp = self.env.dp_size
        self.progress.start(task_label(requests), len(jobs), "generate_until requests")
        for start in range(0, len(order), dp):
            chunk = order[start:start + dp]
            mine = chunk[self.env.dp_rank] if self.env.dp_rank < len(chunk) else None
            text = self._generate_one(jobs[mine] if mine is not None else None)
            for i, t in zip(chunk, self._gather_texts(text)):
                texts[i] = t
            self.progress.advance(len(chunk))
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _generate_one(self, job) -> str:
        """This rank's request (None: none left), decoded in lockstep with the other
        data-parallel ranks: every rank runs a forward at every step until all are done."""
        from lingua.transformer import KVCache

        ids, until, budget = job if job is not None else ([self.tok.bos_id], [], 0)
        cache = KVCache(self.model.layers.keys(), 1, len(ids) + budget)
        new: List[int] = []
        tokens = torch.tensor([ids])
        done = job is None
        while True:
            if not self._anyone_busy(done):
                break
            if done:  # finished early: keep the collectives in step with a one-token forward
                self._logits(torch.full((1, 1), self.tok.bos_id, dtype=torch.long))
                continue
            next_id = int(self._logits(tokens, cache)[0, -1].float().argmax())
            new.append(next_id)
            tokens = torch.tensor([[next_id]])
            text = self.tok.decode(new)
            if (next_id == self.tok.eos_id or len(new) >= budget
                    or any(stop in text for stop in until)):
                done = True
        text = self.tok.decode([i for i in new if i != self.tok.eos_id])
        for stop in until:
            text = text.split(stop, 1)[0]
        return text

    def _anyone_busy(self, done: bool) -> bool:
        busy = torch.tensor([0.0 if done else 1.0], device=self.device_)
        return bool(distributed.all_reduce_sum(busy, self.env, dims=("dp",)).item() > 0)

    def _gather_texts(self, text: str) -> List[str]:
        if self.env.dp_size == 1:
            return [text]
        everyone = [None] * self.env.dp_size
        torch.distributed.all_gather_object(everyone, text, group=self.env.mesh["dp"].get_group())
        return everyone

    def get_model_info(self) -> dict:
        return {"model_num_parameters": None, "model_dtype": None}


def evaluate_tasks(model, tokenizer, env: DistEnv, args: EvalArgs, max_length: int,
                   names: List[str], autocast: Callable = None,
                   progress: Optional[Progress] = None) -> dict:
    """Run lm-eval's tasks `names` (checked by load_tasks) with the model as this rank holds
    it; every rank calls it and gets the results ({"results": {task: {metric: value}}, ...}).
    The model is in eval mode for the duration and back as it was afterwards. `progress`:
    where rank 0 says how far it is (None: nowhere)."""
    from lm_eval import evaluator

    if not names:
        return {}
    was_training = model.training
    model.eval()
    lm = LinguaLM(model, tokenizer, env, args, max_length, autocast, progress)
    limit = None if args.limit is None else (args.limit if args.limit < 1 else int(args.limit))
    # lm-eval's evaluate(), not simple_evaluate(): the latter reseeds the global RNGs (the
    # training run's) and runs pip, conda, git and nvidia-smi for an environment report.
    loaded = task_manager(args.include_path).load(list(names))
    for task in loaded["tasks"].values():   # few-shot settings as simple_evaluate makes them
        if args.num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=args.num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    lm.progress.say(f"building the requests of {', '.join(names)}")
    try:
        results = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit,
                                     log_samples=args.log_samples, bootstrap_iters=1000)
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
