"""The model runner: runs the scheduler's plan (:meth:`ModelRunner.run`) on its compiled graphs — a prefill
(:mod:`.chunks`), or one decode step, fused here or step by step (:mod:`.step_by_step`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Iterable

import torch

from . import spec_decode
from .chunks import Chunks
from .config import EngineConfig
from .fused_step import SpecStepGraphs, StepKey
from .graph.backends import Backend, get_backend
from .graph.buckets import BatchArg, BucketedGraph
from .graph.model import DeepseekV3ForCausalLM
from .graph.steps import make_prefill_step, make_target_step
from .graphs import GraphRegistry
from .inputs import DeviceBatch, block_table, device_batch
from .k_policy import KPolicy
from .kv_cache import KVCaches
from .metrics import RunStats
from .requests import Sequence, StepOutput, StepPlan, drafts_fit, step_tokens
from .runner_parts import RunnerParts
from .sampling import GREEDY, RANDOM, row_logprobs
from .step_by_step import StepByStep
from .sync_counter import counted_into, suspended_if_compiled
from .torchair_proposer import MtpTorchairProposer
from .warmup import GraphWarmup

logger = logging.getLogger(__name__)


TARGET_BATCH_ARGS = (BatchArg("input_ids", 0), BatchArg("positions", 0), BatchArg("slot_mapping", -1),
                     BatchArg("block_table", 0, width=True), BatchArg("seq_lens", 0))
PREFILL_BATCH_ARGS = (BatchArg("input_ids", 0, query=True), BatchArg("positions", 0, query=True),
                      BatchArg("slot_mapping", -1, query=True), BatchArg("block_table", 0, width=True),
                      BatchArg("seq_lens", 0), BatchArg("last_idx", 0))


class ModelRunner:
    def __init__(self, model: DeepseekV3ForCausalLM, cfg: EngineConfig, device: torch.device, caches: KVCaches,
                 k_policy: KPolicy, count_host_syncs: bool = False) -> None:
        self.model = model
        self.cfg = cfg
        self.device = device
        self.caches = caches
        #: this step's K: the scheduler asks it, each fused step tells it what the step cost
        self.k_policy = k_policy
        self.count_host_syncs = count_host_syncs
        self.spec = cfg.speculative
        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        g = cfg.graph
        self.backend: Backend = get_backend(
            g.effective_backend, device, mode=g.mode, frozen_parameter=g.enable_frozen_parameter,
            view_optimize=g.enable_view_optimize, tiling_schedule_optimize=g.tiling_schedule_optimize,
            use_cached_graph=g.use_cached_graph, input_guards_only=True, graph_failure=cfg.graph_failure,
            draft_kv_lengths=g.draft_kv_lengths)
        self.shapes = self.backend.shapes
        #: nominal batch buckets: graph sizes on per-shape backends, the units adaptive K is chosen for everywhere
        self.batch_sizes = g.batch_sizes(cfg.max_num_seqs)
        unpadded = bool(self.spec and self.spec.disable_padded_drafter_batch)
        #: every compiled graph of this runner, their warm-up, failures and on-disk key
        self.graphs = GraphRegistry(model, self.backend, device, key_options={
            "shapes": dataclasses.asdict(self.shapes),
            "compile_regions": getattr(self.backend, "compile_regions", False),
            "block_size": cfg.block_size, "kv_layout": cfg.kv_layout,
            # one dynamic-batch graph serves any bucket list
            "batch_sizes": None if self.shapes.dynamic_batch else self.batch_sizes,
            "disable_padded_drafter_batch": unpadded})
        model.use_backend(self.backend)
        model.set_compile_regions(getattr(self.backend, "compile_regions", False))
        self._target_eager = make_target_step(model)
        self.target_graph = self.graphs.add("target", BucketedGraph(
            self.backend, self._target_eager, "target", self.batch_sizes, TARGET_BATCH_ARGS,
            host_lengths=model.takes_host_lengths))
        # Prompts replay a graph too (a query axis: dynamic on CPU, padded to a few widths where graphs replay one
        # shape): speculating requests finish apart and are prefilled one by one, each costing an eager forward.
        self.prefill_eager = make_prefill_step(model)
        self.prefill_graph: BucketedGraph | None = None
        if g.prefill_query_widths:
            self.prefill_graph = self.graphs.add("prefill", BucketedGraph(
                self.backend, self.prefill_eager, "prefill", self.batch_sizes, PREFILL_BATCH_ARGS,
                query_widths=g.prefill_query_widths, host_lengths=model.takes_host_lengths))
        self.proposer: MtpTorchairProposer | None = None
        if self.spec:
            self.proposer = MtpTorchairProposer(model, self.spec, cfg.max_model_len, caches.draft,
                                                backend=self.backend, batch_sizes=self.batch_sizes,
                                                prefill_widths=cfg.graph.prefill_query_widths)
            self.graphs.add("draft", self.proposer.graph)
        self.spec_graphs = self.graphs.add("fused", SpecStepGraphs(model, self.backend, cfg.max_model_len,
                                                                   keep_hidden=self.proposer is not None,
                                                                   unpadded=unpadded))
        #: called after each fused replay with its key and arguments (benchmarks time the phases on them)
        self.step_observer: Callable[[StepKey, tuple], None] | None = None
        self._batch: DeviceBatch | None = None
        #: when the last fused step ended (None: none yet in this run, or a step-by-step one came between)
        self._last_step_end: float | None = None
        #: what the rooms below share (prefill, step by step, warm-up): they take these, not the runner
        self.parts = RunnerParts(cfg, device, self.backend, caches, self.batch_sizes, self.graphs, self.target_graph,
                                 self.prefill_graph, self.prefill_eager, self.proposer, self.spec_graphs,
                                 model.cfg.vocab_size, model.takes_host_lengths, count_host_syncs)
        #: which graphs are warm, and the warm-ups that compile (or load) more of them; the scheduler hands it to
        #: the K policy, which compiles a K warm-up deferred when it first picks it
        self.warm = GraphWarmup(self.parts, k_policy.costs, self.drop_batch)
        #: K values warm-up had deferred after the last fused step (one fewer: a compile ran since)
        self._deferred_left = len(self.warm.deferred)
        self.step_by_step = StepByStep(self.parts)
        self.chunks = Chunks(self.parts, self.warm)

    @property
    def step_seconds(self) -> dict[int, dict[int, float]]:
        """Seconds of one fused step per bucket and K, measured at warm-up (adaptive_k)."""
        return self.k_policy.step_seconds

    # -- shapes ---------------------------------------------------------------------------------
    @property
    def max_blocks(self) -> int:
        return self.caches.max_blocks_per_seq

    def width_for(self, longest_tokens: int) -> int:
        """Block-table columns a step reaching ``longest_tokens`` passes (``inputs.table_width``)."""
        return self.parts.width_for(longest_tokens)

    def nominal_bucket(self, batch: int) -> int | None:
        """The nominal bucket of ``batch`` requests (adaptive K, statistics); None above the largest."""
        return self.k_policy.nominal_bucket(batch)

    def rows_for(self, batch: int) -> int | None:
        """Graph rows for ``batch`` requests, at any K (:meth:`.warmup.GraphWarmup.rows_for`: a lone request's
        graphs may be warm or not)."""
        return self.warm.rows_for(batch)

    # -- warm-up (which graphs, when: .warmup) -------------------------------------------------------
    def drop_batch(self) -> None:
        """The next fused step builds its device batch anew (warm-up replayed inert batches through its graphs)."""
        self._batch = None

    def inert_batch(self, rows: int, k: int) -> DeviceBatch:
        return self.parts.inert_batch(rows, k)

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence], generator: torch.Generator | None) -> StepOutput:
        """:meth:`.chunks.Chunks.prefill`; what the runner kept of a preempted request (drafts, hidden states) is void.
        (The device batch has left it: a step ran without it since, as the pool always holds the oldest request.)"""
        for seq in seqs:
            self.step_by_step.forget(seq.req_id)
            self.chunks.forget(seq.req_id)
        return self.chunks.prefill(seqs, generator)

    # -- decode -------------------------------------------------------------------------------------
    def run(self, plan: StepPlan, generator: torch.Generator | None, stats: RunStats) -> StepOutput | None:
        """Run one turn as the scheduler planned it: a prefill of ``plan.admitted``, or a decode step of
        ``plan.running`` at ``plan.k`` (preemption while making room may have shrunk the batch since the K policy
        gave its K, which keeps the fused path applicable: a smaller batch fits a bucket, and its rows' logprobs
        were already allowed). None: the plan runs nothing."""
        if plan.admitted:
            return self.prefill(plan.admitted, generator)
        if not plan.running:
            return None
        if plan.fused:
            return self._step_fused(plan, generator, stats)
        if self._batch is not None:  # leaving the fused path: its drafts go to the host
            self.step_by_step.take_drafts(self._batch)
            self._batch = None
        self._last_step_end = None
        return self.step_by_step.step(plan.running, generator, stats)

    def end_run(self) -> dict[int, int]:
        """The K each bucket runs at now (fixed K: K_max)."""
        self._batch = None
        self._last_step_end = None
        self.chunks.undrafted.clear()
        return self.k_policy.chosen(self.batch_sizes)

    # -- fused path: one graph per step over device-side state ------------------------------------
    def replay(self, batch: DeviceBatch, width: int, noise: spec_decode.RejectionNoise | None
               ) -> tuple[torch.Tensor, ...]:
        return self.parts.replay(batch, width, noise)

    def _replay_args(self, batch: DeviceBatch, width: int, noise: spec_decode.RejectionNoise | None,
                     running: list[Sequence]) -> tuple[StepKey, tuple]:
        """The fused step's arguments for ``batch``, whose live rows are ``running``
        (:meth:`.runner_parts.RunnerParts.replay_args`)."""
        return self.parts.replay_args(batch, width, noise, running)

    def host_lengths(self, lengths: Iterable[int]) -> tuple[int, ...] | None:
        """KV lengths as host ints for attention that reads them (``model.takes_host_lengths``), else None."""
        return self.parts.host_lengths(lengths)

    def _step_fused(self, plan: StepPlan, generator: torch.Generator | None, stats: RunStats) -> StepOutput:
        t0 = time.perf_counter()
        running = plan.running
        b = len(running)
        fitted = self.nominal_bucket(b)
        # a preemption since the plan may have moved the batch to another bucket: its K was not asked for this one
        planned = fitted == plan.bucket
        full = planned and fitted == b  # the live rows fill their bucket
        bucket, k = plan.bucket, plan.k
        mode = GREEDY if all(s.params.is_greedy for s in running) else RANDOM
        want_lp = any(s.params.logprobs is not None for s in running)
        ids = tuple(s.req_id for s in running)
        batch = self._batch
        t_cost = t0  # where the step's cost starts, for adaptive K
        # what ran since the previous step (prefills, the engine's loop), for adaptive K: see AdaptiveK.between;
        # not known where a deferred K compiled since (no step's cost, and it ran between no steps)
        compiled = len(self.warm.deferred) != self._deferred_left
        between = None if self._last_step_end is None or compiled else t0 - self._last_step_end
        switched = batch is not None and batch.k != k
        if (batch is None or batch.req_ids != ids or batch.k != k or batch.mode != mode
                or batch.logprobs != want_lp):
            batch = self._batch = device_batch(running, self.rows_for(b), k, mode, want_lp, self._batch,
                                               self.max_blocks, self.device)
            stats.batch_rebuilds += 1
            if k and self.chunks.undrafted:
                self.chunks.catch_up(batch, running)
            if switched:
                stats.k_switches += 1
                between = None  # what ran before a switch belongs to the K that ran then
                # A change of K pays a rebuild (and, out of K = 0, the MTP catch-up): a cost of switching, which
                # SWITCH_MARGIN weighs, not of running at K; counted in, it would price an explored K too dear.
                t_cost = time.perf_counter()
                switch = t_cost - t0
                stats.switch_seconds += switch
                if planned:
                    self.k_policy.observe_switch(bucket, switch)
        held = tuple(len(s.blocks) for s in running)
        if held != batch.blocks_held:  # a request gained a block: out of place, a replay may still read the old table
            batch.block_table, batch.blocks_held = block_table(running, batch.rows, self.max_blocks, self.device), held
        max_len = self.cfg.max_model_len
        width = self.width_for(max(step_tokens(s.num_tokens, k) for s in running))
        stats.attention_keys_read += batch.rows * width * self.caches.block_size
        stats.attention_keys_live += sum(s.num_tokens for s in running) + b * k
        noise = None
        if mode == RANDOM:
            drawn = spec_decode.RejectionNoise.draw(b, k, self.model.cfg.vocab_size, generator, self.device)
            pad = batch.rows - b
            noise = spec_decode.RejectionNoise(
                torch.cat([drawn.uniform, drawn.uniform.new_zeros(pad, k)]),
                torch.cat([drawn.exponential, drawn.exponential.new_ones(pad, drawn.exponential.shape[1])]))
        key, args = self._replay_args(batch, width, noise, running)
        t1 = time.perf_counter()
        with torch.no_grad(), counted_into(stats, self.count_host_syncs), suspended_if_compiled(self.backend):
            sampled, valid, next_input, next_start, *lp = self.spec_graphs(key, *args)
            hidden = lp.pop() if k == 0 and self.spec_graphs.keep_hidden else None
        t2 = time.perf_counter()
        stats.graph_seconds += t2 - t1
        if self.step_observer is not None:
            self.step_observer(key, args)
            t2 = time.perf_counter()  # the observer's time is nobody's: not the host's either
        if self.backend.reuses_outputs:
            next_input, next_start = next_input.clone(), next_start.clone()
            hidden = hidden.clone() if hidden is not None else None
        if hidden is not None:
            self.chunks.note_undrafted(running, hidden)
        # The one host transfer of the step: the tokens, for bookkeeping (counted: it must stay one).
        with counted_into(stats, self.count_host_syncs, transfers=True):
            out_h = torch.cat([sampled[:b].long(), valid[:b].long().view(-1, 1)], dim=1).tolist()
            lp_h = [t[:b].tolist() for t in lp] if lp else None
        num_draft = [drafts_fit(s.num_tokens, n, max_len) for n, s in zip(batch.num_draft_host, running)]
        batch.input_ids, batch.start = next_input, next_start
        if batch.num_draft_host != [k] * b:
            batch.num_draft = torch.full_like(batch.num_draft, k)
            batch.num_draft_host = [k] * b
        tokens = [row[: row[-1]] for row in out_h]
        logprobs = row_logprobs([s.params.logprobs for s in running], tokens, lp_h) if lp_h is not None else None
        stats.steps_per_k[k] = stats.steps_per_k.get(k, 0) + 1
        end = self._last_step_end = time.perf_counter()
        self._deferred_left = len(self.warm.deferred)
        stats.host_seconds += (t1 - t0) + (end - t2)
        if full or planned and not self.shapes.dynamic_batch:
            # What this K costs: the step itself, graph and host (a rebuild for new requests included, not one for
            # a new K), and apart from it what ran since the step before. Dynamic-batch backends count only a full
            # bucket's steps: they run the live rows, and a draining queue's steps (rows falling to 1) would drag
            # the bucket's figure for the running K far below what the next full batch pays.
            self.k_policy.observe(bucket, k, end - t_cost, between, switched)
        return StepOutput(tokens, num_draft, k, logprobs)
