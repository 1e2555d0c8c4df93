"""Speculative-decoding math on plain tensors: rejection sampling and the draft-input bookkeeping.
Semantics follow vLLM's ``RejectionSampler`` and ``prepare_*`` helpers, as pure functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ascend_spec.sampling import SamplingParams, SamplingTensors, logits_to_probs, sample_from_probs

PLACEHOLDER_TOKEN_ID = -1


def prepare_next_token_ids_padded(
    sampled_token_ids: torch.Tensor,
    discard_request_mask: torch.Tensor,
    backup_next_token_ids: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next input token per request for the drafter, and how many sampled tokens are valid.

    Args:
        sampled_token_ids: ``[B, K+1]`` rejection-sampler output with ``-1`` placeholders.
        discard_request_mask: ``[B]`` bool; True for requests whose sample is thrown away (e.g. partial prefill).
        backup_next_token_ids: ``[B]`` token to use when a request has no valid sampled token. The caller gathers it
            on device as ``token_ids[num_tokens_no_spec - 1]``, never at the optimistic async-scheduling sequence
            length, which can point at a ``-1`` draft placeholder (vLLM #38098: acceptance collapse).
        vocab_size: ids ``>= vocab_size`` (padded vocab) count as invalid.

    Returns:
        ``next_token_ids [B]`` (dtype of ``sampled_token_ids``): the last valid sampled token, else the backup;
        ``valid_sampled_tokens_count [B]`` int32: number of valid tokens, 0 for discarded requests.
    """
    valid = (sampled_token_ids >= 0) & (sampled_token_ids < vocab_size) & ~discard_request_mask.unsqueeze(1)
    count = valid.sum(dim=1, dtype=torch.int32)
    positions = torch.arange(sampled_token_ids.shape[1], device=sampled_token_ids.device, dtype=torch.float32)
    # Rightmost valid column (-1 if none); the sampler emits a valid prefix, but this does not rely on it.
    # max.dim over float32 (exact for column indices): torchair's amax converters only raise, max.dim's take float.
    last = torch.where(valid, positions, -1.0).max(dim=1, keepdim=True).values.to(torch.int64)
    last_tokens = sampled_token_ids.gather(1, last.clamp(min=0)).squeeze(1)
    backup = backup_next_token_ids.to(sampled_token_ids.dtype)
    next_ids = torch.where(last.squeeze(1) >= 0, last_tokens, backup)
    return next_ids, count


