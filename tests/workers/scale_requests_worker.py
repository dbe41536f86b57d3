"""LinguaLM's check that every rank built the same lm-eval requests, on 2 gloo ranks, for
tests/test_lm_eval_model.py.

`torchrun --nproc-per-node 2 -m tests.workers.scale_requests_worker OUT_DIR`: scores hand-made
loglikelihood requests, the same on both ranks, then with rank 1's differing (another text, one
more request, another request among all the tasks' ones), and writes OUT_DIR/rank<r>.json: per
case, the scores or the error's message.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from lm_eval.api.instance import Instance

from lingua.data.tokenizer import ByteTokenizer
from lingua.errors import ConfigError
from lingua.eval.downstream import Progress
from lingua.eval.evaluation import EvalArgs
from lingua.eval.lm_eval_model import LinguaLM
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.parallel import distributed
from lingua.parallel.distributed import DistributedArgs

TEXTS = [("The cat", " sat"), ("A dog", " ran"), ("Rain", " fell")]


def requests(texts) -> list:
    return [Instance(request_type="loglikelihood", doc={}, arguments=args, idx=0,
                     metadata=("hand_made", i, 1)) for i, args in enumerate(texts)]


def main(out_dir: Path) -> None:
    env = distributed.init(DistributedArgs())
    torch.manual_seed(0)
    model = Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, multiple_of=16,
                                  vocab_size=ByteTokenizer.vocab_size, max_seq_len=24))
    model.init_weights()
    model.eval()
    other = env.rank == 1
    cases = {
        "same": (TEXTS, TEXTS),
        "text": (TEXTS[:2] + [("Rain", " rose")] if other else TEXTS, TEXTS),
        "count": (TEXTS + [("Sun", " shone")] if other else TEXTS, TEXTS),
        "tasks": (TEXTS, TEXTS[:2] if other else TEXTS),
    }
    out = {}
    for case, (scored, built) in cases.items():
        tasks = {"hand_made": SimpleNamespace(instances=requests(built))}
        lm = LinguaLM(model, ByteTokenizer(), env, EvalArgs(batch_size=2), 24, None, Progress(),
                      tasks=tasks)
        try:
            out[case] = [list(r) for r in lm.loglikelihood(requests(scored))]
        except ConfigError as err:
            out[case] = str(err)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(out))
    distributed.barrier(env)
    distributed.exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
