"""Downstream evaluation through lm-evaluation-harness (lingua/eval/downstream.py,
lingua/eval/eval_cli.py).

References: lm-eval's own HFLM on our Hugging Face export (per-example log-likelihoods and greedy
generations, and the accuracies), the model's own cross-entropy for rolling log-likelihoods, and
one process for the dp_shard=2 and tp=2 layouts. Tasks: the shipped lingua_continuation (multiple
choice) and two test-only tasks on its passages (tests/eval_tasks: rolling perplexity and
greedy generation), so every request type lm-eval has is covered, offline.
"""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, run_python, run_torchrun, tiny_args

pytestmark = pytest.mark.slow

TEST_TASKS = Path(__file__).parent / "eval_tasks"
ALL_TASKS = ["lingua_continuation", "lingua_continuation_rolling", "lingua_continuation_generate"]
# Byte-level passages of ~250 bytes + a continuation: the model must see them whole.
LONG = ["model.max_seq_len=512"]
LIMIT = 24


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    # The hub is out of reach here: fail at once instead of retrying for ~25 s.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """A tiny byte-level LLaMA trained 20 steps, checkpoints at 10 and 20."""
    run = tmp_path_factory.mktemp("downstream") / "run"
    run_python("apps.llama.train", tiny_args(corpus, run, *LONG, "checkpoint.every=10", steps=20))
    return run


def copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def eval_overrides(*extra) -> list:
    return [f"eval.tasks=[{','.join(ALL_TASKS)}]", f"eval.include_path={TEST_TASKS}",
            f"eval.limit={LIMIT}", "eval.batch_size=5", "eval.log_samples=true", *extra]


def samples(run: Path, step: int, task: str) -> list:
    path = run / "evals" / str(step) / "samples" / f"{task}.jsonl"
    return sorted((json.loads(line) for line in path.read_text().splitlines()),
                  key=lambda row: row["doc_id"])


def results(run: Path, step: int) -> dict:
    return json.loads((run / "evals" / str(step) / "results.json").read_text())


def loglikelihoods(rows) -> list:
    """Per example, the log-likelihood of each request (choice / rolling window sum)."""
    out = []
    for row in rows:
        out.append([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in row["resps"]])
    return out