def prepare_inputs_padded(
    query_start_loc: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    valid_sampled_tokens_count: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where to read each request's last accepted hidden state, keeping the padded layout (no compaction).

    Args:
        query_start_loc: ``[B+1]`` cumulative token offsets of the verify batch.
        num_draft_tokens: ``[B]`` drafts verified per request (0 for a request without drafts, e.g. prefill).
        valid_sampled_tokens_count: ``[B]`` from :func:`prepare_next_token_ids_padded`.

    Returns:
        ``token_indices_to_sample [B]`` = ``query_start_loc[1:] - 1 - num_rejected``;
        ``num_rejected_tokens [B]`` = ``num_draft + 1 - valid`` where ``num_draft > 0``, else 0.
        A request with no valid token (discarded) gets ``num_draft + 1`` rejected, so its index points one before
        its span (``-1`` for the first request, as in vLLM); its draft is discarded by the caller.
    """
    num_draft = num_draft_tokens.to(query_start_loc.dtype)
    valid = valid_sampled_tokens_count.to(query_start_loc.dtype)
    num_rejected = torch.where(num_draft > 0, num_draft + 1 - valid, torch.zeros_like(num_draft))
    token_indices_to_sample = query_start_loc[1:] - 1 - num_rejected
    return token_indices_to_sample, num_rejected


def sample_indices_in_padded_rows(valid_sampled_tokens_count: torch.Tensor) -> torch.Tensor:
    """Where each row's last accepted hidden state is, counted from the row's first slot, where every row of the
    verify batch takes the same ``1 + K`` slots and verified its ``num_draft <= K`` drafts in the first
    ``1 + num_draft`` of them: ``valid - 1`` (0 for a discarded row, whose draft the caller drops).

    :func:`prepare_inputs_padded` counts back from the end of each request's own span, which in this layout is the
    end of the row: ``K - num_draft`` slots past the last accepted token of a row that verified fewer drafts than
    K (the first step after a change to a larger K, a row near ``max_model_len``).
    """
    return (valid_sampled_tokens_count.long() - 1).clamp(min=0)


def prepare_inputs(
    query_start_loc_cpu: torch.Tensor,
    num_rejected_tokens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpadded path: drop each request's rejected tokens from the end of its span (host tensors; may sync).

    Returns ``new_query_start_loc [B+1]`` and ``token_indices [T']`` indexing the original flat token array,
    both in ``query_start_loc_cpu``'s dtype. E.g. ``qsl=[0,3,5]``, ``rejected=[1,0]`` -> ``[0,2,4]``, ``[0,1,3,4]``.
    """
    qsl = query_start_loc_cpu
    rejected = num_rejected_tokens.to(device=qsl.device, dtype=qsl.dtype)
    new_lens = (qsl[1:] - qsl[:-1]) - rejected
    if bool((new_lens < 0).any()):
        raise ValueError("num_rejected_tokens exceeds a request's query length")
    new_qsl = torch.cat([qsl.new_zeros(1), new_lens.cumsum(0).to(qsl.dtype)])
    total = int(new_qsl[-1])
    # Token t of request r moves from qsl[r] + offset to new_qsl[r] + offset.
    shift = torch.repeat_interleave(qsl[:-1] - new_qsl[:-1], new_lens, output_size=total)
    token_indices = torch.arange(total, dtype=qsl.dtype, device=qsl.device) + shift
    return new_qsl, token_indices


def compact_rejected(input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                     slot_mapping: torch.Tensor, seq_lens: torch.Tensor, token_indices_to_sample: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
    """Unpadded drafter layout (``prepare_inputs``: rejected tokens dropped) at the verify width ``[B, Q]``, on device.

    A row's rejected tokens are the tail after its last accepted one, so each compacted span is the row's first
    ``token_indices_to_sample + 1`` tokens in place: the tail turns inert (token 0, position 0, hidden 0, slot -1:
    nothing is written for a rejected token) and the row's context ends at its sampled position. The width stays
    ``Q``, so a draft graph warmed for the padded layout replays it. Pad rows (``seq_lens`` 0) stay pad rows.
    Returns ``(input_ids, positions, hidden, slot_mapping, seq_lens)``, new tensors.
    """
    sample = token_indices_to_sample.long().view(-1, 1)
    kept = torch.arange(input_ids.shape[1], device=input_ids.device).view(1, -1) <= sample
    sampled_pos = positions.gather(1, sample).view(-1)
    return (torch.where(kept, input_ids, torch.zeros_like(input_ids)),
            torch.where(kept, positions, torch.zeros_like(positions)),
            torch.where(kept.unsqueeze(-1), hidden, torch.zeros_like(hidden)),
            torch.where(kept, slot_mapping, torch.full_like(slot_mapping, -1)),
            torch.where(seq_lens > 0, sampled_pos.to(seq_lens.dtype) + 1, torch.zeros_like(seq_lens)))


@dataclass(frozen=True, slots=True)
class RejectionNoise:
    """The randomness of one :func:`rejection_sample` call, drawn beforehand so that a compiled graph can take it
    as an input. Drawn in the order the sampler itself draws (uniforms, then exponentials), so a seeded run gives
    the same tokens either way."""

    uniform: torch.Tensor  # [B, K] U(0, 1): accept draft j when u * q < p
    exponential: torch.Tensor  # [B, V] Exp(1): the exponential race at the stopping column

    @classmethod
    def draw(cls, batch: int, k: int, vocab: int, generator: torch.Generator | None,
             device: torch.device | str) -> "RejectionNoise":
        uniform = torch.rand((batch, k), generator=generator, device=device, dtype=torch.float32)
        exponential = torch.empty(batch, vocab, device=device, dtype=torch.float32).exponential_(generator=generator)
        return cls(uniform, exponential)


def _as_sampling_tensors(
    sampling_params: Sequence[SamplingParams] | SamplingTensors | None, device: torch.device
) -> SamplingTensors | None:
    """``None`` means all greedy; a list is converted here (host -> device copy: graph callers pass tensors)."""
    if sampling_params is None or isinstance(sampling_params, SamplingTensors):
        return sampling_params
    return SamplingTensors.from_params(list(sampling_params), device)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    sampling_params: Sequence[SamplingParams] | SamplingTensors | None = None,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: RejectionNoise | None = None,
) -> torch.Tensor:
    """Verify drafts against the target; returns ``[B, K+1]`` int32 output tokens with ``-1`` placeholders.

    Args:
        draft_token_ids: ``[B, K]`` drafts; columns ``>= num_draft_tokens[b]`` are ignored.
        num_draft_tokens: ``[B]`` drafts per request, ``0 <= n <= K``.
        target_logits: ``[B*(K+1), V]`` or ``[B, K+1, V]``; row ``j`` scores the token after draft ``j-1``.
        sampling_params: per request; ``None`` = all greedy.
        draft_probs: ``[B, K, V]`` draft distributions q; ``None`` = deterministic drafts (q one-hot).
        generator: one generator for the batch (seeded runs are reproducible for the same batch).
        noise: the randomness drawn beforehand (:class:`RejectionNoise`); then ``generator`` is not used.

    Greedy rows accept while the draft equals the target argmax and then emit the argmax at the first mismatch,
    or the bonus argmax at column ``num_draft`` when all drafts match. Random rows accept draft ``j`` with
    probability ``min(1, p_j(x)/q_j(x))`` (p after temperature/top-k/top-p); at the first rejection they sample
    ``norm(max(p - q, 0))`` (p if that is all zero); with every draft accepted they sample the bonus from p.
    Vectorised over B and K: a cumulative product of the accept mask finds the accepted prefix.
    """
    batch, k = draft_token_ids.shape
    logits = target_logits.reshape(batch, k + 1, target_logits.shape[-1])
    device = logits.device
    st = _as_sampling_tensors(sampling_params, device)

    positions = torch.arange(k, device=device)
    num_draft = num_draft_tokens.to(device=device, dtype=torch.int64)
    in_draft = positions < num_draft.unsqueeze(1)  # [B, K]
    drafts = draft_token_ids.to(torch.int64).clamp(0, logits.shape[-1] - 1)  # safe for gather; masked by in_draft

    target_argmax = logits.argmax(dim=-1)  # [B, K+1]
    accept = drafts == target_argmax[:, :k]
    probs = None
    if st is not None and not st.all_greedy:
        probs = logits_to_probs(logits, st)  # [B, K+1, V] float32
        accept = torch.where(st.greedy.unsqueeze(1), accept, _random_accept(probs, drafts, draft_probs, generator, noise))
    accept = accept & in_draft

    # Accepted so far = no rejection up to j: a cumsum of rejections (torchair's cumprod converter only raises).
    rejected = (~accept).cumsum(dim=1)
    num_accepted = (rejected == 0).to(torch.int32).sum(dim=1, dtype=torch.int64)  # [B], <= num_draft
    final_token = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # greedy recovery / bonus
    if probs is not None:
        recovered = _sample_at_stop(probs, drafts, draft_probs, num_accepted, num_draft, generator, noise)
        final_token = torch.where(st.greedy, final_token, recovered)

    # Column j: the draft if j < accepted, the recovered/bonus token at j == accepted, else the placeholder.
    cols = torch.arange(k + 1, device=device).unsqueeze(0)
    padded_drafts = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    n = num_accepted.unsqueeze(1)
    out = torch.where(cols < n, padded_drafts, torch.where(cols == n, final_token.unsqueeze(1), PLACEHOLDER_TOKEN_ID))
    return out.to(torch.int32)


def _random_accept(
    probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator | None,
    noise: RejectionNoise | None = None,
) -> torch.Tensor:
    """Accept draft j with probability min(1, p_j(x)/q_j(x)), as ``u * q < p`` (no division, q = 0 safe)."""
    batch, k = drafts.shape
    p = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    if draft_probs is None:
        q = torch.ones_like(p)
    else:
        q = draft_probs.float().gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u = noise.uniform if noise is not None else torch.rand((batch, k), generator=generator, device=probs.device,
                                                           dtype=torch.float32)
    return u * q < p


def _sample_at_stop(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
    generator: torch.Generator | None,
    noise: RejectionNoise | None = None,
) -> torch.Tensor:
    """Sample the token at column ``num_accepted``: residual ``max(p - q, 0)`` after a rejection, p for the bonus.

    Gathers the one stopping row per request first, so only ``B x V`` noise is drawn.
    """
    batch, k = drafts.shape
    vocab = probs.shape[-1]
    row = num_accepted.view(batch, 1, 1).expand(batch, 1, vocab)
    p = probs.gather(1, row).squeeze(1)  # [B, V]
    rejected = num_accepted < num_draft  # else every draft was accepted: bonus from p
    exponential = noise.exponential if noise is not None else None
    if k == 0:
        return sample_from_probs(p, generator, exponential)
    qrow = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        # Compare against arange rather than F.one_hot, which validates its input with a host read.
        token = drafts.gather(1, qrow.unsqueeze(1))
        q = (torch.arange(vocab, device=p.device) == token).to(p.dtype)
    else:
        q = draft_probs.float().gather(1, qrow.view(batch, 1, 1).expand(batch, 1, vocab)).squeeze(1)
    residual = (p - q).clamp(min=0)
    use_residual = rejected & (residual.sum(dim=-1) > 0)
    return sample_from_probs(torch.where(use_residual.unsqueeze(1), residual, p), generator, exponential)
