"""Train a LLaMA: `python -m apps.llama.train [config=PRESET] [key=value ...]`.

Several processes: `torchrun --nproc-per-node N -m apps.llama.train distributed.dp_shard=N ...`.
Reads top to bottom: config, processes, model, optimizer, data, resume, loop.
"""

import contextlib
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from apps.llama.model import LlamaArgs, Transformer, validate_model_args
from apps.llama.parallelize import parallelize_llama, uses_loss_parallel
from apps.llama.tp_plan import validate_tp
from lingua import checkpoint, config, data, distributed, evaluation, metrics, optim, pipeline
from lingua.checkpoint import CheckpointArgs
from lingua.context_parallel import cp_batch, validate_cp
from lingua.data import DataArgs
from lingua.distributed import DistributedArgs
from lingua.errors import ConfigError
from lingua.evaluation import EvalArgs
from lingua.metrics import LoggingArgs
from lingua.optim import OptimArgs
from lingua.tensor_parallel import check_async_tp, loss_parallel_context
from lingua.tokenizer import build_tokenizer
from lingua.transformer import check_attn_backend

logger = logging.getLogger("train")


@dataclass
class TrainArgs:
    dump_dir: str = "runs/debug"
    steps: int = 100
    seed: int = 42
    gc_every: int = 50              # collect garbage every N steps (automatic GC is off: it stalls)
    model: LlamaArgs = field(default_factory=LlamaArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)


config.register_schema("llama_schema", TrainArgs)


def validate(args: TrainArgs) -> None:
    """Every check that needs no process group, device or write: runs before any work starts."""
    config.check_positive(args, "", ["steps"])
    validate_model_args(args.model)
    check_attn_backend(args.model.attn_backend, "cuda" if torch.cuda.is_available() else "cpu")
    data.validate_data_args(args.data)
    vocab = build_tokenizer(args.data.tokenizer).vocab_size
    config.require(vocab <= args.model.vocab_size,
                   f"The tokenizer ({args.data.tokenizer.kind}) has {vocab} tokens but "
                   f"model.vocab_size={args.model.vocab_size}. Set model.vocab_size={vocab} or more.")
    config.require(args.data.seq_len <= args.model.max_seq_len,
                   f"data.seq_len={args.data.seq_len} is longer than model.max_seq_len="
                   f"{args.model.max_seq_len}. Raise model.max_seq_len or shorten data.seq_len.")
    optim.validate_args(args.optim, args.steps)
    distributed.validate_args(args.distributed)
    d = args.distributed
    pipeline.validate_pp(args.model.n_layers, d.pp, d.pp_virtual_stages, d.pp_schedule,
                         d.pp_microbatches, args.data.batch_size, args.model.tie_embeddings,
                         d.pp_split)
    validate_tp(args.model, d.tp, args.data.seq_len)
    validate_cp(args.data.seq_len, d.cp, d.tp, d.cp_backend,
                "cuda" if torch.cuda.is_available() else "cpu", args.model.attn_mask == "block_causal")
    check_async_tp(d.async_tp, "cuda" if torch.cuda.is_available() else "cpu", d.compile)
    checkpoint.validate_args(args.checkpoint)
    evaluation.validate_args(args.eval)
    # Resuming is only exact with the same model and the same data stream.
    checkpoint.check_resume_compatible(args.dump_dir, config.to_dict(args),
                                       ("model", "seed", "data.format", "data.seq_len"))


def doc_ids_of(batch, args: TrainArgs):
    # Document ids cost a mask per forward: pass them only when the model masks by document.
    return batch.doc_ids if args.model.attn_mask == "block_causal" else None


@contextlib.contextmanager
def sequence_shard(parts, batch, args: TrainArgs, env):
    """This rank's (tokens, labels, doc_ids, positions) of a micro-batch. With context
    parallelism each rank keeps a head and a tail chunk of the sequence, and the attention
    context (global positions, document ids) is set for the forward and backward inside."""
    tokens, labels = batch.tokens.to(env.device), batch.labels.to(env.device)
    doc_ids = doc_ids_of(batch, args)
    doc_ids = None if doc_ids is None else doc_ids.to(env.device)
    if args.distributed.cp == 1:
        yield tokens, labels, doc_ids, None
        return
    with cp_batch(parts, tokens, labels, doc_ids) as local:
        # The CP attention masks by document itself, from the full-sequence ids it was given.
        yield local.tokens, local.labels, None, local.positions