def assert_same_answers(run: Path, ref: Path, rtol: float, atol: float) -> None:
    """Example by example, every task of step 20: the same generations and log-likelihoods."""
    for task in ALL_TASKS:
        ours, theirs = samples(run, 20, task), samples(ref, 20, task)
        assert [r["doc_id"] for r in ours] == [r["doc_id"] for r in theirs]
        if task.endswith("generate"):
            assert [r["resps"] for r in ours] == [r["resps"] for r in theirs]
        else:
            torch.testing.assert_close(torch.tensor(loglikelihoods(ours), dtype=torch.float64),
                                       torch.tensor(loglikelihoods(theirs), dtype=torch.float64),
                                       rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def one_process_cli(trained, tmp_path_factory) -> tuple:
    """The evaluation command on a copy of the run, in one process: (run, its process)."""
    run = copy_run(trained, tmp_path_factory.mktemp("one") / "run")
    proc = run_python("apps.llama.eval", [str(run), *eval_overrides()])
    assert f"results: {(run / 'evals' / '20' / 'results.json').resolve()}" in proc.stdout
    return run, proc


@pytest.fixture(scope="module")
def one_process(one_process_cli) -> Path:
    return one_process_cli[0]


PROGRESS = re.compile(r"eval: (\S+): (\w+) (?:requests|windows) (\d+)/(\d+) \(\d+%\) \| "
                      r"elapsed \d+:\d\d(?: \| eta (\d+:\d\d))?")


def progress_lines(stderr: str) -> list:
    """(task, request type, done, total, eta) of each progress line on stderr."""
    return [(m[1], m[2], int(m[3]), int(m[4]), m[5])
            for m in map(PROGRESS.fullmatch, stderr.splitlines()) if m]


def test_cli_writes_results_rows_and_samples(one_process):
    res = results(one_process, 20)
    assert sorted(res["results"]) == sorted(ALL_TASKS)
    mc = res["results"]["lingua_continuation"]
    assert (0.0 <= mc["acc,none"] <= 1.0
            and res["n-samples"]["lingua_continuation"]["effective"] == LIMIT)
    assert len(res["runs"]) == 1 and res["runs"][0]["world_size"] == 1
    rows = [r for r in read_metrics(one_process) if any(k.startswith("eval/") for k in r)]
    assert len(rows) == 1 and rows[0]["step"] == 20
    assert rows[0]["eval/lingua_continuation/acc"] == mc["acc,none"]
    assert rows[0]["eval/lingua_continuation_rolling/bits_per_byte"] == pytest.approx(
        res["results"]["lingua_continuation_rolling"]["bits_per_byte,none"])
    assert len(samples(one_process, 20, "lingua_continuation")) == LIMIT
    generated = [row["resps"][0][0]
                 for row in samples(one_process, 20, "lingua_continuation_generate")]
    assert len(generated) == LIMIT and all("\n" not in text for text in generated)
    assert any(generated), "greedy decoding produced only empty strings"


def test_cli_shows_progress_on_stderr(one_process_cli):
    """Each request type says how far it is (tasks, requests done of all, time left) after its
    first batch and when done (then every 10 s at most: not per request), on stderr only."""
    _, proc = one_process_cli
    lines = progress_lines(proc.stderr)
    kinds = {"lingua_continuation": ("loglikelihood", 4 * LIMIT),   # 4 choices per example
             "lingua_continuation_rolling": ("loglikelihood_rolling", LIMIT),   # one window each
             "lingua_continuation_generate": ("generate_until", LIMIT)}
    for task, (kind, total) in kinds.items():
        first = 1 if kind == "generate_until" else 5      # one batch: eval.batch_size=5
        mine = [line for line in lines if line[0] == task]
        assert mine[0][1:4] == (kind, first, total) and mine[-1][1:4] == (kind, total, total)
        done = [line[2] for line in mine]
        assert done == sorted(set(done)) and len(mine) < total / 2, proc.stderr
        assert None not in [line[4] for line in mine[:-1]] and mine[-1][4] is None  # ETA till done
    assert "eval: loading the model from" in proc.stderr and "eval:" not in proc.stdout


def test_cli_does_not_compute_a_task_twice(one_process):
    before = (one_process / "evals" / "20" / "results.json").read_text()
    n_rows = len(read_metrics(one_process))
    proc = run_python("apps.llama.eval", [str(one_process), *eval_overrides()])
    assert "already has results" in proc.stdout
    assert (one_process / "evals" / "20" / "results.json").read_text() == before
    assert len(read_metrics(one_process)) == n_rows


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [["distributed.dp_shard=2"], ["distributed.tp=2"]],
                         ids=["dp_shard2", "tp2"])
def test_layouts_equal_one_process(trained, one_process, tmp_path, layout):
    run = copy_run(trained, tmp_path / "run")
    run_torchrun(2, "apps.llama.eval", [str(run), *eval_overrides(*layout)])
    assert results(run, 20)["runs"][0]["world_size"] == 2
    assert_same_answers(run, one_process, rtol=1e-5, atol=1e-4)
    for task in ("lingua_continuation",):
        assert results(run, 20)["results"][task] == results(one_process, 20)["results"][task]


