"""Refuse at start (every rank, after the app's `parallelize`) a plan leaving a parameter out of
the layout's reductions. Covered: its DTensor mesh has each of dp_replicate, dp_shard, cp
(different tokens) and tp (partial sums) of size > 1; a plain one in a ReplicatedCompute module
needs no tp; under ep grouped experts are on the "ep" mesh. The error names plan lines to add."""

import torch.distributed as dist
from torch import nn

from lingua.errors import ConfigError
from lingua.model.weights import canonical_name
from lingua.parallel.expert_parallel import EXPERT_WEIGHTS, is_grouped_experts
from lingua.parallel.tensor_parallel import REPLICATED_MARK

REDUCED_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
SHOWN = 10   # parameters named in the message


def _ranks(mesh) -> set:
    return set(mesh.mesh.flatten().tolist())


def _params(part: nn.Module):
    """(canonical name, owning module's canonical path, module, parameter, under a
    ReplicatedCompute module) for each trainable parameter of `part`."""
    out, seen = [], set()

    def walk(module, path, replicated):
        replicated = replicated or getattr(module, REPLICATED_MARK, False)
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                out.append((canonical_name(f"{path}{pname}"), canonical_name(path.rstrip(".")),
                            module, p, replicated))
        for cname, child in module.named_children():
            walk(child, f"{path}{cname}.", replicated)

    walk(part, "", False)
    return out


NOTES = {
    "linear": "ColwiseParallel / RowwiseParallel shard a Linear as wq / wo are",
    "residual": ("SequenceParallel() replicates the weights over tp and sums their gradients "
                 "over tp, for a module on the sequence-sharded residual stream, as "
                 "attention_norm"),
    "heads": ("SequenceParallel(sequence_dim=2, use_local_output=True) replicates the weights over "
              "tp and sums their gradients over tp, for a module applied to an input split over "
              "tp on dim 2: the heads of wq's / wk's output [batch, seq, heads, head_dim], as a "
              "per-head norm is"),
}


def _tp_fix(module_path: str, module: nn.Module) -> tuple:
    """(plan, entry, note key) of the TP plan entry that covers `module`'s parameters; plan None
    when the parameter needs moving into a submodule first (entry says so)."""
    parts = module_path.split(".")
    if len(parts) >= 2 and parts[0] == "layers":
        plan, key = "block plan", ".".join(parts[2:])
    else:
        plan, key = "root plan", module_path
    if not key or any(True for _ in module.children()):
        where = f"The block's '{key}'" if key else (module_path or "The model root")
        return None, (f"{where} holds the parameter next to submodules: move it into a submodule "
                      "of its own and add that submodule to the plan"), None
    if isinstance(module, nn.Linear):
        return plan, f'"{key}": ColwiseParallel() or RowwiseParallel()', "linear"
    if "." not in key:
        return plan, f'"{key}": SequenceParallel()', "residual"
    return plan, f'"{key}": SequenceParallel(sequence_dim=2, use_local_output=True)', "heads"


def _findings(parts, env, ep: int) -> tuple:
    """(problems [(param, missing dims, tp fix or None)], whether this rank holds EP weights)."""
    dims = [d for d in REDUCED_DIMS if env.mesh[d].size() > 1]
    needed = {d: _ranks(env.mesh[d]) for d in dims}
    problems, has_ep, ranks_of = [], False, {}
    for part in parts:
        for name, module_path, module, p, replicated in _params(part):
            mesh = getattr(p, "device_mesh", None)   # DTensor
            if mesh is not None and id(mesh) not in ranks_of:   # meshes are shared: read once
                ranks_of[id(mesh)] = _ranks(mesh)
            held = ranks_of[id(mesh)] if mesh is not None else {env.rank}
            names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
            has_ep = has_ep or "ep" in names
            missing = [d for d in dims if not needed[d] <= held and not (d == "tp" and replicated)]
            if missing:
                problems.append((name, missing, _tp_fix(module_path, module)
                                 if "tp" in missing else None))
        if ep > 1:
            for path, module in part.named_modules():
                if not is_grouped_experts(module):
                    continue
                for w in EXPERT_WEIGHTS:
                    mesh = getattr(getattr(module, w), "device_mesh", None)
                    if mesh is None or "ep" not in (mesh.mesh_dim_names or ()):
                        problems.append((canonical_name(f"{path}.{w}"), ["ep"], None))
    return problems, has_ep


