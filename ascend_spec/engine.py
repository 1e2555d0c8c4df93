"""Standalone harness: continuous batching over a paged cache, with or without MTP speculation.

One step (speculative, padded — DESIGN.md's data flow):
1. target forward of ``B`` requests × ``(1+K)`` tokens (a compiled graph per batch bucket)
2. rejection sampler → ``sampled [B, K+1]`` with -1 placeholders
3. ``prepare_next_token_ids_padded`` → next token and valid count per request
4. ``prepare_inputs_padded`` → last accepted index per request (no compaction)
5-6. the proposer drafts K tokens for the next step
Steps 1-6 run without host syncs; afterwards one transfer brings the step's tokens to the host for
bookkeeping (stop conditions, next inputs), as vLLM's scheduler does.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import spec_decode
from .config import EngineConfig
from .graph.backends import Backend, get_backend
from .graph.buckets import BatchArg, BucketedGraph
from .graph.config import KV_BLOCK_SIZE
from .graph.model import DeepseekV3ForCausalLM
from .graph.steps import make_target_step
from .kv_cache import BlockManager, KVCaches
from .metrics import SpecMetrics
from .proposer import DraftInputs, MtpProposer
from .sampling import SamplingParams, SamplingTensors, make_generator, sample
from .sync_counter import HostSyncCounter, suspended_if_compiled
from .torchair_proposer import MtpTorchairProposer

logger = logging.getLogger(__name__)

TARGET_BATCH_ARGS = (BatchArg("input_ids", 0), BatchArg("positions", 0), BatchArg("slot_mapping", -1),
                     BatchArg("block_table", 0), BatchArg("seq_lens", 0))


@dataclass
class Sequence:
    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


@dataclass(frozen=True)
class RequestOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    #: one {token_id: logprob} per generated token (top-N plus the sampled token) when asked for
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RunStats:
    backend: str
    num_steps: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    host_syncs: int = 0
    host_sync_events: list[str] = field(default_factory=list)
    recompiles_after_warmup: int = 0
    preemptions: int = 0
    compile_seconds: dict[str, dict[int, float]] = field(default_factory=dict)

    @property
    def host_syncs_per_step(self) -> float:
        return self.host_syncs / self.num_steps if self.num_steps else 0.0


def top_logprobs(logits: torch.Tensor, sampled: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """logits [B, Q, V], sampled [B, Q] (−1 placeholders allowed) → (top ids, top logprobs [B, Q, n],
    sampled token's logprob [B, Q]); raw log-softmax of the target's logits, as vLLM's default reports."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = lp.topk(n, dim=-1) if n else (lp[..., :0], sampled.new_zeros(*sampled.shape, 0))
    return top_ids, top_lp, lp.gather(-1, sampled.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def _logprob_entries(top_ids: list, top_lp: list, tok_lp: list, token: int) -> dict[int, float]:
    entry = dict(zip(top_ids, top_lp))
    entry[token] = tok_lp
    return entry


def dynamo_compile_count() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["stats"].values())) if "stats" in counters else 0