def test_matches_lm_eval_hflm_on_our_export(trained, one_process, tmp_path):
    """lm-eval's HFLM on `python -m apps.llama.hf export` (weights and the byte tokenizer as a
    tokenizer.json) scores every example as our LM does on the checkpoint. HFLM adds BOS to
    contexts only with add_bos_token=True (our default, eval.add_bos, as training documents
    start with BOS); for rolling windows its BOS is the prefix token alone, as ours is, and
    add_bos_token=True would add a second one, so that task is compared with its default."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    out = tmp_path / "hf"
    run_python("apps.llama.hf", ["export", str(trained / "checkpoints" / "20"), str(out)])
    assert (out / "tokenizer.json").is_file()
    manager = TaskManager(include_path=[str(Path("lingua/eval/tasks").resolve()), str(TEST_TASKS)],
                          include_defaults=False)   # lm-eval's own ~15k tasks: seconds to index
    for add_bos, tasks in ((True, ["lingua_continuation", "lingua_continuation_generate"]),
                           (False, ["lingua_continuation_rolling"])):
        hf = HFLM(pretrained=str(out), device="cpu", dtype="float32", batch_size=5,
                  add_bos_token=add_bos)
        theirs = evaluator.simple_evaluate(model=hf, tasks=tasks, limit=LIMIT, log_samples=True,
                                           task_manager=manager, bootstrap_iters=0)
        for task in tasks:
            ref = sorted(theirs["samples"][task], key=lambda row: row["doc_id"])
            ours = samples(one_process, 20, task)
            if task.endswith("generate"):
                assert [r["resps"] for r in ours] == [r["resps"] for r in ref]
                continue
            torch.testing.assert_close(torch.tensor(loglikelihoods(ours), dtype=torch.float64),
                                       torch.tensor(loglikelihoods(ref), dtype=torch.float64),
                                       rtol=1e-6, atol=1e-4)   # rolling sums reach ~700 nats
        mc = "lingua_continuation"
        if mc in tasks:
            ours_mc = results(one_process, 20)["results"][mc]
            assert ours_mc["acc,none"] == theirs["results"][mc]["acc,none"]
            assert ours_mc["acc_norm,none"] == theirs["results"][mc]["acc_norm,none"]


def test_rolling_loglikelihood_is_the_models_cross_entropy(trained, one_process):
    """Independent of lm-eval's windows: the log-likelihood of a passage is minus the summed
    next-token cross-entropy of [BOS] + its bytes under the model."""
    from apps.llama.generate import load_model

    model, tok = load_model(str(trained / "checkpoints" / "20"))
    for row in samples(one_process, 20, "lingua_continuation_rolling")[:6]:
        text = row["doc"]["context"]
        ids = torch.tensor([tok.encode(text, add_bos=True, add_eos=False)])
        with torch.no_grad():
            logits = model(ids[:, :-1])
        expected = -torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
        assert loglikelihoods([row])[0][0] == pytest.approx(expected.item(), abs=1e-3)


def test_inline_during_training_equals_the_cli(corpus, tmp_path):
    """eval.tasks with eval.every: the tasks run on the training ranks (dp_shard=2 here) at the
    evaluation steps, into the step's row and evals/<step>/; a resumed run going over a step
    again reads its results back instead of computing them twice."""
    run = tmp_path / "run"
    args = tiny_args(corpus, run, *LONG, "checkpoint.every=5", "eval.every=5",
                     "eval.tasks=[lingua_continuation]", f"eval.limit={LIMIT}",
                     "distributed.dp_shard=2", steps=10)
    run_torchrun(2, "apps.llama.train", args)
    rows = {r["step"]: r for r in read_metrics(run)}
    for step in (5, 10):
        acc = rows[step]["eval/lingua_continuation/acc"]
        assert acc == results(run, step)["results"]["lingua_continuation"]["acc,none"]
        assert "val_loss" in rows[step]
    assert not any(k.startswith("eval/") for k in rows[4])
    # The CLI on the same checkpoint, in one process, gives the same accuracy.
    other = tmp_path / "cli"
    shutil.copytree(run, other)
    shutil.rmtree(other / "evals")
    run_python("apps.llama.eval", [str(other), "eval.tasks=[lingua_continuation]",
                                   f"eval.limit={LIMIT}", "distributed.dp_shard=1"])
    assert results(other, 10)["results"]["lingua_continuation"] == \
        results(run, 10)["results"]["lingua_continuation"]
    # Resume from step 5 (drop the last checkpoint): step 10's row again, results read back.
    shutil.rmtree(run / "checkpoints" / "10")
    run_torchrun(2, "apps.llama.train", args)
    rows = {r["step"]: r for r in read_metrics(run)}
    assert rows[10]["eval/lingua_continuation/acc"] == results(run, 10)["results"][
        "lingua_continuation"]["acc,none"]
    assert len(results(run, 10)["runs"]) == 1


def test_wandb_gets_inline_and_job_results(corpus, tmp_path, monkeypatch):
    """Inline results go to the training run's wandb run; an evaluation command's to a run of
    its own in the same group, with the trained step as its x axis (offline runs here)."""
    from apps.llama import train

    secret = "sk-test-downstream-do-not-write"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "wb"
    train.main(tiny_args(corpus, run, *LONG, "logging.wandb=true", "eval.every=2",
                         "eval.tasks=[lingua_continuation]", "eval.limit=4", steps=2))
    [training] = list((run / "wandb").glob("offline-run-*"))
    assert b"eval/lingua_continuation/acc" in b"".join(p.read_bytes()
                                                       for p in training.glob("*.wandb"))
    run_python("apps.llama.eval", [str(run), "eval.tasks=[lingua_continuation_rolling]",
                                   f"eval.include_path={TEST_TASKS}", "eval.limit=4"])
    [job] = [r for r in (run / "wandb").glob("offline-run-*") if r != training]
    history = b"".join(p.read_bytes() for p in job.glob("*.wandb"))
    wandb_id = (run / "wandb_id.txt").read_text().strip()
    assert (b"eval/lingua_continuation_rolling/bits_per_byte" in history
            and b"trained_step" in history)
    assert f"{wandb_id}-eval-2".encode() in history and wandb_id.encode() in history
    for path in run.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_moe_checkpoint_evaluates(corpus, tmp_path):
    run = tmp_path / "moe"
    run_python("apps.moe.train", tiny_args(corpus, run, *LONG, "model.n_experts=4",
                                           "model.top_k=2", steps=4))
    proc = run_python("apps.moe.eval", [str(run), "eval.tasks=[lingua_continuation]",
                                        "eval.limit=8", "logging.quiet=true"])
    acc = results(run, 4)["results"]["lingua_continuation"]["acc,none"]
    assert f"step 4 eval/lingua_continuation/acc {acc:.4f}" in proc.stdout
    assert "eval:" not in proc.stderr + proc.stdout   # logging.quiet: no progress lines


# -- bad input: one paragraph, exit code 2, nothing written -------------------------------------

def refused(run: Path, *args: str) -> str:
    proc = run_python("apps.llama.eval", [str(run), *args], check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not (run / "evals").exists()
    return proc.stderr


def test_unknown_task_is_refused_with_close_names(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    err = refused(run, "eval.tasks=[lingua_continuaton]")
    assert "lingua_continuaton" in err and "did you mean lingua_continuation" in err


def test_task_without_reachable_data_says_so(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    err = refused(run, "eval.tasks=[arc_easy]")
    assert "Could not load the data" in err and "network" in err


def test_damaged_checkpoint_is_refused(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    shard = next((run / "checkpoints" / "20").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = refused(run / "checkpoints" / "20", "eval.tasks=[lingua_continuation]")
    assert "is damaged" in err and "CRC" in err


def test_bad_targets_and_overrides_are_refused(trained, tmp_path):
    run = copy_run(trained, tmp_path / "run")
    assert "no task to evaluate" in refused(run)
    assert "overrides of" in refused(run, "eval.tasks=[lingua_continuation]", "model.dim=32")
    assert "distributed.pp=1" in refused(run, "eval.tasks=[lingua_continuation]",
                                         "distributed.pp=2")
    assert "no checkpoint 7 in" in refused(run / "checkpoints" / "7",
                                           "eval.tasks=[lingua_continuation]")
    err = refused(run, "eval.tasks=[lingua_continuation]", "eval.limit=0")
    assert "eval.limit=0" in err


def test_tokenizer_without_bos_is_refused(trained, tmp_path):
    """A run whose tokenizer file has no BOS token cannot frame contexts as training did."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    run = copy_run(trained, tmp_path / "run")
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    err = refused(run, "eval.tasks=[lingua_continuation]", "data.tokenizer.kind=hf",
                  f"data.tokenizer.path={path}")
    assert "BOS" in err


