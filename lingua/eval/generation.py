"""Text generation with a KV cache: greedy, temperature, top-k and top-p sampling, for any app
whose model takes `forward(tokens, cache=...)`. Each app's generate.py is the command:

    python -m apps.<app>.generate <run_dir or checkpoint_dir> --prompt "Once upon" [--help]"""

import argparse
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import torch
from omegaconf import OmegaConf

from lingua.errors import ConfigError
from lingua.model.layers import KVCache


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [b, vocab] -> next token ids [b]. temperature 0 is greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token).
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: List[int], max_new_tokens: int,
             temperature: float = 0.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_id: Optional[int] = None,
             generator: Optional[torch.Generator] = None) -> List[int]:
    """New token ids after `prompt` (stops after eos_id, which is included, or max_new_tokens)."""
    args = model.args
    total = len(prompt) + max_new_tokens
    bad_top_k = top_k is not None and top_k < 1
    bad_top_p = top_p is not None and not 0 < top_p <= 1
    if temperature < 0 or bad_top_k or bad_top_p:
        raise ConfigError(f"sampling needs temperature >= 0 (got {temperature}), top_k >= 1 "
                          f"(got {top_k}) and 0 < top_p <= 1 (got {top_p}).")
    if not prompt:
        raise ConfigError("generate: the prompt is empty; encode it with a BOS token at least.")
    if total > args.max_seq_len:
        raise ConfigError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) "
                          f"exceeds model.max_seq_len={args.max_seq_len}; shorten one of them.")
    cache = KVCache(model.layers.keys(), 1, total)
    tokens = torch.tensor([prompt], device=next(model.parameters()).device)
    out: List[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens, cache=cache)[:, -1]
        tokens = sample_next(logits, temperature, top_k, top_p, generator)[:, None]
        out.append(int(tokens))
        if eos_id is not None and out[-1] == eos_id:
            break
    return out


def load_model(target: str, model_class, args_class, device: str = "cpu"):
    """(model, tokenizer) from a run directory (newest checkpoint) or a checkpoint, in eval mode."""
    from lingua.checkpoint import load_model_state, read_run_config, resolve
    from lingua.data.tokenizer import TokenizerArgs, build_tokenizer

    ckpt_dir = resolve(target)
    cfg = read_run_config(ckpt_dir)
    args = args_class(**OmegaConf.to_container(cfg.model, resolve=True))
    args.attn_backend = "sdpa"  # decoding always runs sdpa with the cache's mask
    with torch.device("meta"):
        model = model_class(args)
    model.to_empty(device=device)
    model.init_rope(device)
    with warnings.catch_warnings():  # a single-process load is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_model_state(ckpt_dir, model)
    tok_cfg = cfg.get("data", {}).get("tokenizer", {}) or {}
    tok_args = OmegaConf.to_container(OmegaConf.create(tok_cfg), resolve=True)
    tokenizer = build_tokenizer(TokenizerArgs(**tok_args))
    return model.eval(), tokenizer


def main(argv, prog: str, model_class, args_class) -> None:
    """The command `prog` (`python -m apps.<app>.generate`) for an app's model and args."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("checkpoint_dir", help="a run directory (its newest complete checkpoint) or "
                                          "<dump_dir>/checkpoints/<step>")
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--prompts-file", help="one prompt per line (empty lines skipped)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ns = p.parse_args(argv)
    try:
        prompts = list(ns.prompt)
        if ns.prompts_file:
            path = Path(ns.prompts_file)
            if not path.is_file():
                raise ConfigError(f"--prompts-file {path} does not exist.")
            prompts += [line for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ConfigError("no prompt given: pass --prompt TEXT (repeatable) or --prompts-file "
                              "FILE.")
        model, tok = load_model(ns.checkpoint_dir, model_class, args_class, ns.device)
        gen = torch.Generator(device=ns.device).manual_seed(ns.seed)
        for text in prompts:
            ids = generate(model, tok.encode(text, add_bos=True, add_eos=False), ns.max_new_tokens,
                           ns.temperature, ns.top_k, ns.top_p, tok.eos_id, gen)
            if ids and ids[-1] == tok.eos_id:
                ids = ids[:-1]
            print(f"prompt: {text}\ncompletion: {tok.decode(ids)}\n", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

