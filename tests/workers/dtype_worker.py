"""What dtypes a real training run computes, stores and communicates in, for tests/test_dtypes.py.

`python -m tests.workers.dtype_worker OUT_DIR APP [train overrides]`, in one process or under
torchrun. APP is `llama` or `moe`: the worker runs `apps.<APP>.train.main(overrides)` unchanged,
having wrapped `lingua.train.loop.Run.train`, `Run.train_step` and
`lingua.train.loop.Run.eval_loss` (class attributes, in this process only),
and each rank writes OUT_DIR/rank<r>.json with:

  ops          matmul-family ops (mm, addmm, bmm, baddbmm, _grouped_mm, linear, matmul and the
               scaled-dot-product attention ops), as rows [phase, backward, module, op, dtypes,
               count]: phase is train_step, validation, optimizer or other (outside those: e.g.
               metrics' peak-FLOPs probe); backward whether autograd's engine ran it; module the
               innermost module whose forward was running ("<none>" outside any forward); dtypes
               those of the op's floating tensor arguments (DTensors too, by their .dtype).
  rope         the same rows for aten.mul run directly by an attention module (`*.attention`):
               in Attention.forward those are RoPE's rotations
               (lingua.model.layers.apply_rope).
  collectives  the same rows for c10d and functional-collective ops: FSDP's all-gathers and
               reduce-scatters, the pipeline's sends, explicit redistributions (TP's hooks, CP).
               Not seen: collectives DTensor runs inside one of its ops (an implicit
               redistribution, e.g. of a Partial gradient inside the optimizer's update), since
               the mode is off while an op it intercepted runs.
  block_outputs  [phase, dtype, count] of the transformer blocks' outputs: the residual stream.
  params       {name: dtype} of every parameter the optimizers update: the master weights, as
               this rank holds them (FSDP's sharded DTensors, TP's shards).
  grads        {name: [dtype, placements]} of the gradients when the last optimizer step began.
  optim_state  [key, dtype, count] of the optimizer state tensors (exp_avg, exp_avg_sq, step).

Ops are seen by a TorchDispatchMode, below autograd and autocast: what the kernels (or DTensor's
dispatch) actually receive, after autocast's or FSDP's casts.
"""

import importlib
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lingua.parallel import distributed
from lingua.train import loop

MATMULS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm",
           "aten.linear", "aten.matmul", "aten.scaled_dot_product_attention"}
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
BLOCK = re.compile(r"(^|\.)layers\.\d+$")


def is_matmul(name: str) -> bool:
    return name in MATMULS or name.startswith("aten._scaled_dot_product")


def float_dtypes(args, kwargs) -> tuple:
    return tuple(str(t.dtype) for t in pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.is_floating_point())


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = "other"
        self.names: dict = {}        # id(module) -> its qualified name in its model part
        self.param_names: dict = {}  # id(parameter) -> its qualified name
        self.stack: list = []        # names of the modules whose forward is running
        self.ops, self.rope, self.collectives = Counter(), Counter(), Counter()
        self.block_outputs = Counter()
        self.params: dict = {}
        self.grads: dict = {}
        self.optim_state: list = []
        self._phase_before_optimizer = "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        module = self.stack[-1] if self.stack else "<none>"
        if is_matmul(name):
            target = self.ops
        elif func.namespace in COLLECTIVE_NAMESPACES:
            target = self.collectives
        elif name == "aten.mul" and module.endswith(".attention"):
            target = self.rope
        else:
            target = None
        if target is not None:
            backward = torch._C._current_graph_task_id() != -1
            target[(self.phase, backward, module, name, float_dtypes(args, kwargs))] += 1
        return func(*args, **kwargs)

    # Global module forward hooks: the innermost running module names the ops.
    def pre_hook(self, module, args):
        self.stack.append(self.names.get(id(module), type(module).__name__))

    def post_hook(self, module, args, output):
        name = self.stack.pop() if self.stack else "?"
        if BLOCK.search(name) and isinstance(output, torch.Tensor):
            self.block_outputs[(self.phase, str(output.dtype))] += 1

    def optimizer_pre_hook(self, optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    placements = [str(x) for x in getattr(p.grad, "placements", ())]
                    self.grads[self.param_names.get(id(p), "?")] = [str(p.grad.dtype), placements]
        self._phase_before_optimizer, self.phase = self.phase, "optimizer"

    def optimizer_post_hook(self, optimizer, args, kwargs):
        self.phase = self._phase_before_optimizer

    def read_state(self, run) -> None:
        optimizers = run.optimizers.optimizers
        self.params = {self.param_names.get(id(p), "?"): str(p.dtype)
                       for opt in optimizers for group in opt.param_groups for p in group["params"]}
        state = Counter((key, str(value.dtype)) for opt in optimizers for s in opt.state.values()
                        for key, value in s.items() if isinstance(value, torch.Tensor))
        self.optim_state = [[key, dtype, n] for (key, dtype), n in sorted(state.items())]

    def result(self) -> dict:
        def rows(counter):
            return [[*key[:4], list(key[4]), n] for key, n in sorted(counter.items(), key=str)]

        return {"ops": rows(self.ops), "rope": rows(self.rope),
                "collectives": rows(self.collectives),
                "block_outputs": [[*key, n] for key, n in sorted(self.block_outputs.items())],
                "params": self.params, "grads": self.grads, "optim_state": self.optim_state}


def instrument(rec: Recorder) -> None:
    """Wrap the real trainer's Run methods (class attributes, this process only)."""
    run = loop.Run
    run_train, run_step = run.train, run.train_step
    run_val = run.eval_loss

    def train(self):
        rec.names = {id(m): n or "<root>" for part in self.parts for n, m in part.named_modules()}
        # Before any forward, so FSDP's parameters are the sharded (master) ones.
        rec.param_names = {id(p): n for part in self.parts for n, p in part.named_parameters()}
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(rec.pre_hook),
                   torch.nn.modules.module.register_module_forward_hook(rec.post_hook),
                   register_optimizer_step_pre_hook(rec.optimizer_pre_hook),
                   register_optimizer_step_post_hook(rec.optimizer_post_hook)]
        try:
            with rec:
                return run_train(self)
        finally:
            for handle in handles:
                handle.remove()
            rec.read_state(self)

    def phased(method, phase):
        def wrapper(self, *args, **kwargs):
            before, rec.phase = rec.phase, phase
            try:
                return method(self, *args, **kwargs)
            finally:
                rec.phase = before
        return wrapper

    loop.Run.train = train
    loop.Run.train_step = phased(run_step, "train_step")
    loop.Run.eval_loss = phased(run_val, "validation")


def main(out_dir: str, app: str, argv: list) -> int:
    train = importlib.import_module(f"apps.{app}.train")
    rec = Recorder()
    instrument(rec)
    code = train.main(argv)
    rank = int(os.environ.get("RANK", "0"))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "code": code, **rec.result()}, indent=1))
    return code


if __name__ == "__main__":
    # Results are written; gloo can abort interpreter teardown (see exit_process).
    distributed.exit_process(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