def test_flat_metrics_names():
    from lingua.eval.downstream import flat_metrics

    got = flat_metrics({"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.5,
                                              "exact_match_stderr,strict-match": 0.1,
                                              "acc_stderr,none": "N/A"},
                                    "arc_easy": {"acc,none": 0.25, "acc_norm,none": 0.5}}})
    assert got == {"eval/gsm8k/exact_match_strict-match": 0.5,
                   "eval/gsm8k/exact_match_stderr_strict-match": 0.1,
                   "eval/arc_easy/acc": 0.25, "eval/arc_easy/acc_norm": 0.5}
    assert math.isfinite(got["eval/arc_easy/acc"])


MEDIAN_TASK = """task: scale_median
custom_dataset: !function utils.load
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: median
    higher_is_better: true
"""


def test_bootstrapped_stderr_forks_no_pool_and_only_rank_0_computes_it(tmp_path, monkeypatch):
    """lm-eval bootstraps the stderr of a metric without a formula (a median here, as perplexity
    or f1) in a pool of cpu_count() processes forked from the evaluating one (a CUDA/NCCL
    process): never here. Rank 0 computes it in-process with lm-eval's own resamples (the same
    value the pool gives); the other ranks, whose results rank 0's replace, skip it."""
    import multiprocessing

    from lm_eval.api import metrics

    from lingua.data.tokenizer import ByteTokenizer
    from lingua.eval import downstream
    from lingua.eval.evaluation import EvalArgs
    from lingua.models.llama.model import LlamaArgs, Transformer
    from lingua.parallel.distributed import DistEnv, DistributedArgs, parallel_dims

    def no_pool(*args, **kwargs):
        raise AssertionError("lm-eval forked a multiprocessing pool")

    monkeypatch.setattr(multiprocessing, "Pool", no_pool)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)   # set by the evaluation itself
    (tmp_path / "scale_median.yaml").write_text(MEDIAN_TASK)
    shutil.copy(TEST_TASKS / "utils.py", tmp_path / "utils.py")
    torch.manual_seed(0)
    model = Transformer(LlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, multiple_of=16,
                                  vocab_size=ByteTokenizer.vocab_size, max_seq_len=512))
    model.init_weights()
    args = EvalArgs(include_path=str(tmp_path), limit=8, batch_size=8, log_samples=True)
    dims = parallel_dims(DistributedArgs(), 1)
    got = {}
    for rank in (0, 1):
        env = DistEnv(rank, 0, 1, torch.device("cpu"), dims, None)
        got[rank] = downstream.evaluate_tasks(model, ByteTokenizer(), env, args, 512,
                                              ["scale_median"])
    accs = [row["acc"] for row in got[0]["samples"]["scale_median"]]
    draws = metrics._bootstrap_internal(metrics.median, downstream.BOOTSTRAP_ITERS)((0, accs))
    stderr = got[0]["results"]["scale_median"]["acc_stderr,none"]
    assert stderr == metrics.sample_stddev(draws), stderr   # what the pool computes
    assert got[1]["results"]["scale_median"]["acc_stderr,none"] == "N/A"
    assert (got[1]["results"]["scale_median"]["acc,none"]
            == got[0]["results"]["scale_median"]["acc,none"])