def loss_sum(model, tokens, labels, doc_ids, positions) -> torch.Tensor:
    """Summed token cross-entropy of one micro-batch through a whole (unpipelined) model."""
    return evaluation.token_loss_sum(model(tokens, doc_ids, positions=positions), labels)


def train_step(parts, pipe, micro_batches, global_tokens: int, args: TrainArgs, env) -> torch.Tensor:
    """Forward/backward over this rank's micro-batches. Returns this rank's share of the global
    mean loss (summed over the ranks that hold distinct tokens, it is the step's loss)."""
    share = torch.zeros((), dtype=torch.float64, device=env.device)
    with loss_parallel_context(uses_loss_parallel(args.distributed)):
        for batch in micro_batches:
            with sequence_shard(parts, batch, args, env) as (tokens, labels, doc_ids, positions):
                if pipe is not None:
                    out = pipe.step(tokens, labels, doc_ids)
                    share += 0.0 if out is None else out.double()
                    continue
                with mixed_precision(args, env):
                    token_loss = loss_sum(parts[0], tokens, labels, doc_ids, positions)
                # Dividing by the global batch's token count (and summing gradients over ranks)
                # makes the gradient that of the mean loss over the global batch, whatever the
                # layout.
                (token_loss / global_tokens).backward()
                share += token_loss.detach().double() / global_tokens
    return share


def validation_loss(parts, pipe, batches, args: TrainArgs, env) -> dict:
    def batch_loss(batch):
        with sequence_shard(parts, batch, args, env) as (tokens, labels, doc_ids, positions):
            if pipe is not None:
                return pipe.eval_loss(tokens, labels, doc_ids, loss_fn=evaluation.token_loss_sum)
            with mixed_precision(args, env):
                return loss_sum(parts[0], tokens, labels, doc_ids, positions)

    with loss_parallel_context(uses_loss_parallel(args.distributed)):
        return evaluation.evaluate(parts, batches, env, batch_loss)


def main(argv=None) -> int:
    args = config.load("llama", TrainArgs, argv, validate)
    env = distributed.init(args.distributed)
    metrics.setup_logging(env.rank)
    gc.disable()
    dump_dir = Path(args.dump_dir)

    if args.data.prepare_embedded:
        if env.local_rank == 0:
            data.ensure_embedded_corpus(args.data.root)
        distributed.barrier(env)
    if env.is_main:
        dump_dir.mkdir(parents=True, exist_ok=True)
        config.dump(args, dump_dir / "config.yaml")

    torch.manual_seed(args.seed)
    parts, stage_ids = build_model_parts(args, env)
    optimizers = optim.Optimizers(parts, args.optim, args.steps, env.device)

    train_loader = data.build_train_loader(args.data, env.dp_rank, env.dp_size, args.seed)
    val_batches = data.build_val_batches(args.data, env.dp_rank, env.dp_size)
    global_batch = args.data.batch_size * env.dp_size * args.data.grad_accum
    global_tokens = global_batch * args.data.seq_len
    pipe = build_pipeline(parts, stage_ids, args, env, global_tokens)

    step = 0
    resume_from = checkpoint.newest(dump_dir)
    if resume_from is not None:
        state = checkpoint.load(resume_from, parts, optimizers.optimizers, env.rank,
                                env.world_size)
        step = state["step"]
        train_loader.load_state_dict(state["data"])
        optimizers.load_scheduler_state(state["scheduler"])

    with torch.device("meta"):  # FLOPs of the whole model, whatever this rank holds
        flops_per_token = metrics.flops_per_token(Transformer(args.model), args.model.n_layers,
                                                  args.model.dim, args.data.seq_len,
                                                  args.model.tie_embeddings)
    peak = metrics.peak_flops(env.device, args.distributed.model_dtype)
    log = metrics.MetricLogger(dump_dir, args.logging, config.to_dict(args), env.is_main, step)
    config_yaml = config.to_yaml(args)
    window = metrics.Window()
    pp_group = env.mesh["pp"].get_group() if env.dims.pp > 1 else None
    logger.info("training steps %d -> %d, global batch %d x %d tokens", step, args.steps,
                global_batch, args.data.seq_len)

    while step < args.steps:
        t0 = time.perf_counter()
        micro_batches = train_loader.next_step()
        t_data = time.perf_counter() - t0
        loss_share = train_step(parts, pipe, micro_batches, global_tokens, args, env)
        grad_norm = optim.clip_grad_norm(parts, args.optim.clip, pp_group)
        lr = optimizers.lr
        optimizers.step()
        step += 1
        if args.gc_every > 0 and step % args.gc_every == 0:
            gc.collect(1)

        window.add(time.perf_counter() - t0, t_data, global_tokens)
        last = step == args.steps
        if step % args.logging.every == 0 or last:
            tokens_per_s = window.tokens_per_s()
            row = {"step": step, "loss": distributed.all_reduce_sum(loss_share, env).item(),
                   "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_s,
                   "mfu": flops_per_token * tokens_per_s / env.world_size / peak,
                   "data_s": window.data_s(), "step_s": window.step_s(),
                   "peak_mem_gib": metrics.peak_memory_gib(env.device),
                   "skipped_lines": train_loader.skipped_lines}
            if (args.eval.every and step % args.eval.every == 0) or (last and args.eval.at_end):
                row.update(validation_loss(parts, pipe, val_batches, args, env))
            window.reset()
            log.log(row)
            if env.is_main:
                logger.info(metrics.format_line(row))
        if (args.checkpoint.every and step % args.checkpoint.every == 0) or (
                last and args.checkpoint.save_final):
            train_state = {"step": step, "data": train_loader.state_dict(),
                           "scheduler": optimizers.scheduler_state()}
            checkpoint.save(dump_dir, step, parts, optimizers.optimizers, train_state,
                            config_yaml, env.rank, env.world_size, args.checkpoint.keep)

    log.close()
    if env.is_main:
        logger.info("done: run directory %s (config.yaml, metrics.jsonl, checkpoints/)",
                    dump_dir.resolve())
    distributed.destroy()
    return 0


