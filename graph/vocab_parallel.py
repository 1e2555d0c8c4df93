"""Greedy drafting over a vocabulary split across tensor-parallel ranks: one collective between draft positions.
Each rank's candidate is gathered: its largest logit, that token's global id and the token's embedding row.
"""
from __future__ import annotations

from typing import Callable

import torch

#: a candidate row: (largest local logit, its global token id, then the embedding row when asked for)
CANDIDATE_STATS = 2


def local_candidate(local_logits: torch.Tensor, vocab_start: int,
                    embed_local: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """``local_logits [B, n]``: this rank's slice of the vocabulary (ids ``vocab_start .. vocab_start + n``, padding
    cut off). ``embed_local``: local row index → embedding rows, or None when no next position needs one.
    Returns ``[B, 2 (+ D)]`` float32 (exact for token ids below 2**24 and for bf16 / fp16 / fp32 rows)."""
    value, index = local_logits.max(dim=-1)  # first occurrence on ties, as argmax
    parts = [value.float().unsqueeze(-1), (index + vocab_start).float().unsqueeze(-1)]
    if embed_local is not None:
        parts.append(embed_local(index).float())
    return torch.cat(parts, dim=-1)


def pick_candidate(gathered: torch.Tensor, num_ranks: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``gathered [B, num_ranks * F]``: every rank's candidate, in rank order. Returns the greedy token ``[B]``
    (int64) and its embedding ``[B, D]`` in ``dtype`` (None when the candidates carry none)."""
    b = gathered.shape[0]
    cand = gathered.view(b, num_ranks, -1)
    rank = cand[:, :, 0].argmax(dim=-1)  # first occurrence: the lowest rank on ties
    best = torch.gather(cand, 1, rank.view(b, 1, 1).expand(b, 1, cand.shape[-1])).squeeze(1)
    token = best[:, 1].long()
    emb = best[:, CANDIDATE_STATS:].to(dtype) if cand.shape[-1] > CANDIDATE_STATS else None
    return token, emb
