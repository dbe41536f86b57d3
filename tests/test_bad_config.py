"""Bad input on the command line: every case exits non-zero with one paragraph that names the
problem and the fix (no traceback), and before anything is written or started: the dump_dir is
not created (or, for an existing run, left as it was), nothing else appears beside the case's own
inputs, no checkpoint, no job."""

import os
from pathlib import Path
from typing import NamedTuple

import pytest

from lingua.errors import ConfigError
from tests import launcher
from tests.conftest import REPO, run_python, slurm_is_up, tiny_args

MOE = ["model.n_experts=4", "model.top_k=2"]
# corpus and tmp_path are fixtures: the cases name them by these placeholders, which the test
# replaces, so the list is built at import and each case is its own test, named by its id.
CORPUS, TMP = "{corpus}", "{tmp}"


class Case(NamedTuple):
    name: str
    module: str
    overrides: list
    env: dict
    must_contain: str        # the message names this
    inputs: tuple = ()       # directories under tmp_path the case needs to exist (empty)
    needs_slurm: bool = False


def base(*extra):
    return tiny_args(CORPUS, f"{TMP}/dump", *extra)


CASES = [
    Case("unknown_key", "apps.llama.train", base("optim.lrr=1"), {}, "optim.lrr"),
    Case("unknown_section", "apps.llama.train", base("optimizer.lr=1"), {}, "optimizer"),
    Case("wrong_type", "apps.llama.train", base("steps=many"), {},
         "steps takes an integer, not 'many'"),
    Case("negative_lr", "apps.llama.train", base("optim.lr=-1e-3"), {}, "optim.lr=-0.001"),
    Case("steps_zero", "apps.llama.train", base("steps=0"), {}, "steps=0"),
    # with a dump_dir under tmp_path, so that "nothing written" checks something
    Case("unknown_preset", "apps.llama.train", ["config=llama_9000", *base()], {}, "llama_9000"),
    Case("world_size_mismatch", "apps.llama.train", base("distributed.dp_shard=3"),
         {"WORLD_SIZE": "2"}, "do not match the world size"),
    Case("heads_not_divisible_by_tp", "apps.llama.train",
         base("distributed.tp=3", "distributed.dp_shard=1"), {"WORLD_SIZE": "3"}, "tp=3"),
    Case("kv_heads_not_dividing_heads", "apps.llama.train", base("model.n_kv_heads=3"), {},
         "n_kv_heads"),
    Case("seq_len_not_divisible_by_2_cp_tp", "apps.llama.train",
         base("distributed.cp=2", "distributed.tp=2", "distributed.dp_shard=1", "data.seq_len=36"),
         {"WORLD_SIZE": "4"}, "seq_len"),
    Case("pp_stages_beyond_layers", "apps.llama.train",
         base("distributed.pp=4", "distributed.dp_shard=1"), {"WORLD_SIZE": "4"}, "pp"),
    Case("unknown_pp_schedule", "apps.llama.train",
         base("distributed.pp=2", "distributed.dp_shard=1", "distributed.pp_schedule=Zigzag"),
         {"WORLD_SIZE": "2"}, "Zigzag"),
    Case("ep_not_dividing_experts", "apps.moe.train",
         ["config=debug", *base(*MOE, "distributed.ep=3", "distributed.dp_shard=3")],
         {"WORLD_SIZE": "3"}, "ep=3"),
    Case("top_k_above_experts", "apps.moe.train",
         ["config=debug", *base("model.n_experts=2", "model.top_k=3")], {}, "top_k"),
    Case("xformers_on_cpu", "apps.llama.train", base("model.attn_backend=xformers"), {},
         "xformers"),
    Case("unknown_attention_backend", "apps.llama.train", base("model.attn_backend=magic"), {},
         "magic"),
    Case("compile_backend_missing", "apps.llama.train",
         base("distributed.compile=true", "distributed.compile_backend=tensorrt"), {}, "tensorrt"),
    Case("nccl_without_gpu", "apps.llama.train", base("distributed.backend=nccl"), {}, "nccl"),
    Case("cpu_offload_without_gpu", "apps.llama.train", base("distributed.cpu_offload=true"), {},
         "cpu_offload"),
    Case("unknown_ac_mode", "apps.llama.train", base("distributed.ac=sometimes"), {}, "sometimes"),
    Case("missing_data_dir", "apps.llama.train", base(f"data.root={TMP}/no_such_corpus"), {},
         "no_such_corpus"),
    Case("empty_data_dir", "apps.llama.train", base(f"data.root={TMP}/empty_corpus"), {},
         f"{TMP}/empty_corpus", inputs=("empty_corpus",)),
    Case("unknown_data_format", "apps.llama.train", base("data.format=parquet"), {}, "parquet"),
    Case("tokenizer_file_missing", "apps.llama.train",
         base("data.tokenizer.kind=sentencepiece", f"data.tokenizer.path={TMP}/tok.model"), {},
         "tok.model"),
    Case("seq_len_above_max_seq_len", "apps.llama.train", base("data.seq_len=4096"), {},
         "max_seq_len"),
    Case("unknown_scheduler", "apps.llama.train", base("optim.scheduler=exponential"), {},
         "exponential"),
    Case("bad_nonfinite_policy", "apps.llama.train", base("optim.nonfinite=ignore"), {}, "ignore"),
    Case("negative_checkpoint_keep", "apps.llama.train", base("checkpoint.keep=-1"), {},
         "checkpoint.keep"),
    Case("logging_every_zero", "apps.llama.train", base("logging.every=0"), {}, "logging.every"),
    Case("bad_probe_tensor", "apps.llama.train", base("probe.every=5", "probe.tensors=[bias]"), {},
         "probe.tensors"),
    Case("bad_model_dtype", "apps.llama.train", base("distributed.model_dtype=fp8"), {}, "fp8"),
    Case("init_from_missing", "apps.llama.train",
         base(f"checkpoint.init_from={TMP}/no_hf_model"), {}, "no_hf_model"),
    # stool checks a partition against `sinfo`: without a Slurm there is nothing to check it
    # against (stool says that sbatch is missing instead), so this case needs one.
    Case("stool_unknown_partition", "lingua.launch.stool",
         ["apps.llama.train", *base(), "slurm.partition=no_such_partition"], {},
         "slurm.partition", needs_slurm=True),
    Case("stool_bad_mem", "lingua.launch.stool",
         ["apps.llama.train", *base(), "slurm.mem=lots"], {},
         "slurm.mem"),
]


