"""A run's stderr holds no warning the project knowingly triggers: DCP's "assuming the intent is to
save/load in a single process" at each one-process save and load, torch's "Slicing a flattened dim
from root mesh will be deprecated" at each sub-mesh lookup."""

import re
import warnings

import pytest
import torch

from lingua.launch import plan_memory
from lingua.parallel import distributed
from lingua.parallel.distributed import DistributedArgs
from tests.conftest import run_python, run_torchrun, tiny_args

DCP_SINGLE = "assuming the intent is to"
FLAT_SLICE = "Slicing a flattened dim from root mesh"
# Any warning raised from torch's own files: "<...>/torch/<file>.py:<line>: <Category>Warning:".
TORCH_WARNING = re.compile(r"[/\\]torch[/\\]\S+\.py:\d+: \w*Warning")


def save_then_resume(launch, corpus, dump, *extra) -> str:
    """stderr of a 2-step run saving at steps 1 and 2, then of its resume to step 3 (a load, a
    save)."""
    first = launch(tiny_args(corpus, dump, "checkpoint.every=1", *extra, steps=2))
    again = launch(tiny_args(corpus, dump, "checkpoint.every=1", *extra, steps=3))
    assert "resum" in (again.stdout + again.stderr).lower()
    return first.stderr + again.stderr


@pytest.mark.slow
def test_one_process_save_and_resume_print_no_torch_warning(corpus, tmp_path):
    stderr = save_then_resume(lambda args: run_python("apps.llama.train", args), corpus,
                              tmp_path / "run")
    assert DCP_SINGLE not in stderr
    assert not TORCH_WARNING.search(stderr), stderr[-3000:]


@pytest.mark.slow
def test_fsdp_run_with_probe_and_resume_prints_no_torch_warning(corpus, tmp_path):
    # dp_shard=2 looks up "dp", "dp_shard_cp" (FSDP) and "dp_cp" (probe) sub-meshes on each rank.
    stderr = save_then_resume(
        lambda args: run_torchrun(2, "apps.llama.train", args), corpus, tmp_path / "run",
        "distributed.dp_shard=2", "probe.every=1")
    assert FLAT_SLICE not in stderr
    assert not TORCH_WARNING.search(stderr), stderr[-3000:]


def test_every_sub_mesh_is_looked_up_without_the_deprecation_warning():
    """HSDP x cp at world size 8 on the fake process group: each name the code asks for, the
    flattened ones, a 2-D mix (FSDP's HSDP mesh) and the expert-parallel split."""
    from lingua.parallel.expert_parallel import ep_meshes

    args = DistributedArgs(dp_replicate=2, dp_shard=2, cp=2)
    with plan_memory.fake_process_group(5, 8):
        dims = distributed.parallel_dims(args, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # any warning fails the test
            mesh = distributed.build_mesh(dims, "cpu")
            sizes = {name: mesh[name].size() for name in
                     ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp")}
            hsdp = mesh[("dp_replicate", "dp_shard_cp")]
            ep_mesh, expert_mesh = ep_meshes(mesh, 2)
            local = mesh["dp_cp"].get_local_rank()
        assert sizes == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 1, "dp": 4,
                         "dp_shard_cp": 4, "dp_cp": 8}
        assert hsdp.shape == (2, 4) and hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        assert torch.equal(hsdp.mesh.flatten(), torch.arange(8))
        assert ep_mesh.size() == 2 and expert_mesh.shape == (2, 2)
        assert local == 5   # rank 5 of the flattened data-parallel x cp ranks
        assert mesh["dp"] is mesh["dp"]   # looked up once, then kept


@pytest.mark.slow   # a fresh interpreter importing transformers and torchao: ~9 s
def test_importing_the_hf_interop_and_float8_prints_nothing():
    """transformers and peft import torchao whenever it is installed: torchao's CUDA libraries a
    CPU build cannot load ("Failed to load ..."), its missing Triton and torch's Enum deprecation
    are silenced at their source (lingua/__init__.py), and nothing else is printed."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = ("import apps.sft.train, apps.sft.prepare, lingua.checkpoint.hf\n"
            "import lingua.float8\n"
            "from transformers import LlamaForCausalLM\n"
            "import peft\n"   # the PEFT adapter check tests/test_sft_hf.py runs
            "import torchao.float8, torchao.kernel.intmm, sys\n"
            "print('torchao' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "True\n", "")