def _gather(findings: tuple, env) -> list:
    """Every rank's findings (only this rank's on torch's fake process group)."""
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return [findings]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, findings)
    return out


def check_parallel_coverage(parts, env, ep: int = 1) -> None:
    """Raise ConfigError on every rank when a parameter of this run's model parts is not reduced
    over every rank that needs it (see the module docstring). `ep`: distributed.ep."""
    if env.world_size == 1 or env.mesh is None:
        return
    everyone = _gather(_findings(parts, env, ep), env)
    first = {}   # each parameter once, as the first rank reporting it saw it
    for rank_problems, _ in everyone:
        for problem in rank_problems:
            first.setdefault(problem[0], problem)
    problems = list(first.values())
    # Non-grouped experts escape the per-module rule: refuse when nothing is expert-parallel.
    known = len(everyone) > 1 or env.dims.pp == 1
    no_ep = ep > 1 and known and not any(has_ep for _, has_ep in everyone)
    if problems or no_ep:
        raise ConfigError(_message(problems, env.dims, ep, no_ep))


def _message(problems: list, dims, ep: int, no_ep: bool) -> str:
    degrees = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
               "tp": dims.tp, "ep": ep}
    named = [f"{name} (not reduced over {', '.join(f'{d}={degrees[d]}' for d in missing)})"
             for name, missing, _ in problems[:SHOWN]]
    more = f" and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    if problems:
        text = (f"The parallel plan leaves {len(problems)} parameter(s) out of the gradient "
                f"reductions this layout needs, so each rank would train its own diverging copy: "
                f"{'; '.join(named)}{more}.")
    else:
        text = (f"The parallel plan splits no parameter over the ep ranks (distributed.ep={ep}): "
                "expert parallelism would be silently ignored.")
    missing = {d for _, ds, _ in problems for d in ds} | ({"ep"} if no_ep else set())
    if "tp" in missing:
        fixes = list(dict.fromkeys(fix for _, _, fix in problems if fix))
        entries = {}
        for plan, entry, _ in fixes:
            entries.setdefault(plan, []).append(entry)
        adds = [f"to the {plan}: {', '.join(e)}" for plan, e in entries.items() if plan]
        notes = [NOTES[note] for note in dict.fromkeys(n for _, _, n in fixes if n)]
        text += (" Under tensor parallelism the activations are split over the tp ranks, so each "
                 "rank's gradient of a parameter is a partial sum: every parameter must be a "
                 "DTensor on the tp mesh, named by the TP plan that the app's parallelize.py "
                 "passes to lingua.parallel.tensor_parallel.apply_tp.")
        if adds:
            text += (" Add " + "; ".join(adds) + (f" ({'; '.join(notes)})" if notes else "") + ".")
        if None in entries:
            text += " " + "; ".join(entries[None]) + "."
        text += (" A module that every tp rank should instead run whole on the all-gathered input "
                 "takes lingua.parallel.tensor_parallel.ReplicatedCompute() (as "
                 "apps/moe/parallelize.py's MoE layers).")
    if missing & {"dp_replicate", "dp_shard", "cp"}:
        text += (" Data- and context-parallel ranks hold different tokens, so every parameter must "
                 "be sharded by FSDP over them: the app's parallelize.py must end with "
                 "lingua.parallel.distributed.apply_fsdp(model, blocks, env, args), whose root "
                 "unit covers every parameter outside the blocks.")
    if "ep" in missing:
        text += (f" With distributed.ep={ep} the experts' weights must be split over the ep ranks: "
                 "the app's parallelize.py must call lingua.parallel.expert_parallel.apply_ep("
                 "model, ep_mesh) on modules with GroupedExperts' contract (w1, w3, w2 of shape "
                 "[experts, ...], forward(x, counts)) and give their FSDP the expert mesh, as "
                 "apps/moe/parallelize.py does; or remove distributed.ep.")
    return text
