import pytest
import torch

from ascend_spec.sampling import SamplingParams, SamplingTensors, make_generator
from ascend_spec.spec_decode import (
    compact_rejected,
    prepare_inputs,
    prepare_inputs_padded,
    prepare_next_token_ids_padded,
    rejection_sample,
    sample_indices_in_padded_rows,
)
from ascend_spec.sync_counter import HostSyncCounter

V = 10


def i32(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def logits_with_argmax(argmax_rows: list[list[int]], vocab: int = V) -> torch.Tensor:
    """[B, K+1, V] logits whose argmax at each position is given; other entries small noise."""
    gen = torch.Generator().manual_seed(0)
    b, kp1 = len(argmax_rows), len(argmax_rows[0])
    logits = torch.rand(b, kp1, vocab, generator=gen)
    return logits.scatter(-1, torch.tensor(argmax_rows).unsqueeze(-1), 5.0)


# --- prepare_next_token_ids_padded ----------------------------------------------------------------------------------

def test_next_token_ids_padded_hand_example():
    sampled = i32([
        [3, 4, 5],     # all valid -> last = 5
        [3, 6, -1],    # one placeholder -> 6
        [-1, -1, -1],  # nothing valid -> backup
        [7, -1, -1],   # discarded -> backup, count 0
        [2, 12, -1],   # 12 >= vocab_size (padded vocab) is not a token -> 2
    ])
    discard = torch.tensor([False, False, False, True, False])
    backup = i32([100, 101, 102, 103, 104])
    next_ids, count = prepare_next_token_ids_padded(sampled, discard, backup, vocab_size=V)
    assert next_ids.tolist() == [5, 6, 102, 103, 2]
    assert count.tolist() == [3, 2, 0, 0, 1]
    assert next_ids.dtype == sampled.dtype and count.dtype == torch.int32


def test_next_token_ids_padded_vocab_bound_is_exclusive():
    sampled = i32([[V - 1, V]])
    next_ids, count = prepare_next_token_ids_padded(sampled, torch.tensor([False]), i32([0]), vocab_size=V)
    assert next_ids.tolist() == [V - 1] and count.tolist() == [1]


# --- prepare_inputs_padded / prepare_inputs -------------------------------------------------------------------------

def test_prepare_inputs_padded_hand_example():
    # Request 0: 3 drafts, 2 accepted + 1 recovered (3 valid of 4). Request 1: prefill of 5 tokens (no drafts).
    # Request 2: 2 drafts, all accepted + bonus. Request 3: 1 draft, discarded (0 valid).
    qsl = i32([0, 4, 9, 12, 14])
    num_draft = i32([3, 0, 2, 1])
    valid = i32([3, 1, 3, 0])
    idx, rejected = prepare_inputs_padded(qsl, num_draft, valid)
    assert rejected.tolist() == [1, 0, 0, 2]
    assert idx.tolist() == [2, 8, 11, 11]  # the discarded request points one before its span (vLLM's formula)


def test_prepare_inputs_padded_first_request_without_valid_token():
    idx, rejected = prepare_inputs_padded(i32([0, 2]), i32([1]), i32([0]))
    assert rejected.tolist() == [2] and idx.tolist() == [-1]


def test_prepare_inputs_unpadded_hand_example():
    qsl = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    rejected = torch.tensor([1, 0, 2], dtype=torch.int32)  # request 1 had no drafts
    new_qsl, token_indices = prepare_inputs(qsl, rejected)
    assert new_qsl.tolist() == [0, 3, 8, 9]
    assert token_indices.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]


def test_prepare_inputs_unpadded_all_rejected_and_empty():
    new_qsl, token_indices = prepare_inputs(torch.tensor([0, 2, 3]), torch.tensor([2, 0]))
    assert new_qsl.tolist() == [0, 0, 1] and token_indices.tolist() == [2]
    with pytest.raises(ValueError):
        prepare_inputs(torch.tensor([0, 2]), torch.tensor([3]))


def test_padded_and_unpadded_agree_on_sampled_index():
    qsl = torch.tensor([0, 4, 9, 12])
    num_draft = torch.tensor([3, 0, 2])
    valid = torch.tensor([2, 1, 3])
    idx, rejected = prepare_inputs_padded(qsl, num_draft, valid)
    new_qsl, token_indices = prepare_inputs(qsl, rejected)
    assert token_indices[new_qsl[1:] - 1].tolist() == idx.tolist()


