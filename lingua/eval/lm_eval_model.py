"""`LinguaLM`: lm-eval's view of our model; imported only by evaluations (lm-eval is optional)."""

import contextlib
import hashlib
import logging
from typing import Callable, List, Optional, Tuple

import torch
from lm_eval.api.model import TemplateLM

from lingua.errors import ConfigError
from lingua.eval.evaluation import EvalArgs
from lingua.model.layers import KVCache
from lingua.parallel import distributed
from lingua.parallel.distributed import DistEnv

logger = logging.getLogger("eval")


def task_label(requests) -> str:
    """The tasks lm-eval's requests come from (it sends all tasks' requests of a type at once)."""
    names = sorted({getattr(req, "task_name", None) or "?" for req in requests})
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def request_digest(instances) -> tuple:
    """(how many, SHA-256 of their contents) of lm-eval requests: what every rank must agree on."""
    digest, n = hashlib.sha256(), 0
    for inst in instances:
        digest.update(repr((inst.task_name, inst.request_type, inst.doc_id, inst.idx,
                            inst.repeats, inst.arguments)).encode() + b"\0")
        n += 1
    return n, digest.hexdigest()


def different_requests_error(everyone: list) -> ConfigError:
    """The same paragraph on every rank: which ranks built which requests, and the fix."""
    seen = {}
    for rank, (kind, (n, digest), (total, all_digest)) in enumerate(everyone):
        seen.setdefault((kind, n, digest[:12], total, all_digest[:12]), []).append(str(rank))
    found = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(r)}: {n} {kind} requests "
                      f"(sha256 {digest}), {total} of every type (sha256 {all_digest})"
                      for (kind, n, digest, total, all_digest), r in seen.items())
    return ConfigError(
        f"The ranks built different lm-eval requests for eval.tasks ({found}): each rank builds "
        f"them from the tasks' data as its node sees it (HF_DATASETS_CACHE or HF_HOME, a dataset "
        f"changed on the hub, the lm-eval version, the task YAMLs), and ranks scoring different "
        f"requests would wait for each other forever. Give every node the same data and code: "
        f"point HF_DATASETS_CACHE (or HF_HOME) at one shared directory, install the same lm-eval "
        f"version and eval.include_path files everywhere, then run again.")


class LinguaLM(TemplateLM):
    """`model`: the whole (unpipelined) model as this rank holds it, maybe sharded by FSDP2 / TP."""

    def __init__(self, model, tokenizer, env: DistEnv, args: EvalArgs, max_length: int,
                 autocast: Callable, progress, tasks: Optional[dict] = None):
        super().__init__()
        self.tasks = tasks or {}   # lm-eval's task objects: every request they built is checked
        self._all_requests = None   # their request_digest, once built
        self.model, self.tok, self.env, self.args = model, tokenizer, env, args
        self.max_length, self.autocast, self.device_ = max_length, autocast, env.device
        self.progress = progress   # a lingua.eval.downstream.Progress
        self._tasks = ""   # the tasks of the requests being scored (Progress's lines)

    # lm-eval sees one process: every rank builds every request (module docstring).
    rank, world_size = 0, 1

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id   # the context of an empty context, as HFLM uses BOS

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   **kwargs) -> List[int]:
        add_bos = self.args.add_bos if add_special_tokens is None else add_special_tokens
        return self.tok.encode(string, add_bos=add_bos, add_eos=False)

    def tok_decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._same_on_every_rank("loglikelihood", requests)
        self._tasks = task_label(requests)
        return super().loglikelihood(requests, disable_tqdm=True)   # no bar in a training log

    def _same_on_every_rank(self, kind: str, requests) -> None:
        """Every rank built the same requests, or all raise the same ConfigError (no hang)."""
        if self.env.world_size == 1:
            return
        if self._all_requests is None:
            self._all_requests = request_digest(
                inst for task in self.tasks.values() for inst in (task.instances or []))
        mine = (kind, request_digest(requests), self._all_requests)
        everyone = [None] * self.env.world_size
        torch.distributed.all_gather_object(everyone, mine)
        if any(other != mine for other in everyone):
            raise different_requests_error(everyone)

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
            ids = (list(context) + list(continuation))[-(self.max_length + 1):][:-1]
            inputs.append((ids, list(continuation)))
        order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i][0]), i))
        results: List[Optional[Tuple[float, bool]]] = [None] * len(inputs)
        global_batch = self.args.batch_size * self.env.dp_size
        for start in range(0, len(order), global_batch):
            chunk = order[start:start + global_batch]
            mine = [chunk[j] for j in self._share(len(chunk))]
            scores = torch.zeros(len(chunk), 2, dtype=torch.float64, device=self.device_)
            if mine:   # right-padded with zeros
                batch = torch.nn.utils.rnn.pad_sequence(
                    [torch.tensor(inputs[i][0], dtype=torch.long) for i in mine], batch_first=True)
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

        self._same_on_every_rank("loglikelihood_rolling", requests)
        windows, owner = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False),
                    prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
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
        self._same_on_every_rank("generate_until", requests)
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
                         self.args.max_gen_tokens, self.max_length - 1)
            ids = self.tok_encode(context)[-(self.max_length - budget):]
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
        ids, until, budget = job if job is not None else ([self.tok.bos_id], [], 0)
        cache = KVCache(self.model.layers.keys(), 1, len(ids) + budget)
        new, tokens, done = [], torch.tensor([ids]), job is None
        while self._anyone_busy(done):
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


