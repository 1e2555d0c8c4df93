"""One compiled graph per step: target verify + rejection sampling + next-token preparation + the K-step draft chain.
A decode step is a single replay on every backend; graphs are keyed by the step key (K, sampling mode, logprobs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import spec_decode
from .graph.backends.base import Backend, DynamicDims, clone_with_name
from .graph.buckets import note_graph_failure
from .graph.model import DeepseekV3ForCausalLM
from .graph.latent_cache import LatentCache, block_size_of
from .graph.steps import HostLengths, make_draft_step, make_target_step, slots_for
from .proposer import shift_in_next_tokens
from .sampling import GREEDY, MAX_LOGPROBS, RANDOM, SamplingTensors, top_logprobs

SpecStep = Callable[..., tuple[torch.Tensor, ...]]
#: the fused step's batch arguments (input_ids … max_len) and its block table (argument 3)
SPEC_STEP_DIMS = DynamicDims(batch=tuple(range(12)), width=(3,), pools_from=12)


@dataclass(frozen=True)
class SpecPhases:
    """The fused step's three phases as separate functions over tensors; ``make_spec_step`` chains them into one
    graph. Benchmarks compile and time each on a real run's inputs (the step-time account).

    - ``verify(input_ids, start, num_draft, block_table, live, caches)`` → ``(pos, slots, seq_lens, nd, hidden,
      logits)``: the target forward of ``1 + K`` tokens per row (``K = 0``: one token, plain decoding);
    - ``accept(input_ids, nd, logits, temperature, top_k, top_p, greedy, uniform, exponential)`` → ``(sampled,
      *logprobs)``: rejection sampling (and the top logprobs);
    - ``propose(input_ids, start, sampled, pos, hidden, slots, block_table, seq_lens, draft_cache)`` →
      ``(valid, next_input, next_start)``: next tokens, and the K-step draft chain for the next step.
    """

    verify: Callable[..., tuple[torch.Tensor, ...]]
    accept: Callable[..., tuple[torch.Tensor, ...]]
    propose: Callable[..., tuple[torch.Tensor, ...]]


#: batch (dim 0) and block-table width (dim 1) arguments of each phase
PHASE_DIMS = {"verify": DynamicDims(batch=(0, 1, 2, 3, 4, 5), width=(3,), pools_from=6),
              "accept": DynamicDims(batch=tuple(range(9))),
              "propose": DynamicDims(batch=tuple(range(9)), width=(6,), pools_from=9)}


def make_spec_phases(model: DeepseekV3ForCausalLM, k: int, max_model_len: int, mode: str,
                     logprobs: bool = False, unpadded: bool = False) -> SpecPhases:
    """``unpadded``: the draft reads the unpadded drafter layout (``disable_padded_drafter_batch``), each row's
    rejected tokens dropped (``spec_decode.compact_rejected``), at the same shapes."""
    if mode not in (GREEDY, RANDOM):
        raise ValueError(f"mode={mode!r}; allowed: {[GREEDY, RANDOM]}")
    target = make_target_step(model)
    draft = make_draft_step(model, k, max_model_len) if k else None
    vocab = model.cfg.vocab_size
    q = 1 + k
    n_logprobs = min(MAX_LOGPROBS, vocab)

    def verify(input_ids: torch.Tensor, start: torch.Tensor, num_draft: torch.Tensor, block_table: torch.Tensor,
               live: torch.Tensor, max_len: torch.Tensor, caches: tuple[LatentCache, ...],
               seq_lens_host: HostLengths = None) -> tuple[torch.Tensor, ...]:
        positions = start.view(-1, 1) + torch.arange(q, device=start.device)
        in_range = positions < max_len.view(-1, 1)
        pos = torch.where(in_range, positions, torch.zeros_like(positions))
        slots = torch.where(in_range & live.view(-1, 1), slots_for(pos, block_table, block_size_of(caches[0])),
                            torch.full_like(pos, -1))
        seq_lens = torch.where(live, torch.minimum(start + q, max_len), torch.zeros_like(start))
        # Room for the drafts and the bonus token below max_model_len, as the step-by-step engine allows.
        nd = torch.minimum(num_draft, (max_len - start - 2).clamp(min=0))
        hidden, logits = target(input_ids, pos, slots, block_table, seq_lens, caches, seq_lens_host)
        return pos, slots, seq_lens, nd, hidden, logits

    def accept(input_ids: torch.Tensor, nd: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
               top_k: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor, uniform: torch.Tensor,
               exponential: torch.Tensor) -> tuple[torch.Tensor, ...]:
        st = SamplingTensors(temperature, top_k, top_p, greedy, all_greedy=mode == GREEDY,
                             any_top_k=mode == RANDOM, any_top_p=mode == RANDOM)
        noise = spec_decode.RejectionNoise(uniform, exponential) if mode == RANDOM else None
        sampled = spec_decode.rejection_sample(input_ids[:, 1:], nd, logits, st, None, None, noise)
        extra = top_logprobs(logits, sampled, n_logprobs) if logprobs else ()
        return sampled, *extra

    def propose(input_ids: torch.Tensor, start: torch.Tensor, sampled: torch.Tensor, pos: torch.Tensor,
                hidden: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                max_len: torch.Tensor, draft_cache: LatentCache, seq_lens_host: HostLengths = None
                ) -> tuple[torch.Tensor, ...]:
        b = input_ids.shape[0]
        if draft is None:
            valid = torch.ones(b, dtype=torch.int32, device=input_ids.device)
            return valid, sampled.long(), start + 1
        discard = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        next_ids, valid = spec_decode.prepare_next_token_ids_padded(sampled, discard, input_ids[:, 0], vocab)
        sample_idx = spec_decode.sample_indices_in_padded_rows(valid)
        if unpadded:
            input_ids, pos, hidden, slots, seq_lens = spec_decode.compact_rejected(input_ids, pos, hidden, slots,
                                                                                    seq_lens, sample_idx)
        draft_ids = shift_in_next_tokens(input_ids, next_ids, sample_idx)
        drafts, _ = draft(draft_ids, pos, hidden, sample_idx, slots, block_table, seq_lens, max_len, draft_cache,
                          seq_lens_host)
        return valid, torch.cat([next_ids.view(-1, 1).long(), drafts.long()], dim=1), start + valid.long()

    return SpecPhases(verify, accept, propose)


def make_spec_step(model: DeepseekV3ForCausalLM, k: int, max_model_len: int, mode: str,
                   logprobs: bool = False, keep_hidden: bool = False, unpadded: bool = False) -> SpecStep:
    """The fused step for ``K = k`` drafts per request (``k = 0``: decode without speculation).

    Inputs (``B`` rows, pad rows have ``live`` False and write nothing):
    ``input_ids [B, 1+k]`` (last token, then the drafts), ``start [B]`` (its position = tokens already cached),
    ``num_draft [B]`` (drafts in ``input_ids`` to verify), ``block_table [B, M]``, ``live [B]``, the sampling
    tensors ``temperature, top_k, top_p, greedy [B]`` and the noise ``uniform [B, k]``, ``exponential [B, V]``
    (unused in greedy mode), ``max_len [B]`` (each row's ``max_model_len``: data, so one graph serves every
    context limit), then the target caches and the draft cache, and for attention that reads host KV lengths the
    verify's ``seq_lens_host`` (``start + 1 + k`` per live row, unclamped; 0 per pad row).
    Returns ``sampled [B, 1+k]`` int32 (-1 placeholders), ``valid [B]`` int32, the next step's
    ``input_ids [B, 1+k]`` and ``start [B]``; with ``logprobs`` also the target's top
    ``min(MAX_LOGPROBS, V)`` ids and logprobs ``[B, 1+k, N]`` and each sampled token's logprob ``[B, 1+k]``;
    with ``keep_hidden`` a ``k = 0`` step returns last the target's hidden states ``[B, D]``: it runs no MTP layer,
    and a drafter that resumes writes the MTP cache entries of these positions from them. ``unpadded``: see
    :func:`make_spec_phases`.
    """
    phases = make_spec_phases(model, k, max_model_len, mode, logprobs, unpadded)
    keep = keep_hidden and k == 0

    def spec_step(input_ids: torch.Tensor, start: torch.Tensor, num_draft: torch.Tensor, block_table: torch.Tensor,
                  live: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  greedy: torch.Tensor, uniform: torch.Tensor, exponential: torch.Tensor, max_len: torch.Tensor,
                  caches: tuple[LatentCache, ...], draft_cache: LatentCache, seq_lens_host: HostLengths = None
                  ) -> tuple[torch.Tensor, ...]:
        pos, slots, seq_lens, nd, hidden, logits = phases.verify(input_ids, start, num_draft, block_table, live,
                                                                 max_len, caches, seq_lens_host)
        sampled, *extra = phases.accept(input_ids, nd, logits, temperature, top_k, top_p, greedy, uniform,
                                        exponential)
        valid, next_input, next_start = phases.propose(input_ids, start, sampled, pos, hidden, slots, block_table,
                                                       seq_lens, max_len, draft_cache, seq_lens_host)
        return (sampled, valid, next_input, next_start, *extra) + ((hidden[:, 0],) if keep else ())

    return spec_step


@dataclass(frozen=True, slots=True)
class StepKey:
    """One compiled fused step. ``batch`` is None on dynamic-batch backends (one graph for every bucket)."""

    k: int
    mode: str
    logprobs: bool = False
    batch: int | None = None

    @property
    def tag(self) -> str:
        return (f"spec_k{self.k}_{self.mode}" + ("_logprobs" if self.logprobs else "")
                + ("" if self.batch is None else f"_bs{self.batch}"))


class SpecStepGraphs:
    """Compiled fused steps, one per :class:`StepKey`, built on first use (warm-up builds the ones it is told)."""

    def __init__(self, model: DeepseekV3ForCausalLM, backend: Backend, max_model_len: int,
                 keep_hidden: bool = False, unpadded: bool = False) -> None:
        self.model = model
        self.backend = backend
        self.max_model_len = max_model_len
        #: K = 0 steps also return the target's hidden states (an engine that drafts at other K)
        self.keep_hidden = keep_hidden
        #: the drafts read the unpadded drafter layout (``disable_padded_drafter_batch``)
        self.unpadded = unpadded
        self._fns: dict[tuple[int, str, bool], SpecStep] = {}
        self._graphs: dict[StepKey, SpecStep] = {}
        #: failures per key (``graph_failure: eager``); each such step reran on the eager definition (same outputs,
        #: same cache writes)
        self.failures: dict[StepKey, int] = {}

    def key(self, bucket: int, k: int, mode: str, logprobs: bool = False) -> StepKey:
        return StepKey(k, mode, logprobs, None if self.backend.shapes.dynamic_batch else bucket)

    def __contains__(self, key: StepKey) -> bool:
        return key in self._graphs

    def _fn(self, key: StepKey) -> SpecStep:
        fn = self._fns.get((key.k, key.mode, key.logprobs))
        if fn is None:
            fn = self._fns[(key.k, key.mode, key.logprobs)] = make_spec_step(
                self.model, key.k, self.max_model_len, key.mode, key.logprobs, self.keep_hidden, self.unpadded)
        return fn

    def get(self, key: StepKey) -> SpecStep:
        graph = self._graphs.get(key)
        if graph is None:
            # A code object per key: each graph gets its own Dynamo cache entry (see clone_with_name).
            graph = self._graphs[key] = self.backend.compile(clone_with_name(self._fn(key), key.tag), key.tag,
                                                             SPEC_STEP_DIMS)
        return graph

    def __call__(self, key: StepKey, *args: object) -> tuple[torch.Tensor, ...]:
        """Replay ``key``'s graph; if it raises, the backend's ``graph_failure`` policy decides: raise it, or rerun
        this step eagerly (the graph's inputs are not modified by it, and the eager rerun rewrites the same cache
        slots with the same values)."""
        graph = self.get(key)
        try:
            return graph(*args)
        except Exception as exc:  # noqa: BLE001 - any graph/runtime fault costs this step only
            note_graph_failure(self.failures, key, f"fused step {key.tag}", exc, self.backend.graph_failure)
            return self._fn(key)(*args)
