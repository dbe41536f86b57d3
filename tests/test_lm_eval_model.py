"""LinguaLM (lingua/eval/lm_eval_model.py) on hand-made lm-eval requests, in one process: its
log-likelihoods against log_softmax of one whole-sequence forward, its greedy generation (with the
KV cache) against argmax decoding that recomputes the whole prefix each token. Fast: the quick
tier's in-process check of the module that the downstream tests reach through subprocesses."""

import io
import json
import math

import pytest
import torch
from lm_eval.api.instance import Instance

from lingua.data.tokenizer import ByteTokenizer
from lingua.eval.downstream import Progress
from lingua.eval.evaluation import EvalArgs
from lingua.eval.lm_eval_model import LinguaLM
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.parallel.distributed import DistEnv, DistributedArgs, parallel_dims
from tests.conftest import run_torchrun

MAX_LEN = 24


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = Transformer(LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
                                  vocab_size=ByteTokenizer.vocab_size, max_seq_len=MAX_LEN))
    model.init_weights()
    model.eval()
    env = DistEnv(0, 0, 1, torch.device("cpu"), parallel_dims(DistributedArgs(), 1), None)
    return LinguaLM(model, ByteTokenizer(), env, EvalArgs(batch_size=2, max_gen_tokens=5),
                    MAX_LEN, None, Progress(io.StringIO()))


def request(kind: str, args: tuple, index: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=index,
                    metadata=("hand_made", index, 1))


def reference_loglikelihood(model, ids: list, n_continuation: int) -> tuple:
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]])).float(), dim=-1)[0]
    rows = logprobs[len(ids) - 1 - n_continuation:]
    target = torch.tensor(ids[-n_continuation:])
    return (rows.gather(-1, target[:, None]).sum().item(),
            bool((rows.argmax(-1) == target).all()))


def test_loglikelihood_is_the_continuations_log_softmax(lm):
    pairs = [("The cat", " sat"), ("A", "b"), ("long context", " and more")]
    got = lm.loglikelihood([request("loglikelihood", pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ids = lm.tok_encode(context) + lm.tok_encode(continuation, add_special_tokens=False)
        n = len(lm.tok_encode(continuation, add_special_tokens=False))
        want, want_greedy = reference_loglikelihood(lm.model, ids, n)
        assert logprob == pytest.approx(want, rel=1e-5, abs=1e-5) and greedy == want_greedy
        assert logprob < 0


def test_rolling_loglikelihood_sums_windows_over_the_whole_text(lm):
    short, long = "hello", "x" * (MAX_LEN * 2 + 3)   # the long one spans three windows
    got = lm.loglikelihood_rolling([request("loglikelihood_rolling", (short,)),
                                    request("loglikelihood_rolling", (long,), 1)])
    ids = [lm.tok.bos_id] + lm.tok_encode(short, add_special_tokens=False)
    want, _ = reference_loglikelihood(lm.model, ids, len(ids) - 1)
    assert got[0] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert math.isfinite(got[1]) and got[1] < got[0]


def test_generate_until_is_greedy_decoding_cut_at_the_stop(lm):
    context = "The cat"
    ids = lm.tok_encode(context)
    new = []
    with torch.no_grad():
        for _ in range(5):   # max_gen_tokens: whole prefix each token, no cache
            new.append(int(lm.model(torch.tensor([ids + new]))[0, -1].float().argmax()))
    want = lm.tok.decode([i for i in new if i != lm.tok.eos_id])
    got = lm.generate_until([request("generate_until", (context, {"max_gen_toks": 5}))])
    assert got == [want]
    stop = want[2:4] if len(want) >= 4 else None
    if stop:   # a stop sequence cuts the text before it
        cut = lm.generate_until([request("generate_until", (context, {"until": [stop]}))])
        assert cut == [want.split(stop, 1)[0]]


@pytest.mark.distributed
def test_ranks_with_different_requests_fail_with_the_fix(tmp_path):
    """A node whose dataset cache holds other data builds other requests: every rank says so (the
    same paragraph) before the first collective, where it would otherwise hang."""
    run_torchrun(2, "tests.workers.scale_requests_worker", [str(tmp_path)], timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["same"] == ranks[1]["same"] and len(ranks[0]["same"]) == 3
    for case in ("text", "count", "tasks"):
        message = ranks[0][case]
        assert isinstance(message, str) and message == ranks[1][case], (case, ranks)
        assert message.startswith("The ranks built different lm-eval requests"), message
        assert "HF_DATASETS_CACHE" in message and "rank 0:" in message and "rank 1:" in message
    assert "rank 1: 4 loglikelihood requests" in ranks[0]["count"]
    assert "rank 1: 3 loglikelihood requests" in ranks[0]["tasks"]
    assert "2 of every type" in ranks[0]["tasks"]
