"""``MtpProposer``: drafts K tokens per request with the checkpoint's MTP layer(s).
A thin class over small functions: ``spec_decode``'s padded bookkeeping and ``graph.steps``' K-step draft chain.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import spec_decode
from .config import SpeculativeConfig
from .graph.latent_cache import LatentCache, block_size_of, cache_tensors, num_blocks_for
from .graph.model import DeepseekV3ForCausalLM
from .graph.steps import RowLimits, make_draft_step


@dataclass(frozen=True, slots=True)
class DraftInputs:
    """A verified batch in the padded ``[B, Q]`` layout (Q = 1 + K, or the prompt length at prefill).

    ``token_indices_to_sample`` indexes within each row (the last accepted position). The draft cache
    shares the target's block table, positions and slot mapping. Pad rows: ``seq_lens`` 0, slots -1.
    """

    target_token_ids: torch.Tensor  # [B, Q]
    target_positions: torch.Tensor  # [B, Q]
    target_hidden_states: torch.Tensor  # [B, Q, D]
    target_slot_mapping: torch.Tensor  # [B, Q]
    next_token_ids: torch.Tensor  # [B]
    token_indices_to_sample: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, M]
    seq_lens: torch.Tensor  # [B]
    #: host ints, where each row's query block ends (``paging.PagedInputs.seq_lens_host``), for attention
    #: that reads them (``model.takes_host_lengths``); else None
    seq_lens_host: tuple[int, ...] | None = None


def shift_in_next_tokens(target_token_ids: torch.Tensor, next_token_ids: torch.Tensor,
                         token_indices_to_sample: torch.Tensor) -> torch.Tensor:
    """MTP inputs: the target's tokens shifted left by one, the next token at each row's sampled index.

    Position i of the draft sees h_i and token i+1; at the last accepted index that token is the one the
    target just produced. Out of place: the caller's tensors stay as they were.
    """
    shifted = torch.cat([target_token_ids[:, 1:], torch.zeros_like(target_token_ids[:, :1])], dim=1)
    return shifted.scatter(1, token_indices_to_sample.long().view(-1, 1),
                           next_token_ids.to(shifted.dtype).view(-1, 1))


class MtpProposer:
    """Eager MTP drafter (the reference). ``MtpTorchairProposer`` replays compiled graphs per bucket."""

    def __init__(self, model: DeepseekV3ForCausalLM, spec: SpeculativeConfig, max_model_len: int,
                 draft_cache: LatentCache, num_speculative_tokens: int | None = None) -> None:
        self.spec = spec
        #: the chain's K: ``spec``'s, or another a scheduler may ask for (0: the MTP layer's cache writes only)
        self.num_speculative_tokens = spec.num_speculative_tokens if num_speculative_tokens is None else \
            num_speculative_tokens
        self.max_model_len = max_model_len
        #: the draft chain's ``max_len`` input, per row count
        self.row_limits = RowLimits(max_model_len)
        self.draft_cache = draft_cache
        self.model: DeepseekV3ForCausalLM | None = None
        self.load_model(model)

    # -- lifecycle ----------------------------------------------------------------------------
    def load_model(self, model: DeepseekV3ForCausalLM) -> None:
        """Bind the checkpoint whose MTP layer(s) draft; the MTP layer shares nothing mutable with the target."""
        self.model = model
        self.vocab_size = model.cfg.vocab_size
        self._draft_fn = make_draft_step(model, self.num_speculative_tokens, self.max_model_len)

    @property
    def table_width(self) -> int:
        """Block-table columns that cover ``max_model_len`` in the draft cache's own block size."""
        return num_blocks_for(self.max_model_len, block_size_of(self.draft_cache))

    def dummy_run(self, num_reqs: int) -> None:
        """Run one inert draft (every row padded) for ``num_reqs`` requests, e.g. to warm up."""
        self._run_draft(*self._inert_batch(num_reqs))

    def _inert_batch(self, num_reqs: int, width: int | None = None) -> list[torch.Tensor]:
        """Draft-step inputs in the verify layout (Q = 1 + K) whose rows are all padding: slot -1, seq_len 0."""
        q = 1 + self.num_speculative_tokens
        like = cache_tensors(self.draft_cache)[0]
        dev = like.device
        ids = torch.zeros(num_reqs, q, dtype=torch.long, device=dev)
        per_req = torch.zeros(num_reqs, dtype=torch.long, device=dev)
        hidden = torch.zeros(num_reqs, q, self.model.cfg.hidden_size, dtype=like.dtype, device=dev)
        table = torch.zeros(num_reqs, width or self.table_width, dtype=torch.long, device=dev)
        return [ids, ids, hidden, per_req, torch.full_like(ids, -1), table, per_req, self.row_limits(num_reqs, dev)]

    # -- padded bookkeeping (vLLM's names; no host syncs) ---------------------------------------
    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, discard_request_mask: torch.Tensor,
                                      backup_next_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return spec_decode.prepare_next_token_ids_padded(sampled_token_ids, discard_request_mask,
                                                         backup_next_token_ids, self.vocab_size)

    def prepare_inputs_padded(self, query_start_loc: torch.Tensor, num_draft_tokens: torch.Tensor,
                              valid_sampled_tokens_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return spec_decode.prepare_inputs_padded(query_start_loc, num_draft_tokens, valid_sampled_tokens_count)

    def prepare_inputs(self, query_start_loc_cpu: torch.Tensor,
                       num_rejected_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return spec_decode.prepare_inputs(query_start_loc_cpu, num_rejected_tokens)

    # -- drafting --------------------------------------------------------------------------------
    def propose(self, inputs: DraftInputs, return_logits: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Draft ``[B, K]`` token ids (and, if asked, their ``[B, K, V]`` logits) for a verified batch."""
        if return_logits and self.model.greedy_head is not None:
            raise ValueError("propose(return_logits=True): this model drafts through a vocabulary-parallel greedy "
                             "head (model.greedy_head), which gathers no logits")
        ids, logits = self._run_draft(*self._draft_args(inputs), seq_lens_host=self._host_lengths(inputs))
        return (ids, logits) if return_logits else ids

    def propose_reference(self, inputs: DraftInputs) -> torch.Tensor:
        """Draft ``[B, K]`` with the eager reference chain whatever the shape: for one-off calls (a prompt's
        prefill) that no compiled graph was warmed for."""
        with torch.no_grad():
            return MtpProposer._run_draft(self, *self._draft_args(inputs),
                                          seq_lens_host=self._host_lengths(inputs))[0]

    def _host_lengths(self, inputs: DraftInputs) -> tuple[int, ...] | None:
        """The host KV lengths the draft chain passes its attention: where it reads them, the caller's (a call
        without them is refused by name); else none, whatever was given."""
        if not self.model.takes_host_lengths:
            return None
        if inputs.seq_lens_host is None:
            raise ValueError(f"DraftInputs.seq_lens_host is None; attention {self.model.attention_kernel!r} reads "
                             "KV lengths from the host: allowed, one int per request (seq_lens on the host)")
        return inputs.seq_lens_host

    def _draft_args(self, inputs: DraftInputs) -> list[torch.Tensor]:
        input_ids = shift_in_next_tokens(inputs.target_token_ids, inputs.next_token_ids,
                                         inputs.token_indices_to_sample)
        limits = self.row_limits(input_ids.shape[0], input_ids.device)
        return [input_ids, inputs.target_positions, inputs.target_hidden_states, inputs.token_indices_to_sample,
                inputs.target_slot_mapping, inputs.block_table, inputs.seq_lens, limits]

    def _run_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                   sample_idx: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, max_len: torch.Tensor, seq_lens_host: tuple[int, ...] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return self._draft_fn(input_ids, positions, hidden, sample_idx, slot_mapping, block_table, seq_lens,
                                  max_len, self.draft_cache, seq_lens_host)