class Engine:
    def __init__(self, model: DeepseekV3ForCausalLM, cfg: EngineConfig, device: torch.device | str = "cpu",
                 count_host_syncs: bool = False) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = model.lm_head.weight.dtype
        self.count_host_syncs = count_host_syncs
        mcfg = model.cfg
        if cfg.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings "
                             f"({mcfg.max_position_embeddings})")
        self.eos_token_id = mcfg.eos_token_id
        self.spec = cfg.speculative
        self.k = self.spec.num_speculative_tokens if self.spec else 0
        self.caches = KVCaches.allocate(mcfg, cfg.max_model_len, cfg.max_num_seqs, self.device,
                                        dtype=self.dtype, num_blocks=cfg.kv_blocks)
        self.blocks = BlockManager(self.caches.allocator, cfg.max_model_len)
        self.backend: Backend = get_backend(
            cfg.graph.effective_backend, self.device, mode=cfg.graph.mode,
            frozen_parameter=cfg.graph.enable_frozen_parameter, view_optimize=cfg.graph.enable_view_optimize,
            tiling_schedule_optimize=cfg.graph.tiling_schedule_optimize, use_cached_graph=cfg.graph.use_cached_graph)
        self.batch_sizes = cfg.graph.batch_sizes(cfg.max_num_seqs)
        self._target_eager = make_target_step(model)
        self.target_graph = BucketedGraph(self.backend, self._target_eager, "target", self.batch_sizes,
                                          TARGET_BATCH_ARGS)
        self.proposer: MtpProposer | None = None
        if self.spec:
            self.proposer = MtpTorchairProposer(model, self.spec, cfg.max_model_len, self.caches.draft,
                                                backend=self.backend, batch_sizes=self.batch_sizes)
        self._warm = False
        self._compiles_at_warmup = 0

    @property
    def backend_name(self) -> str:
        return self.backend.name

    # -- warm-up ----------------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> dict[str, dict[int, float]]:
        """Compile every bucket of the target step and the draft chain, largest first."""
        q = 1 + self.k
        b = self.target_graph.max_size
        ex = self._pad_batch(b, q)
        with torch.no_grad():
            times = {"target": self.target_graph.warmup(ex, (self.caches.target,), progress=progress)}
            if self.proposer is not None:
                times["draft"] = self.proposer.warmup(progress=progress)
        self._warm = True
        self._compiles_at_warmup = dynamo_compile_count()
        return times

    def _pad_batch(self, b: int, q: int) -> list[torch.Tensor]:
        dev = self.device
        z = torch.zeros(b, q, dtype=torch.long, device=dev)
        return [z, z, torch.full_like(z, -1),
                torch.zeros(b, self.caches.max_blocks_per_seq, dtype=torch.long, device=dev),
                torch.zeros(b, dtype=torch.long, device=dev)]

    # -- request lifecycle ------------------------------------------------------------------------
    def _block_row(self, seq: Sequence) -> list[int]:
        return seq.blocks + [0] * (self.caches.max_blocks_per_seq - len(seq.blocks))

    def _slots(self, seq: Sequence, positions: list[int]) -> list[int]:
        return [seq.blocks[p // KV_BLOCK_SIZE] * KV_BLOCK_SIZE + p % KV_BLOCK_SIZE
                if p < self.cfg.max_model_len else -1 for p in positions]

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append one generated token; returns True when the request just finished."""
        seq.output_ids.append(token)
        if self.eos_token_id is not None and token == self.eos_token_id:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= self.cfg.max_model_len:
            seq.finish_reason = "max_model_len"
        return seq.finish_reason is not None

    def _make_room(self, running: list[Sequence], waiting: deque[Sequence], stats: RunStats) -> None:
        """Blocks for every running sequence's next 1 + K tokens; while the pool is short, preempt the newest
        request (its blocks go back; it waits at the head of the queue and is recomputed, as in vLLM)."""
        i = 0
        while i < len(running):
            if self.blocks.ensure_capacity(running[i].blocks, running[i].num_tokens + self.k):
                i += 1
                continue
            victim = running.pop()
            self.blocks.free(victim.blocks)
            victim.draft_ids = []
            waiting.appendleft(victim)
            stats.preemptions += 1

    # -- prefill (eager, one request at a time, as nano-vllm) ----------------------------------------
    def _prefill(self, seq: Sequence, generator: torch.Generator | None) -> None:
        """Prefill the prompt, or for a preempted request its prompt and generated tokens (recompute), and sample
        the next token from the last position."""
        dev = self.device
        tokens = seq.prompt_ids + seq.output_ids
        n = len(tokens)
        positions = list(range(n))
        ids = torch.tensor([tokens], dtype=torch.long, device=dev)
        pos = torch.tensor([positions], dtype=torch.long, device=dev)
        slots = torch.tensor([self._slots(seq, positions)], dtype=torch.long, device=dev)
        table = torch.tensor([self._block_row(seq)], dtype=torch.long, device=dev)
        seq_lens = torch.tensor([n], dtype=torch.long, device=dev)
        with torch.no_grad():
            hidden, logits = self._target_eager(ids, pos, slots, table, seq_lens, self.caches.target)
            token = sample(logits[:, -1], SamplingTensors.from_params([seq.params], dev), generator)
        first = int(token[0])
        if seq.params.logprobs is not None:
            top_ids, top_lp, tok_lp = (t.tolist() for t in top_logprobs(logits[:, -1:], token.view(1, 1),
                                                                          seq.params.logprobs))
            seq.logprobs = [*(seq.logprobs or []), _logprob_entries(top_ids[0][0], top_lp[0][0], tok_lp[0][0], first)]
        if self._append(seq, first) or self.proposer is None:
            return
        sample_idx = torch.tensor([n - 1], dtype=torch.long, device=dev)
        drafts = self.proposer.propose(DraftInputs(ids, pos, hidden, slots, token, sample_idx, table, seq_lens))
        seq.draft_ids = drafts[0].tolist()

    # -- one decode / verify step ---------------------------------------------------------------
    def _step(self, running: list[Sequence], generator: torch.Generator | None, stats: RunStats,
              metrics: SpecMetrics | None) -> list[Sequence]:
        dev = self.device
        q = 1 + self.k
        max_len = self.cfg.max_model_len
        rows_ids, rows_pos, rows_slots, num_draft = [], [], [], []
        for seq in running:
            p = seq.num_tokens - 1  # tokens already in the cache
            nd = max(0, min(self.k, max_len - p - 2))
            positions = [p + j for j in range(q)]
            rows_ids.append([seq.last_token] + seq.draft_ids[: self.k])
            rows_pos.append([x if x < max_len else 0 for x in positions])
            rows_slots.append(self._slots(seq, positions))
            num_draft.append(nd)
        b = len(running)
        input_ids = torch.tensor(rows_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(rows_pos, dtype=torch.long, device=dev)
        slots = torch.tensor(rows_slots, dtype=torch.long, device=dev)
        table = torch.tensor([self._block_row(s) for s in running], dtype=torch.long, device=dev)
        seq_lens = torch.tensor([min(s.num_tokens - 1 + q, max_len) for s in running], dtype=torch.long,
                                device=dev)
        st = SamplingTensors.from_params([s.params for s in running], dev)
        num_draft_t = torch.tensor(num_draft, dtype=torch.long, device=dev)

        counter = HostSyncCounter() if self.count_host_syncs else None
        with torch.no_grad():
            if counter is not None:
                counter.__enter__()
            try:
                with suspended_if_compiled(self.backend):
                    hidden, logits = self.target_graph([input_ids, positions, slots, table, seq_lens],
                                                       (self.caches.target,))
                if self.proposer is None:
                    sampled = sample(logits[:, 0], st, generator).view(b, 1)
                    valid = torch.ones(b, dtype=torch.long, device=dev)
                    drafts = None
                else:
                    sampled = spec_decode.rejection_sample(input_ids[:, 1:], num_draft_t, logits, st, None,
                                                           generator)
                    # No request is ever discarded here (no chunked prefill); the backup is the last known
                    # token, i.e. token_ids[num_tokens_no_spec - 1], already on device as input_ids[:, 0].
                    discard = torch.zeros(b, dtype=torch.bool, device=dev)
                    next_ids, valid = self.proposer.prepare_next_token_ids_padded(sampled, discard, input_ids[:, 0])
                    drafts = self._draft(input_ids, positions, hidden, slots, table, seq_lens, next_ids, valid,
                                         num_draft_t)
            finally:
                if counter is not None:
                    counter.__exit__(None, None, None)
                    stats.host_syncs += counter.count
                    stats.host_sync_events.extend(counter.events)
        n_logprobs = max((s.params.logprobs or 0 for s in running), default=0)
        want_logprobs = any(s.params.logprobs is not None for s in running)
        lp_h = ([t.tolist() for t in top_logprobs(logits[:, : sampled.shape[1]], sampled, n_logprobs)]
                if want_logprobs else None)
        # The one host transfer of the step: tokens for bookkeeping.
        sampled_h, valid_h = sampled.tolist(), valid.tolist()
        drafts_h = drafts.tolist() if drafts is not None else None
        finished = []
        for i, seq in enumerate(running):
            n_valid = valid_h[i]
            if metrics is not None:
                metrics.record(num_draft[i], n_valid - 1)
            for j, token in enumerate(sampled_h[i][:n_valid]):
                stats.generated_tokens += 1
                if lp_h is not None and seq.logprobs is not None:
                    n = seq.params.logprobs or 0
                    seq.logprobs.append(_logprob_entries(lp_h[0][i][j][:n], lp_h[1][i][j][:n], lp_h[2][i][j], token))
                if self._append(seq, token):
                    finished.append(seq)
                    break
            if drafts_h is not None:
                seq.draft_ids = drafts_h[i]
        stats.num_steps += 1
        return finished

    def _draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor,
               table: torch.Tensor, seq_lens: torch.Tensor, next_ids: torch.Tensor, valid: torch.Tensor,
               num_draft: torch.Tensor) -> torch.Tensor:
        assert self.proposer is not None and self.spec is not None
        b, q = input_ids.shape
        qsl = torch.arange(b + 1, device=input_ids.device) * q
        if not self.spec.disable_padded_drafter_batch:
            token_indices, _ = self.proposer.prepare_inputs_padded(qsl, num_draft, valid)
            sample_idx = token_indices - qsl[:-1]
            return self.proposer.propose(DraftInputs(input_ids, positions, hidden, slots, next_ids, sample_idx,
                                                     table, seq_lens))
        # Unpadded path (disable_padded_drafter_batch): drop rejected tokens on the host, as vLLM does,
        # then draft from the compacted spans re-packed as [B, max_len] with inert padding.
        num_rejected = torch.where(num_draft > 0, num_draft + 1 - valid, torch.zeros_like(valid)).cpu()
        new_qsl, token_indices = self.proposer.prepare_inputs(qsl.cpu(), num_rejected)
        lens = (new_qsl[1:] - new_qsl[:-1]).tolist()
        width = max(lens)
        flat = [t.reshape(b * q, *t.shape[2:]) for t in (input_ids, positions, hidden, slots)]
        rows: list[list[torch.Tensor]] = [[], [], [], []]
        for i, n in enumerate(lens):
            idx = token_indices[new_qsl[i]: new_qsl[i] + n].to(input_ids.device)
            for r, (src, pad) in enumerate(zip(flat, (0, 0, 0.0, -1))):
                piece = src.index_select(0, idx)
                filler = torch.full((width - n, *src.shape[1:]), pad, dtype=src.dtype, device=src.device)
                rows[r].append(torch.cat([piece, filler]))
        ids_c, pos_c, hid_c, slots_c = (torch.stack(r) for r in rows)
        sample_idx = torch.tensor([n - 1 for n in lens], dtype=torch.long, device=input_ids.device)
        seq_lens_c = positions.gather(1, sample_idx.view(-1, 1)).view(-1) + 1
        return self.proposer.propose(DraftInputs(ids_c, pos_c, hid_c, slots_c, next_ids, sample_idx, table,
                                                 seq_lens_c))

    # -- generation loop ------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_tokens: int | list[int], seed: int | None = None, arrivals: list[int] | None = None
                 ) -> tuple[list[RequestOutput], RunStats, SpecMetrics | None]:
        """``arrivals``: the decode step at which each request arrives (default: all at step 0); an idle engine
        takes the next arrival at once."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        if len(max_tokens) != len(prompts) or any(m < 1 for m in max_tokens):
            raise ValueError(f"max_tokens={max_tokens}; allowed: an int >= 1, or one per prompt")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(p) >= self.cfg.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; max_model_len={self.cfg.max_model_len} "
                                 "leaves no room to generate")
            bad = [t for t in p if not 0 <= t < self.model.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, {self.model.cfg.vocab_size})")
        arrivals = [0] * len(prompts) if arrivals is None else list(arrivals)
        if len(arrivals) != len(prompts) or any(a < 0 for a in arrivals):
            raise ValueError(f"arrivals: got {len(arrivals)} for {len(prompts)} prompts; allowed: one step >= 0 each")
        if not self._warm and self.backend.name != "eager":
            self.warmup()
        generator = make_generator(seed, self.device)
        seqs = [Sequence(i, list(p), sp, mt) for i, (p, sp, mt) in enumerate(zip(prompts, params, max_tokens))]
        waiting, running = deque(sorted(seqs, key=lambda s: arrivals[s.req_id])), []
        stats = RunStats(backend=self.backend.name)
        metrics = SpecMetrics(self.k) if self.k else None
        compiles_before = dynamo_compile_count()
        start = time.perf_counter()
        while waiting or running:
            while (waiting and len(running) < self.cfg.max_num_seqs
                   and (arrivals[waiting[0].req_id] <= stats.num_steps or not running)):
                # room for the prefill and the first verify step (1 + K tokens); more as the sequence grows
                if not self.blocks.ensure_capacity(waiting[0].blocks, waiting[0].num_tokens + 1 + self.k):
                    break
                seq = waiting.popleft()
                self._prefill(seq, generator)
                stats.generated_tokens += 1
                if seq.finish_reason:
                    self.blocks.free(seq.blocks)
                else:
                    running.append(seq)
            self._make_room(running, waiting, stats)
            if not running:
                continue
            for seq in self._step(running, generator, stats, metrics):
                running.remove(seq)
                self.blocks.free(seq.blocks)
        stats.decode_seconds = time.perf_counter() - start
        if self._warm:
            stats.recompiles_after_warmup = dynamo_compile_count() - max(compiles_before, self._compiles_at_warmup)
        outputs = [RequestOutput(s.prompt_ids, s.output_ids, s.finish_reason or "length", s.logprobs) for s in seqs]
        return outputs, stats, metrics


def load_engine(model_dir: str | Path, cfg: EngineConfig, device: str = "cpu", count_host_syncs: bool = False,
                dtype: str | torch.dtype | None = None) -> Engine:
    """``dtype``: float32 | bfloat16 | float16; default the checkpoint's ``torch_dtype``."""
    from .graph.weights import load_model

    return Engine(load_model(model_dir, device=device, dtype=dtype), cfg, device=device,
                  count_host_syncs=count_host_syncs)
