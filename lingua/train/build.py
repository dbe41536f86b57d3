"""This rank's model: built on the meta device, split into pipeline stages, parallelized by the
app's plan, then given storage and weights (fresh from the seed, or checkpoint.init_from); and the
autocast that distributed.model_dtype=bf16 needs where nothing else casts."""

import contextlib
import logging

import torch

from lingua import float8
from lingua.checkpoint import hf
from lingua.model import decoder, lora, weights
from lingua.parallel import coverage, distributed, pipeline
from lingua.parallel.distributed import DistEnv
from lingua.train.app import App

logger = logging.getLogger("train")


def build_model_parts(args, env: DistEnv, app: App) -> tuple:
    """The parts of the model this rank holds, parallelized, with weights (HF or from the seed).
    Storage comes only after splitting and sharding, so no rank ever holds the whole model."""
    torch.manual_seed(args.seed)
    hf_state = hf.load_init_from(args, app, env) if args.checkpoint.init_from else None
    parts, stage_ids = parallelized_parts_on_meta(args, env, app)
    param_device = distributed.param_device(args.distributed, env.device)
    for part in parts:
        weights.materialize(part, env.device, args.seed, param_device)
    if args.checkpoint.init_from:
        weights.load_full_state(parts, hf_state, env.device, keep=lora.is_adapter)
        del hf_state
    weights.check_placement(parts, env.device, param_device)
    n_params = sum(p.numel() for part in parts for p in part.parameters())
    # The device is named so a launch that gave tasks the wrong GPU (or none) shows at once.
    logger.info("model: %.2fM parameters on this rank's %d part(s), on %s (%s compute)",
                n_params / 1e6, len(parts), env.device, args.distributed.model_dtype)
    return parts, stage_ids


def parallelized_parts_on_meta(args, env: DistEnv, app: App) -> tuple:
    """(parts, stage ids) on meta, parallelized and coverage-checked (trainer and planner)."""
    with torch.device("meta"):
        model = app.model_class(args.model)
    if app.transform_model is not None:
        app.transform_model(model, args)
    # What the loop, pipeline and context parallelism rely on (lingua/model/decoder.py), named if
    # missing.
    decoder.check_model_contract(model, app.model_class.__module__.replace(".", "/") + ".py",
                                 context_parallel=args.distributed.cp > 1)
    stage_ids, parts = [0], [model]
    if env.dims.pp > 1:
        d = args.distributed
        stage_ids = pipeline.stage_ids_of_rank(env.local_rank_in("pp"), d.pp, d.pp_virtual_stages,
                                               d.pp_schedule)
        n_stages = d.pp * d.pp_virtual_stages
        layers = pipeline.stage_layer_ids(args.model.n_layers, n_stages, d.pp_split)
        parts = [pipeline.split_model(model, layers[s], s == 0, s == n_stages - 1)
                 for s in stage_ids]
        del model
    d = args.distributed
    for part in parts:   # float8 before any parallelism (lingua/float8/__init__.py)
        float8.apply_float8(part, d.float8, app.float8_filter or float8.default_filter,
                            float8.uses_fsdp_float8_all_gather(d, env.dims, env.device.type),
                            emulate=env.device.type != "cuda")
    parts = [app.parallelize(part, env, d) for part in parts]
    # A parameter the app's plan left out of a reduction would train silently wrong: refuse.
    coverage.check_parallel_coverage(parts, env, args.distributed.ep)
    return parts, stage_ids


def mixed_precision(args, env: DistEnv, parts: list):
    """Where distributed.model_dtype=bf16 needs autocast: FSDP2 casts parameters itself, every
    other layout would silently compute in fp32. Parameters, gradients and optimizer state: fp32."""
    from torch.distributed.fsdp import FSDPModule

    if args.distributed.model_dtype != "bf16" or all(isinstance(p, FSDPModule) for p in parts):
        return contextlib.nullcontext()
    return torch.autocast(env.device.type, dtype=torch.bfloat16)