def test_rows_padded_to_one_width_sample_where_their_own_spans_would():
    """A batch whose rows all take 1 + K slots, each verifying its num_draft <= K drafts first (the rest padding):
    the last accepted slot of each row is where vLLM's formula puts it on the row's own span of 1 + num_draft
    tokens, not counted back from the padded row's end (K - num_draft slots later)."""
    k = 3
    num_draft = torch.tensor([3, 1, 0, 2, 1, 3])
    valid = torch.tensor([4, 2, 1, 1, 1, 2])
    spans = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(1 + num_draft, 0)])
    own, _ = prepare_inputs_padded(spans, num_draft, valid)
    assert sample_indices_in_padded_rows(valid).tolist() == (own - spans[:-1]).tolist() == [3, 1, 0, 0, 0, 1]
    padded, _ = prepare_inputs_padded(torch.arange(len(valid) + 1) * (1 + k), num_draft, valid)
    off = padded - torch.arange(len(valid)) * (1 + k) - sample_indices_in_padded_rows(valid)
    assert off.tolist() == (k - num_draft).tolist()  # the rows with fewer drafts than K, by as many slots


def test_compact_rejected_is_prepare_inputs_on_device():
    """The unpadded layout at the verify width: each row's compacted span (``prepare_inputs``) in place, the rest
    inert; context ends at the sampled position; a pad row (seq_len 0) stays one. No host sync."""
    b, q = 4, 4
    qsl = torch.arange(b + 1) * q
    num_draft, valid = torch.tensor([3, 0, 2, 3]), torch.tensor([2, 1, 3, 4])
    ids = torch.arange(b * q).view(b, q) + 100
    pos = torch.arange(q).view(1, q) + torch.tensor([10, 20, 30, 40]).view(b, 1)
    hidden = torch.randn(b, q, 5)
    slots = pos + 1000
    seq_lens = torch.tensor([14, 24, 34, 0])
    with HostSyncCounter() as sc:
        idx, rejected = prepare_inputs_padded(qsl, num_draft, valid)
        out = compact_rejected(ids, pos, hidden, slots, seq_lens, idx - qsl[:-1])
    assert sc.count == 0, sc.events
    new_qsl, token_indices = prepare_inputs(qsl, rejected)
    for r in range(b):
        n = int(new_qsl[r + 1] - new_qsl[r])
        src = token_indices[new_qsl[r]: new_qsl[r + 1]]
        for got, full, pad in zip(out[:4], (ids, pos, hidden, slots), (0, 0, 0.0, -1)):
            assert torch.equal(got[r, :n], full.flatten(0, 1)[src])
            assert bool((got[r, n:] == pad).all())
    assert out[4].tolist() == [10 + 1 + 1, 20 + 3 + 1, 30 + 3 + 1, 0]


# --- rejection_sample (greedy) --------------------------------------------------------------------------------------

def test_greedy_all_accepted_gets_bonus():
    logits = logits_with_argmax([[1, 2, 3, 4]])
    out = rejection_sample(i32([[1, 2, 3]]), i32([3]), logits)
    assert out.dtype == torch.int32
    assert out.tolist() == [[1, 2, 3, 4]]


def test_greedy_first_mismatch_writes_target_token():
    logits = logits_with_argmax([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = i32([[1, 9, 3], [8, 2, 3], [1, 2, 0]])
    out = rejection_sample(drafts, i32([3, 3, 3]), logits)
    assert out.tolist() == [[1, 2, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1]]


def test_greedy_partial_num_draft_and_zero_drafts():
    logits = logits_with_argmax([[1, 2, 3, 4], [1, 2, 3, 4], [5, 2, 3, 4], [1, 7, 3, 4]])
    drafts = i32([[1, 2, 3], [1, 2, -1], [-1, -1, -1], [1, 2, 3]])
    out = rejection_sample(drafts, i32([1, 2, 0, 2]), logits)
    assert out.tolist() == [
        [1, 2, -1, -1],   # 1 draft accepted -> bonus = argmax at position 1
        [1, 2, 3, -1],    # 2 drafts accepted -> bonus at position 2; the -1 draft column is never read
        [5, -1, -1, -1],  # no drafts -> bonus at index 0
        [1, 7, -1, -1],   # mismatch at 1, ignoring the unused third draft
    ]


def test_greedy_k_zero():
    logits = logits_with_argmax([[6], [2]])
    out = rejection_sample(torch.empty(2, 0, dtype=torch.int32), i32([0, 0]), logits)
    assert out.tolist() == [[6], [2]]


def test_flat_and_3d_logits_agree():
    logits = logits_with_argmax([[1, 2, 3], [4, 5, 6]])
    drafts, nd = i32([[1, 0], [4, 5]]), i32([2, 2])
    a = rejection_sample(drafts, nd, logits)
    b = rejection_sample(drafts, nd, logits.reshape(-1, V))
    assert torch.equal(a, b) and a.tolist() == [[1, 2, -1], [4, 5, 6]]


def test_greedy_rows_in_mixed_batch_are_exact():
    logits = logits_with_argmax([[1, 2, 3], [1, 2, 3], [4, 5, 6]])
    drafts, nd = i32([[1, 2], [1, 0], [4, 5]]), i32([2, 2, 2])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0)]
    out = rejection_sample(drafts, nd, logits, params, generator=make_generator(0))
    assert out[:2].tolist() == [[1, 2, 3], [1, 2, -1]]
    assert 0 <= out[2, 0] < V  # the random row always emits at least one token


