"""Bad input on the command line: every case exits non-zero, fast, with one paragraph that names
the problem and the fix (no traceback), and before anything is written or started: the dump_dir
is not created (or, for an existing run, left as it was), no process group, no job."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, TINY_MODEL, run_python, tiny_args

MOE = ["model.n_experts=4", "model.top_k=2"]


def cases(corpus, tmp_path):
    """(id, module, overrides, extra env, text the message must contain)."""
    empty = tmp_path / "empty_corpus"
    empty.mkdir(exist_ok=True)
    base = lambda *extra: tiny_args(corpus, tmp_path / "dump", *extra)  # noqa: E731
    return [
        ("unknown_key", "apps.llama.train", base("optim.lrr=1"), {}, "optim.lrr"),
        ("unknown_section", "apps.llama.train", base("optimizer.lr=1"), {}, "optimizer"),
        ("wrong_type", "apps.llama.train", base("steps=many"), {}, "steps"),
        ("negative_lr", "apps.llama.train", base("optim.lr=-1e-3"), {}, "optim.lr=-0.001"),
        ("steps_zero", "apps.llama.train", base("steps=0"), {}, "steps=0"),
        ("unknown_preset", "apps.llama.train", ["config=llama_9000"], {}, "llama_9000"),
        ("world_size_mismatch", "apps.llama.train", base("distributed.dp_shard=3"),
         {"WORLD_SIZE": "2"}, "do not match the world size"),
        ("heads_not_divisible_by_tp", "apps.llama.train",
         base("distributed.tp=3", "distributed.dp_shard=1"), {"WORLD_SIZE": "3"}, "tp=3"),
        ("kv_heads_not_dividing_heads", "apps.llama.train", base("model.n_kv_heads=3"), {},
         "n_kv_heads"),
        ("seq_len_not_divisible_by_2_cp_tp", "apps.llama.train",
         base("distributed.cp=2", "distributed.tp=2", "distributed.dp_shard=1", "data.seq_len=36"),
         {"WORLD_SIZE": "4"}, "seq_len"),
        ("pp_stages_beyond_layers", "apps.llama.train",
         base("distributed.pp=4", "distributed.dp_shard=1"), {"WORLD_SIZE": "4"}, "pp"),
        ("unknown_pp_schedule", "apps.llama.train",
         base("distributed.pp=2", "distributed.dp_shard=1", "distributed.pp_schedule=Zigzag"),
         {"WORLD_SIZE": "2"}, "Zigzag"),
        ("ep_not_dividing_experts", "apps.moe.train",
         ["config=debug", *base(*MOE, "distributed.ep=3", "distributed.dp_shard=3")],
         {"WORLD_SIZE": "3"}, "ep=3"),
        ("top_k_above_experts", "apps.moe.train",
         ["config=debug", *base("model.n_experts=2", "model.top_k=3")], {}, "top_k"),
        ("xformers_on_cpu", "apps.llama.train", base("model.attn_backend=xformers"), {},
         "xformers"),
        ("unknown_attention_backend", "apps.llama.train", base("model.attn_backend=magic"), {},
         "magic"),
        ("compile_backend_missing", "apps.llama.train",
         base("distributed.compile=true", "distributed.compile_backend=tensorrt"), {}, "tensorrt"),
        ("nccl_without_gpu", "apps.llama.train", base("distributed.backend=nccl"), {}, "nccl"),
        ("cpu_offload_without_gpu", "apps.llama.train", base("distributed.cpu_offload=true"), {},
         "cpu_offload"),
        ("unknown_ac_mode", "apps.llama.train", base("distributed.ac=sometimes"), {}, "sometimes"),
        ("missing_data_dir", "apps.llama.train",
         base(f"data.root={tmp_path / 'no_such_corpus'}"), {}, "no_such_corpus"),
        ("empty_data_dir", "apps.llama.train", base(f"data.root={empty}"), {}, str(empty)),
        ("unknown_data_format", "apps.llama.train", base("data.format=parquet"), {}, "parquet"),
        ("tokenizer_file_missing", "apps.llama.train",
         base("data.tokenizer.kind=sentencepiece", f"data.tokenizer.path={tmp_path / 'tok.model'}"),
         {}, "tok.model"),
        ("seq_len_above_max_seq_len", "apps.llama.train", base("data.seq_len=4096"), {},
         "max_seq_len"),
        ("unknown_scheduler", "apps.llama.train", base("optim.scheduler=exponential"), {},
         "exponential"),
        ("bad_nonfinite_policy", "apps.llama.train", base("optim.nonfinite=ignore"), {}, "ignore"),
        ("negative_checkpoint_keep", "apps.llama.train", base("checkpoint.keep=-1"), {},
         "checkpoint.keep"),
        ("logging_every_zero", "apps.llama.train", base("logging.every=0"), {}, "logging.every"),
        ("bad_probe_tensor", "apps.llama.train", base("probe.every=5", "probe.tensors=[bias]"), {},
         "probe.tensors"),
        ("bad_model_dtype", "apps.llama.train", base("distributed.model_dtype=fp8"), {}, "fp8"),
        ("init_from_missing", "apps.llama.train",
         base(f"checkpoint.init_from={tmp_path / 'no_hf_model'}"), {}, "no_hf_model"),
        ("stool_unknown_partition_or_no_slurm", "lingua.stool",
         ["apps.llama.train", *base(), "slurm.partition=no_such_partition"], {},
         "slurm.partition"),
        ("stool_bad_mem", "lingua.stool", ["apps.llama.train", *base(), "slurm.mem=lots"], {},
         "slurm.mem"),
    ]


def run_case(module, overrides, env_extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if "WORLD_SIZE" not in env_extra:
        env.pop("WORLD_SIZE", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    return proc, time.perf_counter() - t0


def check_refused(proc, seconds, must_contain):
    err = proc.stderr.strip()
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    # stderr ends with our paragraph; warnings libraries print before it are not ours
    message = "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("error:")):])
    assert message.startswith("error:"), err[-2000:]
    assert must_contain in message, message
    assert len(message) < 1500, message
    assert seconds < 10, f"took {seconds:.1f}s"
    return message


def test_at_least_25_bad_inputs_are_covered(corpus, tmp_path):
    assert len(cases(corpus, tmp_path)) >= 25


@pytest.mark.parametrize("index", range(34))
def test_bad_input_is_refused_before_any_work(corpus, tmp_path, index):
    name, module, overrides, env, must_contain = cases(corpus, tmp_path)[index]
    proc, seconds = run_case(module, overrides, env)
    check_refused(proc, seconds, must_contain)
    assert not (tmp_path / "dump").exists(), f"{name}: the dump_dir was created"


def test_a_dump_dir_holding_another_model_is_refused_and_left_alone(corpus, tmp_path):
    dump = tmp_path / "run"
    run_python("apps.llama.train", tiny_args(corpus, dump, steps=1))
    before = sorted((p.relative_to(dump), p.stat().st_mtime_ns) for p in dump.rglob("*"))
    other = [o if not o.startswith("model.dim=") else "model.dim=128"
             for o in tiny_args(corpus, dump, steps=2)]
    assert "model.dim=128" in other
    proc, seconds = run_case("apps.llama.train", other, {})
    check_refused(proc, seconds, "holds a checkpoint")
    assert sorted((p.relative_to(dump), p.stat().st_mtime_ns) for p in dump.rglob("*")) == before