def build_model_parts(args: TrainArgs, env) -> tuple:
    """The parts of the model this rank holds (one, or its pipeline stages), parallelized and
    with weights: from a Hugging Face directory or freshly initialised from the seed."""
    if args.checkpoint.init_from:
        model = load_init_from(args)
    else:
        with torch.device("meta"):
            model = Transformer(args.model)
        if env.device.type == "cpu":
            # On CPU we initialise the full model on every rank before splitting and sharding:
            # the same seed then gives the same weights for every layout (a sharded random init
            # would not, on CPU, and each pipeline stage would draw different numbers).
            model.to_empty(device="cpu")
            model.init_weights()
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
    parts = [parallelize_llama(part, env, args.distributed) for part in parts]
    if next(parts[0].parameters()).device.type == "meta":  # CUDA: initialise after sharding
        for part in parts:
            part.to_empty(device=env.device)
            with torch.no_grad():
                part.init_weights(buffer_device=env.device)
    n_params = sum(p.numel() for part in parts for p in part.parameters())
    logger.info("model: %.2fM parameters on this rank's %d part(s)", n_params / 1e6, len(parts))
    return parts, stage_ids


def build_pipeline(parts, stage_ids, args: TrainArgs, env, global_tokens: int):
    d = args.distributed
    if d.pp == 1:
        return None

    def loss_fn(logits, labels):
        return evaluation.token_loss_sum(logits, labels) / global_tokens

    n_microbatches = d.pp_microbatches or pipeline.default_microbatches(d.pp, d.pp_virtual_stages)
    return pipeline.build_schedule(parts, stage_ids, d.pp * d.pp_virtual_stages, env.mesh["pp"],
                                   env.device, d.pp_schedule, n_microbatches, loss_fn)


def load_init_from(args: TrainArgs):
    from apps.llama.hf import load_hf

    hf_model, hf_args = load_hf(args.checkpoint.init_from)
    # Only what fixes the weights' shapes and meaning must agree; backends, masks and init
    # settings are the run's own choice.
    runtime = {"attn_backend", "attn_mask", "init_std", "depth_init", "max_seq_len"}
    ours, theirs = config.to_dict(args.model), config.to_dict(hf_args)
    differing = {k: (ours[k], theirs[k]) for k in ours if k not in runtime and ours[k] != theirs[k]}
    config.require(not differing,
                   f"checkpoint.init_from={args.checkpoint.init_from} holds a model that differs "
                   f"from model.* in (ours, theirs): {differing}. Set those model.* keys to "
                   f"the checkpoint's values.")
    model = Transformer(args.model)  # our runtime choices, their weights
    model.load_state_dict(hf_model.state_dict())
    return model


def mixed_precision(args: TrainArgs, env):
    """bf16 compute with fp32 master weights: FSDP casts when sharded, autocast in one process."""
    if args.distributed.model_dtype == "bf16" and env.world_size == 1:
        return torch.autocast(env.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


if __name__ == "__main__":
    try:
        code = main()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    # Leave without running interpreter teardown: with gloo, a collective's worker thread can
    # still be joinable at exit and abort the process ("terminate called without an active
    # exception") after all work is done and saved, turning a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
