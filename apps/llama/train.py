"""Train a LLaMA: `python -m apps.llama.train [config=PRESET] [key=value ...]`.

Several processes: `torchrun --nproc-per-node N -m apps.llama.train distributed.dp_shard=N ...`.
Reads top to bottom: config, processes, model, optimizer, data, resume, loop.
"""

import contextlib
import gc
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from apps.llama.model import LlamaArgs, Transformer, validate_model_args
from apps.llama.parallelize import parallelize_llama
from lingua import checkpoint, config, data, distributed, evaluation, metrics, optim
from lingua.checkpoint import CheckpointArgs
from lingua.data import DataArgs
from lingua.distributed import DistributedArgs
from lingua.errors import ConfigError
from lingua.evaluation import EvalArgs
from lingua.metrics import LoggingArgs
from lingua.optim import OptimArgs
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
    checkpoint.validate_args(args.checkpoint)
    evaluation.validate_args(args.eval)
    # Resuming is only exact with the same model and the same data stream.
    checkpoint.check_resume_compatible(args.dump_dir, config.to_dict(args),
                                       ("model", "seed", "data.format", "data.seq_len"))


def forward(model, batch):
    device = batch_device(model)
    # Document ids cost a mask per forward: pass them only when the model masks by document.
    doc_ids = batch.doc_ids.to(device) if model.args.attn_mask == "block_causal" else None
    return model(batch.tokens.to(device), doc_ids)


def batch_device(model) -> torch.device:
    return model.tok_embeddings.weight.device


def train_step(model, micro_batches, global_tokens: int, autocast) -> torch.Tensor:
    """Forward/backward over this rank's micro-batches; returns the summed token loss."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    for batch in micro_batches:
        with autocast():
            logits = forward(model, batch)
        token_loss = evaluation.token_loss_sum(logits, batch.labels.to(logits.device))
        # Dividing by the global batch's token count (and summing gradients over ranks) makes the
        # gradient that of the mean loss over the global batch, whatever the layout.
        (token_loss / global_tokens).backward()
        loss_sum += token_loss.detach().double().cpu()
    return loss_sum


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
    model = build_model(args, env)
    parts = [model]
    logger.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    optimizers = optim.Optimizers(parts, args.optim, args.steps, env.device)

    train_loader = data.build_train_loader(args.data, env.dp_rank, env.dp_size, args.seed)
    val_batches = data.build_val_batches(args.data, env.dp_rank, env.dp_size)
    global_batch = args.data.batch_size * env.dp_size * args.data.grad_accum
    global_tokens = global_batch * args.data.seq_len

    step = 0
    resume_from = checkpoint.newest(dump_dir)
    if resume_from is not None:
        state = checkpoint.load(resume_from, parts, optimizers.optimizers, env.rank,
                                env.world_size)
        step = state["step"]
        train_loader.load_state_dict(state["data"])
        optimizers.load_scheduler_state(state["scheduler"])

    flops_per_token = metrics.flops_per_token(model, args.model.n_layers, args.model.dim,
                                              args.data.seq_len, args.model.tie_embeddings)
    peak = metrics.peak_flops(env.device, args.distributed.model_dtype)
    autocast = mixed_precision(args, env)
    log = metrics.MetricLogger(dump_dir, args.logging, config.to_dict(args), env.is_main, step)
    config_yaml = config.to_yaml(args)
    window = metrics.Window()
    logger.info("training steps %d -> %d, global batch %d x %d tokens", step, args.steps,
                global_batch, args.data.seq_len)

    while step < args.steps:
        t0 = time.perf_counter()
        micro_batches = train_loader.next_step()
        t_data = time.perf_counter() - t0
        loss_sum = train_step(model, micro_batches, global_tokens, autocast)
        grad_norm = optim.clip_grad_norm(parts, args.optim.clip)
        lr = optimizers.lr
        optimizers.step()
        step += 1
        if args.gc_every > 0 and step % args.gc_every == 0:
            gc.collect(1)

        window.add(time.perf_counter() - t0, t_data, global_tokens)
        last = step == args.steps
        if step % args.logging.every == 0 or last:
            loss = distributed.all_reduce_sum(loss_sum.to(env.device), env).item() / global_tokens
            tokens_per_s = window.tokens_per_s()
            row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(),
                   "tokens_per_s": tokens_per_s,
                   "mfu": flops_per_token * tokens_per_s / env.world_size / peak,
                   "data_s": window.data_s(), "step_s": window.step_s(),
                   "peak_mem_gib": metrics.peak_memory_gib(env.device),
                   "skipped_lines": train_loader.skipped_lines}
            if (args.eval.every and step % args.eval.every == 0) or (last and args.eval.at_end):
                row.update(evaluation.evaluate(model, val_batches, env, forward))
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


def build_model(args: TrainArgs, env) -> torch.nn.Module:
    """Meta-device build, then weights: from a Hugging Face directory or freshly initialised."""
    if args.checkpoint.init_from:
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
        return parallelize_llama(model.to(env.device), env, args.distributed)
    with torch.device("meta"):
        model = Transformer(args.model)
    if env.device.type == "cpu":
        # On CPU we initialise the full model on every rank before sharding: the same seed then
        # gives the same weights for every layout (sharded random init would not, on CPU).
        model.to_empty(device="cpu")
        model.init_weights()
        return parallelize_llama(model, env, args.distributed)
    model = parallelize_llama(model, env, args.distributed)
    model.to_empty(device=env.device)
    with torch.no_grad():
        model.init_weights(buffer_device=env.device)
    return model


def mixed_precision(args: TrainArgs, env):
    """bf16 compute with fp32 master weights: FSDP casts when sharded, autocast in one process."""
    if args.distributed.model_dtype == "bf16" and env.world_size == 1:
        return lambda: torch.autocast(env.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
