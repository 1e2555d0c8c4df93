"""The host's step inputs (``ascend_spec.inputs``) against their device twins and the scheduler's room: the same
slots as the graphs compute, at every block size the serving engines use."""
import random

import pytest
import torch

from ascend_spec.graph.latent_cache import slots_for
from ascend_spec.inputs import block_row, pack_chunks, pad_ragged, slots_of, table_width
from ascend_spec.requests import Sequence, drafts_fit, step_tokens
from ascend_spec.sampling import SamplingParams


def _seq(num_tokens: int, block_size: int, rng: random.Random) -> Sequence:
    seq = Sequence(0, list(range(num_tokens)), SamplingParams(), 8)
    seq.blocks = rng.sample(range(1, 400), -(-num_tokens // block_size))
    return seq


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_host_slots_are_the_graphs_slots(block_size):
    """``slots_of`` (the host: prompts, the step-by-step path) and ``slots_for`` (the graphs) address one cache."""
    rng = random.Random(block_size)
    for num_tokens in (1, block_size - 1, block_size, 3 * block_size + 5):
        seq = _seq(num_tokens, block_size, rng)
        positions = list(range(num_tokens))
        table = torch.tensor([block_row(seq, len(seq.blocks) + 2)])
        device = slots_for(torch.tensor([positions]), table, block_size)
        assert slots_of(seq, positions, 10_000, block_size) == device[0].tolist()
    assert slots_of(seq, [num_tokens - 1, num_tokens], num_tokens, block_size)[1] == -1  # past max_model_len


def test_a_steps_reach_and_drafts_below_max_model_len():
    # K = 0 writes the last token's position only; K = 3 verifies up to start + 3, drafts up to start + 5
    assert step_tokens(10, 0) == 10 and step_tokens(10, 1) == 11 and step_tokens(10, 3) == 15
    # room for the drafts and the bonus token: a request at 126 of 128 tokens verifies 1 draft of 3
    assert [drafts_fit(n, 3, 128) for n in (120, 126, 127, 128)] == [3, 1, 0, 0]


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_table_width_follows_the_context_only_where_the_backend_compiles_it(block_size):
    """One formula for the runner's steps and vLLM's drafter: the blocks the longest row reaches (at least 2, at most
    the table) where the width is a dynamic dimension; every column where one recorded shape is replayed."""
    max_blocks = 4096 // block_size
    assert table_width(1, max_blocks, block_size, trim=True) == 2
    assert table_width(3 * block_size + 1, max_blocks, block_size, trim=True) == 4
    assert table_width(10**6, max_blocks, block_size, trim=True) == max_blocks
    assert table_width(3 * block_size + 1, max_blocks, block_size, trim=False) == max_blocks


def test_pack_chunks_pads_rows_that_write_nothing():
    rng = random.Random(0)
    seqs = [_seq(20, 16, rng), _seq(5, 16, rng)]
    ids, pos, slots, table, seq_lens, last = pack_chunks(seqs, [list(range(3, 20)), [7, 8]], [3, 3], 2, 128, 16,
                                                         torch.device("cpu"))
    assert ids.shape == pos.shape == slots.shape == (2, 17) and table.shape == (2, 2)
    assert pos[1].tolist() == [3, 4] + [4] * 15 and (slots[1, 2:] == -1).all()  # pad: last position, no write
    assert seq_lens.tolist() == [20, 5] and last.tolist() == [16, 1]
    assert slots[0].tolist() == slots_of(seqs[0], list(range(3, 20)), 128, 16)


def test_pad_ragged_right_pads_vllms_flat_rows_on_device():
    """vLLM's flat ragged batch (rows at ``query_start_loc``) into ``[B, W]``: each row's own tokens, then fill."""
    qsl = torch.tensor([0, 3, 4, 8])
    ids, hidden = pad_ragged(qsl, 5, torch.device("cpu"), [(torch.arange(8) + 10, 0),
                                                           (torch.arange(16.0).view(8, 2), -1.0)])
    assert ids.tolist() == [[10, 11, 12, 0, 0], [13, 0, 0, 0, 0], [14, 15, 16, 17, 0]]
    assert hidden.shape == (3, 5, 2) and hidden[1].tolist() == [[6.0, 7.0]] + [[-1.0, -1.0]] * 4
