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

import dataclasses
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import spec_decode
from .config import EngineConfig
from .fused_step import GREEDY, RANDOM, SpecStepGraphs, StepKey, choose_k, context_buckets, time_call
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


@dataclass
class DeviceBatch:
    """The running batch's next step inputs, on device, padded to its graph bucket (pad rows: ``live`` False).

    The fused graph advances ``input_ids`` and ``start`` itself; the host rebuilds the batch only when its
    composition, K or sampling mode changes.
    """

    req_ids: tuple[int, ...]
    k: int
    mode: str
    input_ids: torch.Tensor  # [Bp, 1+k]: last token, then the drafts
    start: torch.Tensor  # [Bp]: position of input_ids[:, 0]
    num_draft: torch.Tensor  # [Bp]
    num_draft_host: list[int]  # the same, for the real rows (metrics)
    block_table: torch.Tensor  # [Bp, M]
    live: torch.Tensor  # [Bp] bool
    sampling: SamplingTensors  # fields [Bp]

    @property
    def bucket(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance a_j = P(draft j accepted | drafts < j accepted), Laplace-smoothed."""

    offered: list[int]
    accepted: list[int]

    @classmethod
    def empty(cls, k: int) -> "AcceptanceTracker":
        return cls([0] * k, [0] * k)

    def record(self, num_draft: int, num_accepted: int) -> None:
        for j in range(num_draft):
            if j <= num_accepted:
                self.offered[j] += 1
                self.accepted[j] += j < num_accepted

    def rates(self) -> list[float]:
        return [(a + 1) / (o + 2) for a, o in zip(self.accepted, self.offered)]


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
    request_steps: int = 0  # Σ over steps of the batch size
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    host_syncs: int = 0
    host_sync_events: list[str] = field(default_factory=list)
    recompiles_after_warmup: int = 0
    preemptions: int = 0
    compile_seconds: dict[str, dict[int, float]] = field(default_factory=dict)
    #: fused path: steps run per K, and the K each bucket would choose at the end of the run
    steps_per_k: dict[int, int] = field(default_factory=dict)
    k_by_bucket: dict[int, int] = field(default_factory=dict)
    #: host-side seconds per step outside the graph call (input building, bookkeeping)
    host_seconds: float = 0.0

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
        self.spec_graphs = SpecStepGraphs(model, self.backend, cfg.max_model_len)
        self.context_sizes = context_buckets(cfg.max_model_len)
        self.k_by_bucket = {b: self.k for b in self.batch_sizes}
        #: measured at warm-up when adaptive_k: seconds of one fused step per bucket and K
        self.step_seconds: dict[int, dict[int, float]] = {}
        self.acceptance = AcceptanceTracker.empty(self.k)
        #: run every fused step at this K (0..K_max; its graphs must be warm: adaptive_k warms them all)
        self.force_k: int | None = None
        self._steps_at_k: dict[int, int] = {}
        self._batch: DeviceBatch | None = None
        self._pending_drafts: dict[int, list[int]] = {}
        self._unused_noise: dict[tuple[int, int], spec_decode.RejectionNoise] = {}  # drafts brought to the host when leaving the fused path
        self._warm = False
        self._compiles_at_warmup = 0

    @property
    def backend_name(self) -> str:
        return self.backend.name

    # -- warm-up ----------------------------------------------------------------------------------
    def warmup(self, progress: bool = True, modes: tuple[str, ...] = (GREEDY,)) -> dict[str, dict[int, float]]:
        """Compile every graph a greedy run replays, largest bucket first: the fused step per bucket, context
        width and K (every K in 0..K_max when ``adaptive_k``, then timed), or the target step and draft chain.
        Fused graphs for random sampling compile on first use, or here with ``modes=(GREEDY, RANDOM)``."""
        with torch.no_grad():
            times = self._warmup_fused(progress, modes) if self.cfg.fused_step else self._warmup_unfused(progress)
        self._warm = True
        self._compiles_at_warmup = dynamo_compile_count()
        return times

    def time_step(self, bucket: int, k: int, context: int, repeats: int = 5) -> float:
        """Median seconds of one fused greedy step (bucket, K, context width) on an inert batch; shapes, not data,
        set its cost."""
        batch = self._inert_batch(bucket, k)
        with torch.no_grad():
            return time_call(lambda: self._replay(batch, context, None), repeats=repeats)

    def _warmup_unfused(self, progress: bool) -> dict[str, dict[int, float]]:
        ex = self._pad_batch(self.target_graph.max_size, 1 + self.k)
        times = {"target": self.target_graph.warmup(ex, (self.caches.target,), progress=progress)}
        if self.proposer is not None:
            times["draft"] = self.proposer.warmup(progress=progress)
        return times

    def _warmup_fused(self, progress: bool, modes: tuple[str, ...]) -> dict[str, dict[int, float]]:
        ks = list(range(self.k + 1)) if self.cfg.adaptive_k else [self.k]
        times: dict[str, dict[int, float]] = {}
        for bucket in sorted(self.batch_sizes, reverse=True):
            for k in ks:
                batch = self._inert_batch(bucket, k)
                for mode, ctx in itertools.product(modes, self.context_sizes):
                    start = time.perf_counter()
                    self._replay(dataclasses.replace(batch, mode=mode), ctx, None)
                    name = f"spec_k{k}_ctx{ctx}" + ("" if mode == GREEDY else f"_{mode}")
                    times.setdefault(name, {})[bucket] = time.perf_counter() - start
                if self.cfg.adaptive_k:
                    self.step_seconds.setdefault(bucket, {})[k] = self.time_step(bucket, k, self.context_sizes[-1])
            if progress:
                logger.info("compiled fused steps for batch bucket %d", bucket)
        self._batch = None
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

    def _step_tokens(self, seq: Sequence) -> int:
        """Cache room one step needs: verify positions up to ``start + K``, chained draft positions up to
        ``start + 2K - 1`` (``start = num_tokens - 1``)."""
        return seq.num_tokens - 1 + max(1 + self.k, 2 * self.k)

    def _make_room(self, running: list[Sequence], waiting: deque[Sequence], stats: RunStats) -> None:
        """Blocks for every running sequence's next step; while the pool is short, preempt the newest request
        (its blocks go back; it waits at the head of the queue and is recomputed, as in vLLM)."""
        i, grown = 0, False
        while i < len(running):
            held = len(running[i].blocks)
            if self.blocks.ensure_capacity(running[i].blocks, self._step_tokens(running[i])):
                grown |= len(running[i].blocks) > held
                i += 1
                continue
            victim = running.pop()
            self.blocks.free(victim.blocks)
            victim.draft_ids = []
            self._pending_drafts.pop(victim.req_id, None)
            waiting.appendleft(victim)
            stats.preemptions += 1
        batch = self._batch
        if grown and batch is not None and batch.req_ids == tuple(s.req_id for s in running):
            # the fused path keeps the block table on device: new blocks go in out of place
            batch.block_table = self._block_table(running, batch.bucket)

    def _block_table(self, running: list[Sequence], bucket: int) -> torch.Tensor:
        rows = [self._block_row(s) for s in running] + [[0] * self.caches.max_blocks_per_seq] * (bucket - len(running))
        return torch.tensor(rows, dtype=torch.long, device=self.device)

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
        # A prompt has its own length: the eager reference drafts it (a prompt of exactly 1 + K tokens would
        # otherwise hit a verify-layout graph that the fused warm-up never compiles).
        drafts = self.proposer.propose_reference(DraftInputs(ids, pos, hidden, slots, token, sample_idx, table,
                                                             seq_lens))
        seq.draft_ids = drafts[0].tolist()

    # -- one decode / verify step ---------------------------------------------------------------
    def _step(self, running: list[Sequence], generator: torch.Generator | None, stats: RunStats,
              metrics: SpecMetrics | None) -> list[Sequence]:
        if self._fused_applies(running):
            return self._step_fused(running, generator, stats, metrics)
        self._drafts_to_host()
        return self._step_unfused(running, generator, stats, metrics)

    def _fused_applies(self, running: list[Sequence]) -> bool:
        return (self.cfg.fused_step and self.target_graph.bucket_for(len(running)) is not None
                and not (self.spec is not None and self.spec.disable_padded_drafter_batch)
                and all(s.params.logprobs is None for s in running))

    # -- fused path: one graph per step over device-side state ------------------------------------
    def _k_for(self, bucket: int) -> int:
        if self.force_k is not None:
            return self.force_k
        if not self.cfg.adaptive_k or bucket not in self.step_seconds:
            return self.k
        k = choose_k(self.step_seconds[bucket], self.acceptance.rates())
        self.k_by_bucket[bucket] = k
        # Keep the acceptance estimate alive while speculation is off: one step in 16 drafts K_max.
        n = self._steps_at_k[bucket] = self._steps_at_k.get(bucket, 0) + 1
        return self.k if k < self.k and n % 16 == 0 else k

    def _inert_batch(self, bucket: int, k: int) -> DeviceBatch:
        dev = self.device
        # Distinct tensors: Dynamo guards on aliasing, and a run never passes one tensor twice.
        return DeviceBatch((), k, GREEDY, torch.zeros(bucket, 1 + k, dtype=torch.long, device=dev),
                           torch.zeros(bucket, dtype=torch.long, device=dev),
                           torch.zeros(bucket, dtype=torch.long, device=dev), [],
                           torch.zeros(bucket, self.caches.max_blocks_per_seq, dtype=torch.long, device=dev),
                           torch.zeros(bucket, dtype=torch.bool, device=dev),
                           SamplingTensors.greedy_batch(bucket, dev))

    def _build_batch(self, running: list[Sequence], k: int, mode: str) -> DeviceBatch:
        """Device state for ``running``: drafts of rows already in the previous batch are gathered on device
        (they never went to the host); requests just prefilled bring theirs from the host."""
        dev = self.device
        b = len(running)
        bucket = self.target_graph.bucket_for(b)
        old = self._batch
        old_rows = {rid: i for i, rid in enumerate(old.req_ids)} if old is not None else {}
        drafts = torch.zeros(bucket, k, dtype=torch.long, device=dev)
        counts = []
        from_old = [(i, old_rows[s.req_id]) for i, s in enumerate(running) if s.req_id in old_rows]
        if from_old and k:
            rows, src = (torch.tensor(x, dtype=torch.long, device=dev) for x in zip(*from_old))
            width = min(k, old.k)
            drafts[rows, :width] = old.input_ids.index_select(0, src)[:, 1: 1 + width]
        for i, s in enumerate(running):
            j = old_rows.get(s.req_id)
            if j is not None:
                counts.append(min(old.num_draft_host[j], k))
            else:
                own = s.draft_ids[:k]
                if own:
                    drafts[i, : len(own)] = torch.tensor(own, dtype=torch.long, device=dev)
                counts.append(len(own))
        pad = bucket - b
        last = torch.tensor([s.last_token for s in running] + [0] * pad, dtype=torch.long, device=dev)
        return DeviceBatch(
            req_ids=tuple(s.req_id for s in running), k=k, mode=mode,
            input_ids=torch.cat([last.view(-1, 1), drafts], dim=1),
            start=torch.tensor([s.num_tokens - 1 for s in running] + [0] * pad, dtype=torch.long, device=dev),
            num_draft=torch.tensor(counts + [0] * pad, dtype=torch.long, device=dev), num_draft_host=counts,
            block_table=self._block_table(running, bucket),
            live=torch.tensor([True] * b + [False] * pad, device=dev),
            sampling=SamplingTensors.from_params([s.params for s in running] + [SamplingParams()] * pad, dev))

    def _drafts_to_host(self) -> None:
        """Leaving the fused path (e.g. a request wants logprobs): the step-by-step path reads drafts from the host."""
        if self._batch is None:
            return
        batch, self._batch = self._batch, None
        self._pending_drafts = {rid: row[1: 1 + batch.k] for rid, row in
                                zip(batch.req_ids, batch.input_ids[: len(batch.req_ids)].tolist())}

    def _replay(self, batch: DeviceBatch, context: int, noise: spec_decode.RejectionNoise | None
                ) -> tuple[torch.Tensor, ...]:
        st = batch.sampling
        if noise is None:  # greedy: the graph takes noise inputs it does not read; one placeholder per shape
            noise = self._unused_noise.get((batch.bucket, batch.k))
            if noise is None:
                noise = self._unused_noise[(batch.bucket, batch.k)] = spec_decode.RejectionNoise(
                    torch.zeros(batch.bucket, batch.k, device=self.device),
                    torch.ones(batch.bucket, self.model.cfg.vocab_size, device=self.device))
        key = StepKey(batch.bucket, batch.k, batch.mode, context)
        with suspended_if_compiled(self.backend):
            return self.spec_graphs(key, batch.input_ids, batch.start, batch.num_draft,
                         batch.block_table[:, : context // KV_BLOCK_SIZE], batch.live, st.temperature, st.top_k,
                         st.top_p, st.greedy, noise.uniform, noise.exponential, self.caches.target, self.caches.draft)

    def _step_fused(self, running: list[Sequence], generator: torch.Generator | None, stats: RunStats,
                    metrics: SpecMetrics | None) -> list[Sequence]:
        t0 = time.perf_counter()
        b = len(running)
        bucket = self.target_graph.bucket_for(b)
        k = self._k_for(bucket)
        mode = GREEDY if all(s.params.is_greedy for s in running) else RANDOM
        ids = tuple(s.req_id for s in running)
        batch = self._batch
        if batch is None or batch.req_ids != ids or batch.k != k or batch.mode != mode:
            batch = self._batch = self._build_batch(running, k, mode)
        max_len = self.cfg.max_model_len
        # Keys the step reads: verify positions up to start + k, draft positions up to start + 2k - 1.
        longest = max(min(s.num_tokens + 2 * k, max_len) for s in running)
        context = next(c for c in self.context_sizes if c >= longest)
        noise = None
        if mode == RANDOM:
            drawn = spec_decode.RejectionNoise.draw(b, k, self.model.cfg.vocab_size, generator, self.device)
            noise = spec_decode.RejectionNoise(
                torch.cat([drawn.uniform, drawn.uniform.new_zeros(bucket - b, k)]),
                torch.cat([drawn.exponential, drawn.exponential.new_ones(bucket - b, drawn.exponential.shape[1])]))
        counter = HostSyncCounter() if self.count_host_syncs else None
        t1 = time.perf_counter()
        with torch.no_grad():
            if counter is not None:
                counter.__enter__()
            try:
                sampled, valid, next_input, next_start = self._replay(batch, context, noise)
            finally:
                if counter is not None:
                    counter.__exit__(None, None, None)
                    stats.host_syncs += counter.count
                    stats.host_sync_events.extend(counter.events)
        t2 = time.perf_counter()
        if self.backend.reuses_outputs:
            next_input, next_start = next_input.clone(), next_start.clone()
        # The one host transfer of the step: the tokens, for bookkeeping.
        out_h = torch.cat([sampled[:b].long(), valid[:b].long().view(-1, 1)], dim=1).tolist()
        num_draft = [max(0, min(n, max_len - (s.num_tokens - 1) - 2)) for n, s in zip(batch.num_draft_host, running)]
        batch.input_ids, batch.start = next_input, next_start
        if batch.num_draft_host != [k] * b:
            batch.num_draft = torch.full_like(batch.num_draft, k)
            batch.num_draft_host = [k] * b
        finished = []
        for i, seq in enumerate(running):
            row, n_valid = out_h[i][:-1], out_h[i][-1]
            if metrics is not None:
                metrics.record(num_draft[i], n_valid - 1)
            if self.k:
                self.acceptance.record(num_draft[i], n_valid - 1)
            for token in row[:n_valid]:
                stats.generated_tokens += 1
                if self._append(seq, token):
                    finished.append(seq)
                    break
        stats.num_steps += 1
        stats.request_steps += b
        stats.steps_per_k[k] = stats.steps_per_k.get(k, 0) + 1
        stats.host_seconds += (t1 - t0) + (time.perf_counter() - t2)
        return finished

    # -- step-by-step path: target graph, eager sampling, draft graph ------------------------------
    def _step_unfused(self, running: list[Sequence], generator: torch.Generator | None, stats: RunStats,
                      metrics: SpecMetrics | None) -> list[Sequence]:
        for seq in running:
            if seq.req_id in self._pending_drafts:
                seq.draft_ids = self._pending_drafts.pop(seq.req_id)
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
        stats.request_steps += b
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
                # room for the prefill and the first step after it; more as the sequence grows
                if not self.blocks.ensure_capacity(waiting[0].blocks, self._step_tokens(waiting[0]) + 1):
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
        stats.k_by_bucket = dict(self.k_by_bucket)
        self._batch = None
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