def resolve(text: str, corpus: Path, tmp_path: Path) -> str:
    return text.replace(CORPUS, str(corpus)).replace(TMP, str(tmp_path))


def run_case(module, overrides, env_extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), **env_extra)
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if "WORLD_SIZE" not in env_extra:
        env.pop("WORLD_SIZE", None)
    # The timeout only guards against a hang; "before any work" is checked on what was written.
    # Forked warm (tests/launcher.py): what is checked is the command's own output and files.
    return launcher.launch(module, overrides, 0, env, REPO, timeout=300)


def check_refused(proc, must_contain):
    err = proc.stderr.strip()
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    # stderr ends with our paragraph; warnings libraries print before it are not ours
    first = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    message = "\n".join(lines[first:])
    assert message.startswith("error:"), err[-2000:]
    assert must_contain in message, message
    assert len(message) < 1500, message
    return message


def files_under(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_at_least_25_bad_inputs_are_covered():
    assert len(CASES) >= 25
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_is_refused_before_any_work(corpus, tmp_path, case):
    if case.needs_slurm:
        reason = slurm_is_up()
        # setup/test.sh sets LINGUA_REQUIRE_SLURM after starting Slurm: there the case runs, and
        # fails if Slurm is not up after all (as tests/test_slurm.py does).
        if reason and os.environ.get("LINGUA_REQUIRE_SLURM") != "1":
            pytest.skip(reason)
    for name in case.inputs:
        (tmp_path / name).mkdir()
    before = files_under(tmp_path)
    proc = run_case(case.module, [resolve(o, corpus, tmp_path) for o in case.overrides], case.env)
    check_refused(proc, resolve(case.must_contain, corpus, tmp_path))
    assert not (tmp_path / "dump").exists(), f"{case.name}: the dump_dir was created"
    assert files_under(tmp_path) == before, f"{case.name}: files were written"


@pytest.mark.slow
def test_a_dump_dir_holding_another_model_is_refused_and_left_alone(corpus, tmp_path):
    dump = tmp_path / "run"
    run_python("apps.llama.train", tiny_args(corpus, dump, steps=1))
    before = sorted((p.relative_to(dump), p.stat().st_mtime_ns) for p in dump.rglob("*"))
    other = [o if not o.startswith("model.dim=") else "model.dim=128"
             for o in tiny_args(corpus, dump, steps=2)]
    assert "model.dim=128" in other
    proc = run_case("apps.llama.train", other, {})
    check_refused(proc, "holds a checkpoint")
    assert sorted((p.relative_to(dump), p.stat().st_mtime_ns) for p in dump.rglob("*")) == before


@pytest.mark.slow   # starts the commands' processes
@pytest.mark.parametrize("module,under", [("apps.llama.train", False),
                                          ("apps.llama.train", True),
                                          ("lingua.launch.stool", False)])
def test_a_dump_dir_that_is_a_file_or_under_one_is_refused(corpus, tmp_path, module, under):
    afile = tmp_path / "afile"
    afile.write_text("not a run")
    dump = afile / "sub" if under else afile
    args = tiny_args(corpus, dump)
    stool = module == "lingua.launch.stool"
    proc = run_case(module, ["apps.llama.train", *args] if stool else args, {})
    check_refused(proc, f"dump_dir={dump} lies under {afile}, which is a file" if under
                  else f"dump_dir={dump} is a file")
    assert files_under(tmp_path) == ["afile"] and afile.read_text() == "not a run"


@pytest.mark.parametrize("override,sentence", [
    ("optim.lr=abc", "optim.lr takes a float, not 'abc': for example optim.lr=0.003."),
    ("steps=ten", "steps takes an integer, not 'ten': for example steps=5."),
])
def test_a_value_of_the_wrong_type_is_one_sentence(corpus, tmp_path, override, sentence):
    """The key, the value given and the type expected (the example is the value the override
    would have replaced), without OmegaConf's internals (full_key, object_type, ...)."""
    from apps.llama.train import load_config

    with pytest.raises(ConfigError) as err:
        load_config(tiny_args(corpus, tmp_path / "run", override))
    assert str(err.value) == sentence
