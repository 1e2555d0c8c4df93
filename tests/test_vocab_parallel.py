"""The vocabulary-parallel greedy head: each rank's candidate (largest logit, its id, its embedding row) gathered
once gives the full-logits argmax and the all-reduced embedding bit for bit, ties included; chained in the draft
step it drafts what the gathered-logits path drafts. Ranks are simulated in one process (slices of one tensor,
``torch.cat`` for the all-gather); the vLLM TP 2 run is ``tests/test_vllm_tp.py``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascend_spec.config import SpeculativeConfig
from ascend_spec.graph.vocab_parallel import local_candidate, pick_candidate
from ascend_spec.proposer import MtpProposer
from ascend_spec.tokenizer import TextTokenizer

from .conftest import record_draft_calls


def vocab_slices(vocab: int, ranks: int) -> list[tuple[int, int]]:
    """vLLM's split: the vocabulary padded to a multiple of 64, cut evenly; the last slices hold the padding."""
    per = -(-(-(-vocab // 64) * 64) // ranks)
    return [(min(r * per, vocab), min((r + 1) * per, vocab)) for r in range(ranks)]


def gather_candidates(logits: torch.Tensor, table: torch.Tensor | None, ranks: int) -> torch.Tensor:
    """What each rank would all-gather (dim -1, rank order), from its slice of the full logits and table."""
    parts = []
    for a, b in vocab_slices(logits.shape[-1], ranks):
        embed = None if table is None else (lambda i, a=a, b=b: table[a:b][i])
        parts.append(local_candidate(logits[:, a:b], a, embed))
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidates_give_the_full_argmax_and_embedding(ranks, dtype):
    g = torch.Generator().manual_seed(ranks)
    vocab, dim, rows = 1000, 48, 64
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    per = vocab_slices(vocab, ranks)[0][1]
    # ties: within a slice, across the slice boundary (rank r's last id = rank r+1's first), across distant ranks
    logits[0, 10] = logits[0, 20] = 9.0
    logits[1, per - 1] = logits[1, per] = 9.0
    logits[2, 5] = logits[2, vocab - 1] = 9.0
    logits[3] = 0.0  # all tied: id 0
    table = torch.randn(vocab, dim, generator=g).to(dtype)
    token, emb = pick_candidate(gather_candidates(logits, table, ranks), ranks, dtype)
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(token, expected)
    assert token[:4].tolist() == [10, per - 1, 5, 0]
    assert emb.dtype == dtype and torch.equal(emb, table[expected])  # bit for bit, as the all-reduce of one row
    token_only, none = pick_candidate(gather_candidates(logits, None, ranks), ranks, dtype)
    assert none is None and torch.equal(token_only, expected)


class SlicedHead(torch.nn.Module):
    """The greedy head a vocabulary-parallel host gives, with ``ranks`` simulated: each rank's logits are its
    columns of the full product, so the draft must equal the gathered-logits path's exactly."""

    def __init__(self, model, ranks: int) -> None:
        super().__init__()
        self.model, self.ranks, self.calls = model, ranks, []

    def forward(self, normed: torch.Tensor, with_embedding: bool):
        self.calls.append(with_embedding)
        logits = F.linear(normed, self.model.lm_head.weight).float()
        table = self.model.model.embed_tokens.weight if with_embedding else None
        return pick_candidate(gather_candidates(logits, table, self.ranks), self.ranks, normed.dtype)


@pytest.mark.parametrize("k", [1, 3])
def test_draft_chain_with_the_sliced_head_drafts_the_same_tokens(trained_dir, k):
    tok = TextTokenizer(trained_dir)
    model, calls = record_draft_calls(trained_dir, k, [tok.encode(t) for t in ("def main():\n", "import sys\n")])
    assert calls
    cache = torch.zeros_like(calls[0][1])
    head = SlicedHead(model, ranks=3)
    model.greedy_head = head
    try:
        sliced = MtpProposer(model, SpeculativeConfig(num_speculative_tokens=k), 128, cache)
        for inputs, cache_before, ids, _ in calls:
            cache.copy_(cache_before)
            assert torch.equal(sliced.propose(inputs), ids)
        # an embedding is gathered for every draft position but the last
        assert head.calls == ([True] * (k - 1) + [False]) * len(calls)
        with pytest.raises(ValueError, match="greedy_head"):
            sliced.propose(calls[0][0], return_logits=True)
    finally:
        model.greedy_head = None
