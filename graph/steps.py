"""The fixed-shape step functions that get compiled per batch bucket: target verify, draft chain, prefill.
Plain functions over tensors: ``target_step``, ``draft_step`` and ``prefill_step``.
"""
from __future__ import annotations

from typing import Callable

import torch

from .paging import PagedInputs
from .latent_cache import LatentCache, block_size_of, slots_for
from .family import MtpModel

TargetStep = Callable[..., tuple[torch.Tensor, torch.Tensor]]
DraftStep = Callable[..., tuple[torch.Tensor, torch.Tensor]]


__all__ = ["RowLimits", "draft_lens_host", "make_draft_step", "make_prefill_step", "make_target_step", "slots_for"]


HostLengths = tuple[int, ...] | None


class RowLimits:
    """The ``max_len [B]`` input of the draft chain and the fused step: each row's ``max_model_len``. One tensor per
    row count and device, made once and never written, so a replay passes it without a host copy."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self._made: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, rows: int, device: torch.device) -> torch.Tensor:
        made = self._made.get((rows, device))
        if made is None:
            made = self._made[(rows, device)] = torch.full((rows,), self.max_model_len, dtype=torch.long,
                                                           device=device)
        return made


def draft_lens_host(seq_lens_host: HostLengths, step: int, max_model_len: int | None) -> HostLengths:
    """Host KV lengths of draft step ``step + 1`` (``step`` ≥ 1): the first step's plus ``step``, at most
    ``max_model_len``, pad rows 0. An upper bound: the exact length follows acceptance, known only on the device
    (see :func:`.mla_kernels.npu_mla`)."""
    if seq_lens_host is None or max_model_len is None:
        return None
    return tuple(_at_most(n + step, max_model_len) * _positive(n) for n in seq_lens_host)


#: past any length: ``_positive`` holds for ``|n| < _FAR``
_FAR = 1 << 31


# Host lengths are SymInts in the graph. ``min`` on them traces to ``torch.sym_min``, which torchair's GE
# translation cannot convert, and ``if n`` guards on a pad row's 0 (one recompile per pad pattern); ``+ - * //``
# convert and guard on nothing.
def _positive(n: int) -> int:
    """``1 if n > 0 else 0``."""
    return (n + _FAR - 1) // _FAR


def _at_most(n: int, high: int) -> int:
    """``min(n, high)``."""
    return n - (n - high) * _positive(n - high)


def make_target_step(model: MtpModel) -> TargetStep:
    """``seq_lens_host`` (every step function's last argument): host ints, where each row's query block ends
    (``PagedInputs.seq_lens_host``), for kernels that read them (``model.takes_host_lengths``), else None."""

    def target_step(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, caches: tuple[LatentCache, ...],
                    seq_lens_host: HostLengths = None) -> tuple[torch.Tensor, torch.Tensor]:
        inp = PagedInputs(positions, slot_mapping, block_table, seq_lens, seq_lens_host)
        hidden = model.target_paged(input_ids, inp, list(caches))
        return hidden, model.logits(hidden)

    return target_step


def make_prefill_step(model: MtpModel) -> TargetStep:
    """A prompt's target forward over ``[B, Q]`` tokens (rows right-padded with inert tokens): the hidden states
    at every position (the MTP layer drafts from them) and the logits at each row's ``last_idx`` only, one
    vocabulary product per request instead of one per prompt token."""

    def prefill_step(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, last_idx: torch.Tensor,
                     caches: tuple[LatentCache, ...], seq_lens_host: HostLengths = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        inp = PagedInputs(positions, slot_mapping, block_table, seq_lens, seq_lens_host)
        hidden = model.target_paged(input_ids, inp, list(caches))
        idx = last_idx.long().view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
        return hidden, model.logits(torch.gather(hidden, 1, idx).squeeze(1))

    return prefill_step


def make_draft_step(model: MtpModel, num_speculative_tokens: int, max_model_len: int) -> DraftStep:
    """Chain the MTP layer K times, as vLLM does when the checkpoint has fewer MTP layers than K.

    Step k+1 is fed ``shared_head.norm`` of step k's pre-norm hidden state (vLLM 0.32 and SGLang recycle
    the post-norm state, so it plays the role the target's final norm plays for step 1).
    Inputs are the verified batch ``[B, Q]``: ``input_ids`` already shifted left by one with the next token
    written at ``sample_idx`` (the last accepted position of each row), the target's ``hidden`` states, its
    positions and slots (the draft cache shares the target's block table). Steps 2..K feed back the previous
    draft token (and its embedding, where a vocabulary-parallel host head gathered it with the token) and MTP
    hidden state one position later, at slots of the draft cache's own block size; positions at or past
    ``max_len`` (each row's ``max_model_len``, an input: one graph serves every context limit) clamp to 0 and
    write nothing (slot -1), and pad rows (``seq_lens == 0``) never write. ``max_model_len`` bounds the host KV
    lengths of kernels that read them, and only theirs (closed over only where the model takes host lengths).
    """
    host_cap = max_model_len if model.takes_host_lengths else None
    if num_speculative_tokens == 0:
        return _kv_only_draft_step(model)

    def draft_step(input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, sample_idx: torch.Tensor,
                   slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   max_len: torch.Tensor, cache: LatentCache, seq_lens_host: HostLengths = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        inp = PagedInputs(positions, slot_mapping, block_table, seq_lens, seq_lens_host)
        block_size = block_size_of(cache)
        h, carry = model.mtp_paged(input_ids, hidden, inp, cache, step=0)  # [B, Q, D]
        idx = sample_idx.long().view(-1, 1)
        h_last = torch.gather(h, 1, idx.unsqueeze(-1).expand(-1, 1, h.shape[-1])).squeeze(1)  # [B, D]
        if carry is not None:  # each row's sampled token's, [B, 1, ...]
            carry = torch.gather(carry, 1, idx.view(-1, 1, *[1] * (carry.dim() - 2)).expand(-1, 1, *carry.shape[2:]))
        token, emb, logits = model.mtp_greedy(h_last, step=0, with_embedding=num_speculative_tokens > 1)
        tokens, all_logits = [token], [logits]
        pos = torch.gather(positions, 1, idx).squeeze(1)
        live = seq_lens > 0
        for step in range(1, num_speculative_tokens):
            pos = pos + 1
            exceeds = pos >= max_len
            clamped = torch.where(exceeds, torch.zeros_like(pos), pos)
            writable = live & ~exceeds
            slot = torch.where(writable, slots_for(clamped.view(-1, 1), block_table, block_size).view(-1),
                               torch.full_like(pos, -1))
            step_seq_lens = torch.where(writable, clamped + 1, live.long())
            # Exact device lengths where the backend's graphs take them (GE mode), else the host's upper bound. A
            # chain run eagerly (a prompt past the graph widths, a failed graph's rerun) keeps the bound: the
            # tensor-length op runs in GE graphs only, and reading the lengths back would be a host sync.
            on_device = model.exact_draft_lengths and seq_lens_host is not None and torch.compiler.is_compiling()
            step_inp = PagedInputs(clamped.view(-1, 1), slot.view(-1, 1), block_table, step_seq_lens,
                                   None if on_device else draft_lens_host(seq_lens_host, step, host_cap),
                                   kv_lens_on_device=on_device)
            h_prev = model.mtp_layer(step - 1).shared_head.norm(h_last)
            step_emb = None if emb is None else emb.view(-1, 1, emb.shape[-1])
            h_next, carry = model.mtp_paged(token.view(-1, 1), h_prev.view(-1, 1, h_prev.shape[-1]), step_inp,
                                            cache, step=step, emb=step_emb, carry=carry)
            h_last = h_next.squeeze(1)
            token, emb, logits = model.mtp_greedy(h_last, step=step,
                                                  with_embedding=step + 1 < num_speculative_tokens)
            tokens.append(token)
            all_logits.append(logits)
        return torch.stack(tokens, dim=1), torch.stack(all_logits, dim=1)

    return draft_step


def _kv_only_draft_step(model: MtpModel) -> DraftStep:
    """K = 0 (a step whose scheduler asked for no drafts): the MTP layer's cache entries for the verified batch,
    which later drafts attend to, and nothing else (vLLM's drafter runs the whole layer and discards its output):
    the layer's input, its attention's latent projection, the writes. No query, attention, MLP or vocabulary."""

    def draft_step(input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, sample_idx: torch.Tensor,
                   slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   max_len: torch.Tensor, cache: LatentCache, seq_lens_host: HostLengths = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        inp = PagedInputs(positions, slot_mapping, block_table, seq_lens, seq_lens_host)
        model.mtp_write_cache(input_ids, hidden, inp, cache, step=0)
        # empty outputs made with dtypes every backend converts (GE declares no bf16 new_zeros)
        rows = input_ids.shape[0]
        tokens = torch.zeros(rows, 0, dtype=torch.long, device=input_ids.device)
        return tokens, torch.zeros(rows, 0, model.cfg.vocab_size, dtype=torch.float32, device=input_ids.device)

    return draft_step
