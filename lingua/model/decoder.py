"""The decoder shell every app's model is: embeddings, RoPE tables, mask, layer loop, final norm
and output projection. An app subclasses `Decoder` and builds one layer in `make_layer`.

The contract lingua relies on and a fork keeps (checked at start by `check_model_contract`):
- `forward(tokens, doc_ids=None, cache=None, positions=None)`: tokens [b, s] -> logits; a stage
  without `tok_embeddings` takes hidden states [b, s, dim], one without `output` returns them.
  doc_ids [b, s] keep attention in documents; `positions` [s]: when not 0..s-1 (a CP shard).
- `layers`, an nn.ModuleDict keyed "0".."n-1": a pipeline stage deletes those it does not hold,
  and sets `first_stage_modules` / `last_stage_modules` it does not own to None.
- the loss seam's extra inputs (loss.py: `batch_inputs`) arrive as forward keyword arguments on
  every stage. In training a part may return (output, extras...); under pp the extras reach the
  next stage as keywords named by the model's `stage_outputs` (apps/moe: the balancing losses).
- `init_weights(buffer_device=None)` (re)initialises everything after `to_empty`; each layer's
  `init_weights(std, out_std)` its own weights.
- layers are called `layer(h, rope, mask, cache)`; softmax attention goes through CoreAttention
  (CP swaps it, the probe hooks it); a recurrent layer keeps decoding state in `cache.states`.
- `mask_spec` (masks.AttentionMask): what attention may see; every backend and CP use it."""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lingua.errors import ConfigError
from lingua.model.layers import (
    CoreAttention,
    KVCache,
    RMSNorm,
    TransformerArgs,
    check_attn_backend,
    make_attn_mask,
    rope_tables,
    validate_transformer_args,
)
from lingua.model.masks import AttentionMask


class Decoder(nn.Module):
    """A decoder-only transformer around the layers an app builds; see the module docstring."""

    # Modules only the first / last pipeline stage holds (split_model sets them to None elsewhere).
    first_stage_modules = ("tok_embeddings",)
    last_stage_modules = ("norm", "output")

    def __init__(self, args: TransformerArgs):
        super().__init__()
        validate_transformer_args(args)
        if args.attn_backend == "xformers":  # fail at construction, not deep inside forward
            check_attn_backend("xformers", "cuda" if torch.cuda.is_available() else "cpu")
        self.args = args
        self.attn_backend = args.attn_backend  # fixed at construction, like the layers' kernels
        self.mask_spec = AttentionMask()   # a fork sets its own (apps/swa: a sliding window)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_layer(i, args)
                                     for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = (None if args.tie_embeddings
                       else nn.Linear(args.dim, args.vocab_size, bias=False))
        # Not persistent: derived from args, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if self.tok_embeddings.weight.is_meta:   # nothing to fill: shapes only, quickly
            self.init_rope()
        else:
            self.init_weights()   # on the meta device, call it after to_empty

    def make_layer(self, layer_id: int, args: TransformerArgs) -> nn.Module:
        raise NotImplementedError("an app's model subclasses Decoder and builds its layers here")

    def init_rope(self, device=None) -> None:
        device = device if device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(self.args, device)

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        """(Re)initialise all parameters and RoPE tables. Layer i's residual-branch outputs start
        at std / sqrt(2 (i + 1)) (depth_init) or std / sqrt(2 n_layers): variance flat in depth."""
        self.init_rope(buffer_device)
        a = self.args
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=a.init_std)
        for name, layer in self.layers.items():
            depth = 2 * (int(name) + 1) if a.depth_init else 2 * a.n_layers
            layer.init_weights(a.init_std, a.init_std / math.sqrt(depth))
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=a.init_std)

    def rope_and_mask(self, seq_len: int, doc_ids, cache: Optional[KVCache], positions, device):
        """(cos, sin) for these positions and the attention mask, built once for all layers."""
        start = 0 if cache is None else cache.pos
        if start + seq_len > self.rope_cos.shape[0]:
            raise ConfigError(f"sequence of {start + seq_len} tokens exceeds model.max_seq_len="
                              f"{self.args.max_seq_len}; raise model.max_seq_len.")
        pos = positions if positions is not None else slice(start, start + seq_len)
        rope = (self.rope_cos[pos], self.rope_sin[pos])
        if cache is not None:
            return rope, cache.attn_mask(seq_len, device, self.mask_spec)
        return rope, make_attn_mask(self.attn_backend, doc_ids, seq_len, device, self.mask_spec)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output; hidden states pass through on a stage before the last."""
        if self.output is not None:
            return self.output(self.norm(h))
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.norm is not None:
            return F.linear(self.norm(h), self.tok_embeddings.weight)
        return h

    def trunk(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
              cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None) -> tuple:
        """Embeddings and layers: (hidden states, rope, mask) before the head (apps/mtp)."""
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        # Under SP h is a DTensor shaped like the whole sequence (as attention sees it).
        rope, mask = self.rope_and_mask(h.shape[1], doc_ids, cache, positions, h.device)
        for layer in self.layers.values():
            h = layer(h, rope, mask, cache)
        if cache is not None:
            cache.pos += h.shape[1]
        return h, rope, mask

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [b, s] (later stages: hidden states) -> logits (earlier stages: hidden states)."""
        h, _, _ = self.trunk(tokens, doc_ids, cache, positions)
        return self.head(h)


def check_model_contract(model: nn.Module, where: str, context_parallel: bool = False) -> None:
    """ConfigError if `model` (meta, unparallelized) breaks the module docstring's contract, or
    with `context_parallel` attends outside CoreAttention (in its shard). `where`: model file."""
    problems = []
    for name in ("tok_embeddings", "norm", "output", "layers", "args"):
        if not hasattr(model, name):
            problems.append(f"no attribute `{name}`")
    layers = getattr(model, "layers", None)
    if layers is not None and not isinstance(layers, nn.ModuleDict):
        problems.append(f"`layers` is a {type(layers).__name__}, not an nn.ModuleDict")
    elif layers is not None and list(layers) != [str(i) for i in range(len(layers))]:
        problems.append(f"`layers` is keyed {list(layers)[:4]}..., "
                        f"not \"0\"..\"{len(layers) - 1}\"")
    for name in ("init_weights", "forward"):
        if not callable(getattr(model, name, None)):
            problems.append(f"no method `{name}`")
    import inspect

    params = inspect.signature(model.forward).parameters
    for name in ("doc_ids", "cache", "positions"):
        if name not in params:
            problems.append(f"forward() takes no `{name}` argument")
    for name, layer in (layers.items() if isinstance(layers, nn.ModuleDict) else ()):
        if not callable(getattr(layer, "init_weights", None)):
            problems.append(f"layer {name} ({type(layer).__name__}) has no "
                            "init_weights(std, out_std)")
        if context_parallel and not any(isinstance(m, CoreAttention) for m in layer.modules()):
            problems.append(f"layer {name} ({type(layer).__name__}) does not attend through "
                            "lingua.model.layers.CoreAttention")
        if problems:
            break
    if problems:
        raise ConfigError(
            f"The model of {where} does not keep the contract the trainer relies on: "
            f"{'; '.join(problems)}. See the docstring of lingua/model/decoder.py (subclassing "
            f"lingua.model.decoder.Decoder keeps it) and docs/forking.md.")
