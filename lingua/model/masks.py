"""What a model's attention may see, said once (`Decoder.mask_spec`; apps/swa sets a window):
`AttentionMask` and its one rule, `allowed`, from which every backend (layers.py) and context
parallelism build their masks, at global positions (a token's place in its row, whichever shard or
cache holds it). Documents are not a field: doc_ids come with model.attn_mask=block_causal."""

from dataclasses import dataclass
from typing import Optional

import torch

from lingua.errors import ConfigError


@dataclass(frozen=True)
class AttentionMask:
    causal: bool = True            # keys at or before the query only
    window: Optional[int] = None   # sliding window: the `window` nearest positions (self included)
    sink_tokens: int = 0           # with a window: a row's first N stay visible, within documents

    def __post_init__(self):
        if (self.window is not None and self.window < 1) or self.sink_tokens < 0:
            raise ConfigError(f"{self}: the window must be at least 1 position (or None for no "
                              "window) and sink_tokens at least 0; fix the model's mask_spec.")

    @property
    def plain_causal(self) -> bool:
        return self == AttentionMask()

    def allowed(self, q_pos, k_pos, q_doc=None, k_doc=None) -> torch.Tensor:
        """May the query at q_pos attend to the key at k_pos (broadcast; documents when masked)?"""
        ok = k_pos <= q_pos if self.causal else torch.ones_like(q_pos - k_pos, dtype=torch.bool)
        if self.window is not None:
            ok = ok & (((q_pos - k_pos).abs() < self.window) | (k_pos < self.sink_tokens))
        if q_doc is not None:
            ok = ok & (q_doc == k_doc)
        return ok

    def dense(self, q_pos: torch.Tensor, k_pos: torch.Tensor,
              doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Boolean [b or 1, 1, queries, keys] (True: attend) for sdpa, from global positions
        q_pos [sq] and k_pos [sk], and doc_ids [b, S] of the whole rows when documents count."""
        docs = () if doc_ids is None else (doc_ids[:, q_pos, None], doc_ids[:, None, k_pos])
        ok = self.allowed(q_pos[:, None], k_pos[None, :], *docs)
        return ok.view(-1, 1, *ok.shape[-2:])