def test_greedy_draft_probs_are_ignored():
    logits = logits_with_argmax([[1, 2, 3]])
    q = torch.full((1, 2, V), 1.0 / V)
    out = rejection_sample(i32([[1, 2]]), i32([2]), logits, None, q)
    assert out.tolist() == [[1, 2, 3]]


# --- purity and sync-freedom ----------------------------------------------------------------------------------------

def _random_case():
    gen = torch.Generator().manual_seed(1)
    b, k = 4, 3
    logits = torch.randn(b * (k + 1), V, generator=gen)
    drafts = torch.randint(0, V, (b, k), generator=gen, dtype=torch.int32)
    drafts[3, 2] = -1
    nd = i32([3, 0, 1, 2])
    q = torch.rand(b, k, V, generator=gen).softmax(-1)
    st = SamplingTensors.from_params([
        SamplingParams(0.8, top_k=4, top_p=0.9), SamplingParams(), SamplingParams(1.0), SamplingParams(1.3, top_p=0.5)
    ])
    return drafts, nd, logits, st, q


def test_inputs_not_modified():
    drafts, nd, logits, st, q = _random_case()
    args = (drafts, nd, logits, st.temperature, st.top_k, st.top_p, st.greedy, q)
    before = [a.clone() for a in args]
    out = rejection_sample(drafts, nd, logits, st, q, make_generator(0))
    out_g = rejection_sample(drafts, nd, logits)
    discard = torch.tensor([False, True, False, False])
    backup = i32([1, 2, 3, 4])
    qsl = i32([0, 4, 8, 12, 16])
    pn_args = (out, discard, backup, qsl)
    pn_before = [a.clone() for a in pn_args]
    next_ids, valid = prepare_next_token_ids_padded(out, discard, backup, V)
    valid_before = valid.clone()
    idx, rejected = prepare_inputs_padded(qsl, nd, valid)
    rejected_before = rejected.clone()
    prepare_inputs(qsl, rejected)
    for a, b in zip(args + pn_args, before + pn_before):
        assert torch.equal(a, b)
    assert torch.equal(valid, valid_before) and torch.equal(rejected, rejected_before)
    assert next_ids.data_ptr() not in (out.data_ptr(), backup.data_ptr())
    assert out_g.data_ptr() != drafts.data_ptr()


@pytest.mark.parametrize("mode", ["greedy", "random_q", "random_onehot"])
def test_padded_step_is_sync_free(mode):
    drafts, nd, logits, st, q = _random_case()
    gen = make_generator(0)
    discard = torch.tensor([False, False, True, False])
    backup = i32([1, 2, 3, 4])
    qsl = i32([0, 4, 8, 12, 16])
    params = None if mode == "greedy" else st
    probs = q if mode == "random_q" else None
    with HostSyncCounter() as sc:
        out = rejection_sample(drafts, nd, logits, params, probs, gen)
        next_ids, valid = prepare_next_token_ids_padded(out, discard, backup, V)
        prepare_inputs_padded(qsl, nd, valid)
    assert sc.count == 0, sc.events


def test_output_layout_invariants_random():
    drafts, nd, logits, st, q = _random_case()
    out = rejection_sample(drafts, nd, logits, st, q, make_generator(5))
    valid = (out >= 0) & (out < V)
    n_valid = valid.sum(1)
    # A valid prefix of 1..num_draft+1 tokens, then placeholders; accepted columns repeat the drafts.
    assert torch.equal(valid, torch.arange(4).unsqueeze(0) < n_valid.unsqueeze(1))
    assert ((n_valid >= 1) & (n_valid <= nd + 1)).all()
    for b in range(4):
        n = int(n_valid[b]) - 1
        assert torch.equal(out[b, :n], drafts[b, :n])
    assert out[1, 0] == logits.view(4, 4, V)[1, 0].argmax()  # greedy row without drafts: bonus argmax