# -- the GPU runbook (bash setup/test.sh -m gpu) ------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_bf16_on_one_gpu_is_close_to_fp32(one_process, tmp_path):
    """The autocast path (distributed.model_dtype=bf16 without FSDP) and CUDA's kernels: the
    same accuracy within two examples, perplexity within 2%."""
    run = tmp_path / "run"
    shutil.copytree(one_process, run)
    shutil.rmtree(run / "evals")
    run_python("apps.llama.eval", [str(run), *eval_overrides("distributed.model_dtype=bf16")])
    ours, ref = results(run, 20)["results"], results(one_process, 20)["results"]
    assert abs(ours["lingua_continuation"]["acc,none"]
               - ref["lingua_continuation"]["acc,none"]) <= 2 / LIMIT
    bpb = "bits_per_byte,none"
    assert ours["lingua_continuation_rolling"][bpb] == pytest.approx(
        ref["lingua_continuation_rolling"][bpb], rel=0.02)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_on_two_gpus_equals_one(one_process, tmp_path):
    """NCCL: the lockstep of generation (an all-reduce per token), the gathered texts and the
    summed scores, on two GPUs against one."""
    ref = tmp_path / "one"
    shutil.copytree(one_process, ref)
    shutil.rmtree(ref / "evals")
    run_python("apps.llama.eval", [str(ref), *eval_overrides()])
    run = tmp_path / "two"
    shutil.copytree(one_process, run)
    shutil.rmtree(run / "evals")
    run_torchrun(2, "apps.llama.eval", [str(run), *eval_overrides("distributed.dp_shard=2")])
    assert_same_answers(run, ref, rtol=1e-4, atol=1e-3)
