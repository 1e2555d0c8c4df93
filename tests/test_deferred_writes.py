"""Held K = 0 cache writes (``DeferredCacheWrites``): written many steps at a time, they leave the draft cache as
writing each step would, on graphs warm-up made; they are written before a batch of other requests is held."""
from __future__ import annotations

import pytest
import torch

from ascend_spec.config import SpeculativeConfig
from ascend_spec.deferred_writes import DeferredCacheWrites
from ascend_spec.graph.backends.rehearsal import RehearsalBackend
from ascend_spec.proposer import DraftInputs
from ascend_spec.torchair_proposer import MtpTorchairProposer

from .conftest import TINY, random_model

BLOCK, BLOCKS, MAX_LEN = 16, 24, 128


def chain(cache: torch.Tensor, k: int = 0, backend=None) -> MtpTorchairProposer:
    spec = SpeculativeConfig(num_speculative_tokens=2)
    return MtpTorchairProposer(random_model(), spec, MAX_LEN, cache, backend=backend or RehearsalBackend("raise"),
                               batch_sizes=[2, 4], prefill_widths=[8, 32], num_speculative_tokens=k)


def decode_steps(n: int, rows: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """``n`` decode steps of ``rows`` requests, one token each: (next tokens, positions, hidden, slots); request r
    owns blocks 2r+1, 2r+2 and decodes from position 5 + 3r on."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(n):
        pos = torch.tensor([5 + 3 * r + s for r in range(rows)])
        slots = torch.tensor([(2 * r + 1 + int(p) // BLOCK) * BLOCK + int(p) % BLOCK for r, p in enumerate(pos)])
        steps.append((torch.randint(1, TINY.vocab_size, (rows,), generator=g), pos,
                      torch.randn(rows, TINY.hidden_size, generator=g), slots))
    return steps


def write_each_step(c: MtpTorchairProposer, steps) -> None:
    """The reference: each step through the K = 0 chain as a draft of its own (what the adapters did before)."""
    for ids, pos, hidden, slots in steps:
        b = ids.shape[0]
        c.propose(DraftInputs(
            target_token_ids=ids.view(b, 1), target_positions=pos.view(b, 1),
            target_hidden_states=hidden.view(b, 1, -1), target_slot_mapping=slots.view(b, 1), next_token_ids=ids,
            token_indices_to_sample=torch.zeros(b, dtype=torch.long),
            block_table=torch.zeros(b, c.table_width, dtype=torch.long), seq_lens=pos + 1))


@torch.no_grad()
def test_held_writes_leave_the_cache_as_writing_each_step_on_warmed_graphs_and_write_nothing_else():
    start = torch.randn(BLOCKS, BLOCK, 576)
    ref_cache, held_cache = start.clone(), start.clone()
    ref, backend = chain(ref_cache), RehearsalBackend("raise")
    held_chain = chain(held_cache, backend=backend)
    held_chain.warmup(progress=False)
    held = DeferredCacheWrites(held_chain)
    assert held.max_steps == 8  # the narrowest prefill width the chain has a graph for
    steps = decode_steps(11, rows=3)
    write_each_step(ref, steps)
    for ids, pos, hidden, slots in steps:
        held.add(ids, pos, hidden, slots, key=["a", "b", "c"])
    assert held.flushes == 1 and held.pending == 3  # 8 held, written when the ninth came
    assert not torch.equal(held_cache, ref_cache)
    held.flush()
    assert held.pending == 0 and held.flushes == 2
    written = (ref_cache != start).any(-1)
    assert int(written.sum()) == 33
    torch.testing.assert_close(held_cache, ref_cache, rtol=1e-5, atol=1e-5)
    assert set(backend.recorded) == {f"draft_bs{s}_q{q}" for s in (2, 4) for q in (1, 8, 32)}  # no new shape


@torch.no_grad()
def test_another_batch_or_bucket_first_writes_what_is_held():
    """A slot a finished request's step held may be the next owner's: one flush never holds both, so each batch
    of requests (and each bucket) is written before the next is held."""
    cache = torch.zeros(BLOCKS, BLOCK, 576)
    held = DeferredCacheWrites(chain(cache))
    four, two = decode_steps(2, rows=4), decode_steps(2, rows=2, seed=1)
    held.add(*four[0], key=["a", "b", "c", "d"])
    held.add(*four[1], key=["a", "b", "c", "d"])
    assert held.flushes == 0 and held.pending == 2
    held.add(*four[1], key=["a", "b", "c", "e"])  # a request left, another took its row
    assert held.flushes == 1 and held.pending == 1
    held.add(*two[0], key=["a", "b"])  # a smaller bucket
    assert held.flushes == 2 and held.pending == 1


@torch.no_grad()
def test_entries_of_requests_that_all_ended_are_dropped_unwritten_the_rest_written():
    """Held entries whose requests have all ended are read by no draft (their blocks may have a new owner): dropped,
    where the caller names the running requests; one request still running writes the lot."""
    start = torch.randn(BLOCKS, BLOCK, 576)
    cache = start.clone()
    held = DeferredCacheWrites(chain(cache))
    four, two = decode_steps(2, rows=4), decode_steps(1, rows=2, seed=1)
    for step in four:
        held.add(*step, key=["a", "b", "c", "d"])
    held.add(*two[0], key=["e", "f"], live={"e": 0, "f": 0})  # a, b, c, d ended: their 8 entries dropped
    assert (held.dropped, held.flushes, held.pending) == (1, 0, 1) and torch.equal(cache, start)
    held.flush(live={"e", "f"})
    assert (held.dropped, held.flushes, held.pending) == (1, 1, 0)
    assert int((cache != start).any(-1).sum()) == 2  # e's and f's one step each
    held.add(*four[0], key=["a", "b", "c", "d"])
    before = cache.clone()
    held.flush(live={"d"})  # one of them still runs: all written (two of the four slots were e's and f's)
    assert (held.dropped, held.flushes) == (1, 2) and int((cache != before).any(-1).sum()) == 4


def test_only_the_k0_chain_holds_and_only_batches_a_bucket_serves():
    cache = torch.zeros(BLOCKS, BLOCK, 576)
    with pytest.raises(ValueError, match="allowed: the K = 0 chain"):
        DeferredCacheWrites(chain(cache, k=2))
    held = DeferredCacheWrites(chain(cache))
    assert held.takes(3) and not held.takes(5)
    with pytest.raises(ValueError, match="allowed: at most 4"):
        held.add(*decode_steps(1, rows=5)[0], key=list("abcde"))
