"""The model runner: device batches, compiled graphs and their keys, prefill and one decode step.

One step (speculative, padded — docs/design.md's data flow):
1. target forward of ``B`` requests × ``(1+K)`` tokens
2. rejection sampler → ``sampled [B, K+1]`` with -1 placeholders
3. ``prepare_next_token_ids_padded`` → next token and valid count per request
4. ``prepare_inputs_padded`` → last accepted index per request (no compaction)
5-6. the proposer drafts K tokens for the next step
The fused path runs 1-6 as one graph over device-side batch state (:mod:`.fused_step`); the step-by-step path
(``fused_step=False``) runs the target graph, sampling and the draft graph as separate calls. vLLM's unpadded
drafter layout (``disable_padded_drafter_batch``) is a variant of step 4 on either path: each row's rejected
tokens made inert on device (``spec_decode.compact_rejected``) at the same width, so the same graph shapes replay.
Either way 1-6 run without host syncs; afterwards one transfer brings the step's tokens to the host. The runner
returns tokens; appending them and finishing requests is the scheduler's business. Which graphs are compiled
before the first step, and which wait for their first use, is :mod:`.warmup`'s.

Graph keys: (K, sampling mode, logprobs) — the batch bucket too only where the backend compiles per shape.
The block table is data; on CPU it is trimmed to the live blocks of the batch's longest request, so a step
costs what the live context costs, whatever ``max_model_len`` is.
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from . import spec_decode
from .config import EngineConfig
from .fused_step import GREEDY, MAX_LOGPROBS, RANDOM, SpecStepGraphs, StepKey, top_logprobs
from .graph.backends import Backend, get_backend
from .graph.backends.aot_graphs import GraphStore, aot_available, device_capability, module_refs
from .graph.backends.compile_cache import CacheKey, CompileCache, open_default_cache
from .graph.buckets import BatchArg, BucketedGraph
from .graph.model import DeepseekV3ForCausalLM
from .graph.steps import make_prefill_step, make_target_step
from .inputs import block_row, drafts_fit, pack_chunks, slots_of, step_tokens, table_width
from .k_policy import KPolicy
from .kv_cache import KVCaches
from .metrics import RunStats
from .proposer import DraftInputs
from .sampling import SamplingParams, SamplingTensors, sample
from .scheduler import Sequence
from .sync_counter import HostSyncCounter, suspended_if_compiled
from .torchair_proposer import MtpTorchairProposer
from .warmup import GraphWarmup

logger = logging.getLogger(__name__)


#: padded tokens one eager prefill forward takes (requests admitted together share forwards up to this)
PREFILL_TOKENS = 4096
#: K = 0 steps a request keeps the target's hidden states of, to write their MTP cache entries when it drafts again
#: (explorations bring every K back every ``EXPLORE_EVERY`` steps of a bucket); older positions stay unwritten
MAX_CATCH_UP = 512
TARGET_BATCH_ARGS = (BatchArg("input_ids", 0), BatchArg("positions", 0), BatchArg("slot_mapping", -1),
                     BatchArg("block_table", 0, width=True), BatchArg("seq_lens", 0))
PREFILL_BATCH_ARGS = (BatchArg("input_ids", 0, query=True), BatchArg("positions", 0, query=True),
                      BatchArg("slot_mapping", -1, query=True), BatchArg("block_table", 0, width=True),
                      BatchArg("seq_lens", 0), BatchArg("last_idx", 0))


@dataclass
class DeviceBatch:
    """The running batch's next step inputs, on device, padded to its graph rows (pad rows: ``live`` False).

    The fused graph advances ``input_ids`` and ``start`` itself; the host rebuilds the batch only when its
    composition, K, sampling mode or logprobs change.
    """

    req_ids: tuple[int, ...]
    k: int
    mode: str
    input_ids: torch.Tensor  # [Bp, 1+k]: last token, then the drafts
    start: torch.Tensor  # [Bp]: position of input_ids[:, 0]
    num_draft: torch.Tensor  # [Bp]
    num_draft_host: list[int]  # the same, for the real rows (metrics)
    block_table: torch.Tensor  # [Bp, M]: full width; each step passes the live columns
    live: torch.Tensor  # [Bp] bool
    sampling: SamplingTensors  # fields [Bp]
    logprobs: bool = False
    #: blocks each real row's request held when ``block_table`` was built (a grown one rebuilds the table)
    blocks_held: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class StepOutput:
    """One decode step's result for the running requests, in order."""

    tokens: list[list[int]]  # accepted tokens of each row (1 .. 1+K)
    num_draft: list[int]  # drafts verified in each row
    k: int
    #: per row, one {token_id: logprob} per token in ``tokens`` (rows that asked for logprobs), else None
    logprobs: list[list[dict[int, float]] | None] | None = None
    #: step-by-step path: each row's next drafts (the fused path keeps them on device)
    drafts: list[list[int]] | None = None


@dataclass(frozen=True)
class StepPlan:
    """What the next step runs: K (asked of the K policy once per step, before the scheduler makes cache room
    for it) for the batch bucket it was asked for; ``fused``: the one-graph step applies."""

    k: int
    bucket: int
    fused: bool


def logprob_entries(top_ids: list, top_lp: list, tok_lp: float, token: int, n: int) -> dict[int, float]:
    entry = dict(zip(top_ids[:n], top_lp[:n]))
    entry[token] = tok_lp
    return entry


def row_logprobs(running: list[Sequence], tokens: list[list[int]], lp_h: list[list]) -> list:
    """Per row, one entry per accepted token for the requests that asked (None for the others); ``lp_h``: the
    host copies of ``top_logprobs``' (ids, logprobs, sampled token's logprob)."""
    ids, lps, tok = lp_h
    return [[logprob_entries(ids[i][j], lps[i][j], tok[i][j], t, s.params.logprobs) for j, t in enumerate(tokens[i])]
            if s.params.logprobs is not None else None for i, s in enumerate(running)]


class ModelRunner:
    def __init__(self, model: DeepseekV3ForCausalLM, cfg: EngineConfig, device: torch.device, caches: KVCaches,
                 k_policy: KPolicy, count_host_syncs: bool = False) -> None:
        self.model = model
        self.cfg = cfg
        self.device = device
        self.caches = caches
        #: this step's K: asked once a step, fed each fused step's cost
        self.k_policy = k_policy
        self.count_host_syncs = count_host_syncs
        self.spec = cfg.speculative
        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        g = cfg.graph
        self.backend: Backend = get_backend(
            g.effective_backend, device, mode=g.mode, frozen_parameter=g.enable_frozen_parameter,
            view_optimize=g.enable_view_optimize, tiling_schedule_optimize=g.tiling_schedule_optimize,
            use_cached_graph=g.use_cached_graph, input_guards_only=True, graph_failure=cfg.graph_failure)
        self.shapes = self.backend.shapes
        # Compiled graphs kept across runs (torchair keeps its own: use_cached_graph / cache_compile).
        self.compile_cache: CompileCache | None = open_default_cache() if self.backend.name == "inductor" else None
        # Graphs saved whole where the backend can load them without tracing (CPU inductor)
        self.graph_store: GraphStore | None = None
        if self.compile_cache is not None and device.type == "cpu" and aot_available():
            self.graph_store = GraphStore(self.compile_cache, self.cache_key("graphs"), external=module_refs(model))
            self.backend.store = self.graph_store
        model.use_backend(self.backend)
        model.set_compile_regions(getattr(self.backend, "compile_regions", False))
        #: nominal batch buckets: graph sizes on per-shape backends, the units adaptive K is chosen for everywhere
        self.batch_sizes = g.batch_sizes(cfg.max_num_seqs)
        self._target_eager = make_target_step(model)
        self.target_graph = BucketedGraph(self.backend, self._target_eager, "target", self.batch_sizes,
                                          TARGET_BATCH_ARGS, host_lengths=model.takes_host_lengths)
        # Prompts replay a graph too (a query axis: dynamic on CPU, padded to a few widths where graphs replay one
        # shape): a lone 20-token prompt of the bundled model took 23 ms eagerly, 15 ms as a graph (2-core CPU),
        # about two decode steps of a batch of 8, and speculating requests finish apart and join one by one.
        self._prefill_eager = make_prefill_step(model)
        self.prefill_graph: BucketedGraph | None = None
        if g.prefill_query_widths:
            self.prefill_graph = BucketedGraph(self.backend, self._prefill_eager, "prefill", self.batch_sizes,
                                               PREFILL_BATCH_ARGS, query_widths=g.prefill_query_widths,
                                               host_lengths=model.takes_host_lengths)
        self.proposer: MtpTorchairProposer | None = None
        if self.spec:
            self.proposer = MtpTorchairProposer(model, self.spec, cfg.max_model_len, caches.draft,
                                                backend=self.backend, batch_sizes=self.batch_sizes,
                                                prefill_widths=cfg.graph.prefill_query_widths)
        self.spec_graphs = SpecStepGraphs(model, self.backend, cfg.max_model_len,
                                          keep_hidden=self.proposer is not None,
                                          unpadded=bool(self.spec and self.spec.disable_padded_drafter_batch))
        #: called after each fused replay with its key and arguments (benchmarks time the phases on them)
        self.step_observer: Callable[[StepKey, tuple], None] | None = None
        self._batch: DeviceBatch | None = None
        #: when the last fused step ended (None: none yet in this run, or a step-by-step one came between)
        self._last_step_end: float | None = None
        #: which graphs are warm, and the warm-ups that compile (or load) more of them
        self.warm = GraphWarmup(self)
        self._pending_drafts: dict[int, list[int]] = {}
        #: per request, its K = 0 steps since it last drafted: (the step's hidden states [rows, D], its row)
        self._undrafted: dict[int, deque[tuple[torch.Tensor, int]]] = {}
        self._unused_noise: dict[tuple[int, int], spec_decode.RejectionNoise] = {}

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
        return table_width(min(longest_tokens, self.cfg.max_model_len), self.max_blocks, self.caches.block_size,
                           self.shapes.trim_context)

    def bucket_for(self, batch: int) -> int | None:
        """The nominal bucket of ``batch`` requests (adaptive K, statistics); None above the largest."""
        i = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def rows_for(self, batch: int) -> int | None:
        """Graph rows for ``batch`` requests, at any K. A lone request runs unpadded, a graph of its own on
        dynamic-batch backends (a size-1 dimension specialises a compile; warmed with the others where 1 is a
        bucket): padded to two rows, its verify and drafts paid for twice the tokens (bundled model, context 160:
        K = 1, 2, 3 steps 4.75, 6.23, 6.91 ms padded against 4.20, 5.01, 5.47 alone, K = 0 3.33 ms); its one-
        and two-row products are row reductions, see ``graph.layers.Linear``. Every other batch pads to
        ``min_batch``, and so does a lone request where warm-up left its graphs out (``warm_graphs: first`` and a
        first batch of several: a draining queue's last request)."""
        if batch == 1 and self.shapes.dynamic_batch and 1 in self.batch_sizes and self.warm.lone:
            return 1
        return self.target_graph.bucket_for(batch)

    def fused_applies(self, running: list[Sequence]) -> bool:
        return (self.cfg.fused_step and self.target_graph.bucket_for(len(running)) is not None
                and all((s.params.logprobs or 0) <= MAX_LOGPROBS for s in running))

    # -- warm-up (which graphs, when: .warmup) -------------------------------------------------------
    def drop_batch(self) -> None:
        """The next fused step builds its device batch anew (warm-up replayed inert batches through its graphs)."""
        self._batch = None

    def cache_key(self, what: str) -> CacheKey:
        """One warm-up's compiled artifacts: the model, the graph code, torch and every option that shapes them."""
        cfg = self.cfg
        return CacheKey(what=what, model_config=self.model.cfg.to_hf_dict(), backend=self.backend.name,
                        backend_options={"device": str(self.device), "capability": device_capability(self.device),
                                         "dtype": str(self.model.lm_head.weight.dtype),
                                         "shapes": dataclasses.asdict(self.shapes),
                                         "attention": self.backend.attention_kernel,
                                         "compile_regions": getattr(self.backend, "compile_regions", False),
                                         "max_model_len": cfg.max_model_len,
                                         "block_size": cfg.block_size, "kv_layout": cfg.kv_layout,
                                         # one dynamic-batch graph serves any bucket list
                                         "batch_sizes": None if self.shapes.dynamic_batch else self.batch_sizes,
                                         "disable_padded_drafter_batch": bool(
                                             self.spec and self.spec.disable_padded_drafter_batch)})

    def inert_batch(self, rows: int, k: int) -> DeviceBatch:
        dev = self.device
        # Distinct tensors: Dynamo guards on aliasing, and a run never passes one tensor twice.
        return DeviceBatch((), k, GREEDY, torch.zeros(rows, 1 + k, dtype=torch.long, device=dev),
                           torch.zeros(rows, dtype=torch.long, device=dev),
                           torch.zeros(rows, dtype=torch.long, device=dev), [],
                           torch.zeros(rows, self.max_blocks, dtype=torch.long, device=dev),
                           torch.zeros(rows, dtype=torch.bool, device=dev),
                           SamplingTensors.greedy_batch(rows, dev))

    # -- prefill (a graph up to the widest prefill width; the requests admitted together share one forward) ----
    def prefill(self, seqs: list[Sequence], generator: torch.Generator | None
                ) -> list[tuple[int, dict[int, float] | None, list[int]]]:
        """Prefill each prompt, or for a preempted request its prompt and generated tokens (recompute); returns per
        request the token sampled at its last position, its logprob entry (if asked) and the drafts for the next
        step. Requests go together, right-padded, up to ``PREFILL_TOKENS`` padded tokens and the largest bucket a
        forward: one pass instead of one per request (at batch 16, a fifth of the run's time went to one-by-one
        prefills)."""
        self._forget(seqs)
        out: list[tuple[int, dict[int, float] | None, list[int]]] = []
        group: list[Sequence] = []
        for seq in seqs:
            longest = max([seq.num_tokens, *(s.num_tokens for s in group)])
            if group and (longest * (len(group) + 1) > PREFILL_TOKENS or len(group) == self.batch_sizes[-1]):
                out += self._prefill_group(group, generator)
                group = []
            group.append(seq)
        return out + self._prefill_group(group, generator)

    def _forget(self, seqs: list[Sequence]) -> None:
        """``seqs`` are prefilled anew: what the runner kept of a preempted one (drafts, hidden states) is void. (The
        device batch has left it: a step ran without it since, as the pool always holds the oldest request.)"""
        for seq in seqs:
            self._pending_drafts.pop(seq.req_id, None)
            self._undrafted.pop(seq.req_id, None)

    def _prefill_group(self, seqs: list[Sequence], generator: torch.Generator | None
                       ) -> list[tuple[int, dict[int, float] | None, list[int]]]:
        dev = self.device
        tokens = [s.prompt_ids + s.output_ids for s in seqs]
        n = max(len(t) for t in tokens)
        ids, pos, slots, table, seq_lens, last = self._chunk(seqs, tokens, [0] * len(seqs))
        lens_host = self._host_lengths([n] * len(seqs))  # each block's end: padded to the longest (see _chunk)
        graph = self.prefill_graph
        with torch.no_grad():
            args = [ids, pos, slots, table, seq_lens, last]
            # ``warm_graphs: first`` runs prompts eagerly unless warm-up compiled their graph (never in a step)
            warm = self.warm.prompts_warm or self.cfg.warm_graphs == "all"
            served = graph is not None and warm and graph.serves(len(seqs), n)
            hidden, last_logits = (graph(args, (self.caches.target,), host_lengths=lens_host) if served
                                   else self._prefill_eager(*args, self.caches.target, lens_host))
            hidden = hidden[:, :n]  # [B, n, D]: a graph's query may be padded wider
            token = sample(last_logits, SamplingTensors.from_params([s.params for s in seqs], dev), generator)
        firsts = token.tolist()
        entries: list[dict[int, float] | None] = [None] * len(seqs)
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if wanted:
            top_ids, top_lp, tok_lp = (t.tolist() for t in top_logprobs(last_logits.unsqueeze(1), token.view(-1, 1),
                                                                          max(wanted)))
            entries = [logprob_entries(top_ids[i][0], top_lp[i][0], tok_lp[i][0], firsts[i], s.params.logprobs)
                       if s.params.logprobs is not None else None for i, s in enumerate(seqs)]
        if self.proposer is None:
            return [(t, e, []) for t, e in zip(firsts, entries)]
        drafts = self._draft_chunk(DraftInputs(ids, pos, hidden, slots, token, last, table, seq_lens, lens_host))
        return [(t, e, d) for t, e, d in zip(firsts, entries, drafts.tolist())]

    def _chunk(self, seqs: list[Sequence], tokens: list[list[int]], firsts: list[int]
               ) -> tuple[torch.Tensor, ...]:
        """``inputs.pack_chunks`` with the table as wide as the chunks' drafts reach (a row's padded query block
        ends at first + n, the drafts chain on from its last position)."""
        n = max(len(t) for t in tokens)
        width = self.width_for(max(step_tokens(f + n, self.k_max) for f in firsts))
        return pack_chunks(seqs, tokens, firsts, width, self.cfg.max_model_len, self.caches.block_size, self.device)

    def _draft_chunk(self, inputs: DraftInputs) -> torch.Tensor:
        """Drafts ``[B, K]`` for chunks of positions (a prompt, a K = 0 stretch), writing their MTP cache entries:
        the draft chain's graph where it was warmed for chunks (with the prompt graph), else the eager reference."""
        b, n = inputs.target_token_ids.shape
        assert self.proposer is not None
        if self.warm.prompts_warm and self.proposer.graph_serves(b, n):
            return self.proposer.propose(inputs)
        return self.proposer.propose_reference(inputs)

    # -- decode -------------------------------------------------------------------------------------
    def plan(self, running: list[Sequence]) -> StepPlan:
        """The next step's K and bucket; the step-by-step path always drafts K_max."""
        bucket = self.bucket_for(len(running)) or self.batch_sizes[-1]
        if not self.fused_applies(running):
            return StepPlan(self.k_max, bucket, fused=False)
        to_go = max(s.max_tokens - len(s.output_ids) for s in running)
        deferred = len(self.warm.deferred)
        k = self.k_policy.k_for(bucket, to_go, self.warm)
        if len(self.warm.deferred) != deferred:
            self._last_step_end = None  # a deferred K compiled: no step's cost, and it ran between no steps
        return StepPlan(k, bucket, fused=True)

    def step(self, running: list[Sequence], generator: torch.Generator | None, stats: RunStats,
             plan: StepPlan | None = None) -> StepOutput:
        """One decode step over ``running`` as ``plan`` (from :meth:`plan` before the scheduler made room for
        it; planned now when None). Preemption while making room may have shrunk the batch since, which keeps
        the fused path applicable (a smaller batch fits a bucket, and its rows' logprobs were already allowed)."""
        plan = plan or self.plan(running)
        if plan.fused:
            return self._step_fused(running, generator, stats, plan)
        self._drafts_to_host()
        self._last_step_end = None
        return self._step_by_step(running, generator, stats)

    def end_run(self) -> dict[int, int]:
        """The K each bucket runs at now (fixed K: K_max)."""
        self._batch = None
        self._last_step_end = None
        self._undrafted.clear()
        return self.k_policy.chosen(self.batch_sizes)

    def graph_failures(self) -> int:
        """Compiled graphs of this runner that failed so far (``graph_failure: eager``: each step reran eagerly)."""
        graphs = [self.target_graph, self.prefill_graph, self.proposer.graph if self.proposer is not None else None]
        return sum(self.spec_graphs.failures.values()) + sum(g.num_failures for g in graphs if g is not None)

    def _counted(self) -> HostSyncCounter | None:
        return HostSyncCounter() if self.count_host_syncs else None

    @contextmanager
    def _transfers(self, stats: RunStats) -> Iterator[None]:
        """Count the step's device -> host transfers (its results, read after its graphs) in ``stats``."""
        if not self.count_host_syncs:
            yield
            return
        with HostSyncCounter() as counter:
            yield
        stats.host_transfers += counter.count
        stats.host_transfer_events.extend(counter.events)

    @staticmethod
    def _count_end(counter: HostSyncCounter | None, stats: RunStats) -> None:
        if counter is not None:
            counter.__exit__(None, None, None)
            stats.host_syncs += counter.count
            stats.host_sync_events.extend(counter.events)

    # -- fused path: one graph per step over device-side state ------------------------------------
    def _block_table(self, running: list[Sequence], rows: int) -> torch.Tensor:
        m = self.max_blocks
        table = [block_row(s, m) for s in running] + [[0] * m] * (rows - len(running))
        return torch.tensor(table, dtype=torch.long, device=self.device)

    def _build_batch(self, running: list[Sequence], k: int, mode: str, logprobs: bool) -> DeviceBatch:
        """Device state for ``running``: drafts of rows already in the previous batch are gathered on device
        (they never went to the host); requests just prefilled bring theirs from the host."""
        dev = self.device
        b = len(running)
        rows = self.rows_for(b)
        old = self._batch
        old_rows = {rid: i for i, rid in enumerate(old.req_ids)} if old is not None else {}
        drafts = torch.zeros(rows, k, dtype=torch.long, device=dev)
        counts = []
        from_old = [(i, old_rows[s.req_id]) for i, s in enumerate(running) if s.req_id in old_rows]
        if from_old and k:
            dst, src = (torch.tensor(x, dtype=torch.long, device=dev) for x in zip(*from_old))
            width = min(k, old.k)
            drafts[dst, :width] = old.input_ids.index_select(0, src)[:, 1: 1 + width]
        for i, s in enumerate(running):
            j = old_rows.get(s.req_id)
            if j is not None:
                counts.append(min(old.num_draft_host[j], k))
            else:
                own = s.draft_ids[:k]
                if own:
                    drafts[i, : len(own)] = torch.tensor(own, dtype=torch.long, device=dev)
                counts.append(len(own))
        pad = rows - b
        last = torch.tensor([s.last_token for s in running] + [0] * pad, dtype=torch.long, device=dev)
        return DeviceBatch(
            req_ids=tuple(s.req_id for s in running), k=k, mode=mode,
            input_ids=torch.cat([last.view(-1, 1), drafts], dim=1),
            start=torch.tensor([s.num_tokens - 1 for s in running] + [0] * pad, dtype=torch.long, device=dev),
            num_draft=torch.tensor(counts + [0] * pad, dtype=torch.long, device=dev), num_draft_host=counts,
            block_table=self._block_table(running, rows),
            live=torch.tensor([True] * b + [False] * pad, device=dev),
            sampling=SamplingTensors.from_params([s.params for s in running] + [SamplingParams()] * pad, dev),
            logprobs=logprobs, blocks_held=tuple(len(s.blocks) for s in running))

    def _note_undrafted(self, running: list[Sequence], hidden: torch.Tensor) -> None:
        """A K = 0 step ran no MTP layer: keep each row's hidden state (a reference to the step's output, no copy)
        so that the MTP cache entries of this position can be written when the request drafts again."""
        live = {s.req_id for s in running}
        for rid in [r for r in self._undrafted if r not in live]:
            del self._undrafted[rid]  # finished
        for i, s in enumerate(running):
            kept = self._undrafted.get(s.req_id)
            if kept is None:
                kept = self._undrafted[s.req_id] = deque(maxlen=MAX_CATCH_UP)
            kept.append((hidden, i))

    def _catch_up(self, batch: DeviceBatch, running: list[Sequence]) -> None:
        """Requests back from K = 0 steps: write the MTP cache entries of those positions from the hidden states
        kept (the draft chain over them as over a prompt chunk: each entry depends only on its position's hidden
        state and next token), so that the drafts attend to a whole context, and take the chunk's drafts as this
        step's. Without it those entries stay unwritten and every later draft of the request attends over the gap
        (the acceptance adaptive K learns from its explorations out of K = 0 fell with it)."""
        rows = [(i, s, self._undrafted.pop(s.req_id)) for i, s in enumerate(running) if s.req_id in self._undrafted]
        if not rows:
            return
        seqs = [s for _, s, _ in rows]
        # the kept steps verified positions num_tokens - 1 - len(kept) .. num_tokens - 2, one token each
        firsts = [s.num_tokens - 1 - len(kept) for _, s, kept in rows]
        tokens = [(s.prompt_ids + s.output_ids)[f: s.num_tokens - 1] for (_, s, _), f in zip(rows, firsts)]
        ids, pos, slots, table, seq_lens, last = self._chunk(seqs, tokens, firsts)
        n = ids.shape[1]
        first = rows[0][2][0][0]
        hidden = first.new_zeros(len(rows), n, first.shape[-1])
        for r, (_, _, kept) in enumerate(rows):
            hidden[r, : len(kept)] = torch.stack([h[i] for h, i in kept])
        token = torch.tensor([s.last_token for s in seqs], dtype=torch.long, device=self.device)
        lens_host = self._host_lengths(f + n for f in firsts)  # each block's padded end (see _chunk)
        drafts = self._draft_chunk(DraftInputs(ids, pos, hidden, slots, token, last, table, seq_lens, lens_host))
        idx = torch.tensor([i for i, _, _ in rows], dtype=torch.long, device=self.device)
        batch.input_ids[idx, 1:] = drafts[:, : batch.k].to(batch.input_ids.dtype)
        batch.num_draft[idx] = batch.k
        for i, _, _ in rows:
            batch.num_draft_host[i] = batch.k

    def _drafts_to_host(self) -> None:
        """Leaving the fused path (a batch above the buckets, more logprobs than a graph returns): the step-by-step
        path reads drafts from the host."""
        if self._batch is None:
            return
        batch, self._batch = self._batch, None
        self._pending_drafts = {rid: row[1: 1 + batch.k] for rid, row in
                                zip(batch.req_ids, batch.input_ids[: len(batch.req_ids)].tolist())}

    def replay(self, batch: DeviceBatch, width: int, noise: spec_decode.RejectionNoise | None
                ) -> tuple[torch.Tensor, ...]:
        key, args = self._replay_args(batch, width, noise, [])
        with suspended_if_compiled(self.backend):
            return self.spec_graphs(key, *args)

    def _replay_args(self, batch: DeviceBatch, width: int, noise: spec_decode.RejectionNoise | None,
                     running: list[Sequence]) -> tuple[StepKey, tuple]:
        """The fused step's arguments for ``batch``, whose live rows are ``running`` (none: an inert batch)."""
        st = batch.sampling
        if noise is None:  # greedy: the graph takes noise inputs it does not read; one placeholder per shape
            noise = self._unused_noise.get((batch.rows, batch.k))
            if noise is None:
                noise = self._unused_noise[(batch.rows, batch.k)] = spec_decode.RejectionNoise(
                    torch.zeros(batch.rows, batch.k, device=self.device),
                    torch.ones(batch.rows, self.model.cfg.vocab_size, device=self.device))
        key = self.spec_graphs.key(batch.rows, batch.k, batch.mode, batch.logprobs)
        # where each verify block ends, past max_model_len too (its tokens there are inert): see PagedInputs
        lens_host = self._host_lengths(running[i].num_tokens + batch.k if i < len(running) else 0
                                       for i in range(batch.rows))
        # contiguous: a narrower view of the table would make the graph guard on its strides
        return key, (batch.input_ids, batch.start, batch.num_draft, batch.block_table[:, :width].contiguous(),
                     batch.live, st.temperature, st.top_k, st.top_p, st.greedy, noise.uniform, noise.exponential,
                     self.caches.target, self.caches.draft) + ((lens_host,) if lens_host is not None else ())

    def _host_lengths(self, lengths: Iterable[int]) -> tuple[int, ...] | None:
        """KV lengths as host ints for attention that reads them (``model.takes_host_lengths``), else None."""
        return tuple(lengths) if self.model.takes_host_lengths else None

    def _step_fused(self, running: list[Sequence], generator: torch.Generator | None, stats: RunStats,
                    plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        b = len(running)
        fitted = self.bucket_for(b)
        # a preemption since the plan may have moved the batch to another bucket: its K was not asked for this one
        planned = fitted == plan.bucket
        full = planned and fitted == b  # the live rows fill their bucket
        bucket, k = plan.bucket, plan.k
        mode = GREEDY if all(s.params.is_greedy for s in running) else RANDOM
        want_lp = any(s.params.logprobs is not None for s in running)
        ids = tuple(s.req_id for s in running)
        batch = self._batch
        t_cost = t0  # where the step's cost starts, for adaptive K
        # what ran since the previous step (prefills, the engine's loop), for adaptive K: see AdaptiveK.between
        between = None if self._last_step_end is None else t0 - self._last_step_end
        switched = batch is not None and batch.k != k
        if (batch is None or batch.req_ids != ids or batch.k != k or batch.mode != mode
                or batch.logprobs != want_lp):
            batch = self._batch = self._build_batch(running, k, mode, want_lp)
            stats.batch_rebuilds += 1
            if k and self._undrafted:
                self._catch_up(batch, running)
            if switched:
                stats.k_switches += 1
                between = None  # what ran before a switch belongs to the K that ran then
                # A change of K pays a rebuild (and, out of K = 0, the MTP catch-up): a cost of switching, which
                # SWITCH_MARGIN weighs, not of running at K. Counted in, an exploration's first step (K = 3 at
                # batch 1 after 64 K = 0 steps) priced K = 3 at 2.5x a plain step where it costs 1.9x.
                t_cost = time.perf_counter()
                switch = t_cost - t0
                stats.switch_seconds += switch
                if planned:
                    self.k_policy.observe_switch(bucket, switch)
        held = tuple(len(s.blocks) for s in running)
        if held != batch.blocks_held:  # a request gained a block: out of place, a replay may still read the old table
            batch.block_table, batch.blocks_held = self._block_table(running, batch.rows), held
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
        counter = self._counted()
        t1 = time.perf_counter()
        with torch.no_grad():
            if counter is not None:
                counter.__enter__()
            try:
                with suspended_if_compiled(self.backend):
                    sampled, valid, next_input, next_start, *lp = self.spec_graphs(key, *args)
                    hidden = lp.pop() if k == 0 and self.spec_graphs.keep_hidden else None
            finally:
                self._count_end(counter, stats)
        t2 = time.perf_counter()
        stats.graph_seconds += t2 - t1
        if self.step_observer is not None:
            self.step_observer(key, args)
            t2 = time.perf_counter()  # the observer's time is nobody's: not the host's either
        if self.backend.reuses_outputs:
            next_input, next_start = next_input.clone(), next_start.clone()
            hidden = hidden.clone() if hidden is not None else None
        if hidden is not None:
            self._note_undrafted(running, hidden)
        # The one host transfer of the step: the tokens, for bookkeeping (counted: it must stay one).
        with self._transfers(stats):
            out_h = torch.cat([sampled[:b].long(), valid[:b].long().view(-1, 1)], dim=1).tolist()
            lp_h = [t[:b].tolist() for t in lp] if lp else None
        num_draft = [drafts_fit(s.num_tokens, n, max_len) for n, s in zip(batch.num_draft_host, running)]
        batch.input_ids, batch.start = next_input, next_start
        if batch.num_draft_host != [k] * b:
            batch.num_draft = torch.full_like(batch.num_draft, k)
            batch.num_draft_host = [k] * b
        tokens = [row[: row[-1]] for row in out_h]
        logprobs = row_logprobs(running, tokens, lp_h) if lp_h is not None else None
        stats.steps_per_k[k] = stats.steps_per_k.get(k, 0) + 1
        end = self._last_step_end = time.perf_counter()
        stats.host_seconds += (t1 - t0) + (end - t2)
        if full or planned and not self.shapes.dynamic_batch:
            # What this K costs: the step itself, graph and host (a rebuild for new requests included, not one for
            # a new K), and apart from it what ran since the step before. Dynamic-batch backends count only a full
            # bucket's steps: they run the live rows, and a draining queue's steps (rows falling to 1) would drag
            # the bucket's figure for the running K far below what the next full batch pays.
            self.k_policy.observe(bucket, k, end - t_cost, between, switched)
        return StepOutput(tokens, num_draft, k, logprobs)

    # -- step-by-step path: target graph, eager sampling, draft graph ------------------------------
    def _step_by_step(self, running: list[Sequence], generator: torch.Generator | None,
                      stats: RunStats) -> StepOutput:
        for seq in running:
            if seq.req_id in self._pending_drafts:
                seq.draft_ids = self._pending_drafts.pop(seq.req_id)
        dev = self.device
        q = 1 + self.k_max
        max_len = self.cfg.max_model_len
        width = self.width_for(max(step_tokens(s.num_tokens, self.k_max) for s in running))
        rows_ids, rows_pos, rows_slots, num_draft = [], [], [], []
        for seq in running:
            p = seq.num_tokens - 1  # tokens already in the cache
            nd = drafts_fit(seq.num_tokens, self.k_max, max_len)
            positions = [p + j for j in range(q)]
            rows_ids.append([seq.last_token] + seq.draft_ids[: self.k_max])
            rows_pos.append([x if x < max_len else 0 for x in positions])
            rows_slots.append(slots_of(seq, positions, max_len, self.caches.block_size))
            num_draft.append(nd)
        b = len(running)
        input_ids = torch.tensor(rows_ids, dtype=torch.long, device=dev)
        positions = torch.tensor(rows_pos, dtype=torch.long, device=dev)
        slots = torch.tensor(rows_slots, dtype=torch.long, device=dev)
        table = torch.tensor([block_row(s, width) for s in running], dtype=torch.long, device=dev)
        seq_lens = torch.tensor([min(s.num_tokens - 1 + q, max_len) for s in running], dtype=torch.long,
                                device=dev)
        lens_host = self._host_lengths(s.num_tokens - 1 + q for s in running)  # see _replay_args
        st = SamplingTensors.from_params([s.params for s in running], dev)
        num_draft_t = torch.tensor(num_draft, dtype=torch.long, device=dev)

        counter = self._counted()
        with torch.no_grad():
            if counter is not None:
                counter.__enter__()
            try:
                with suspended_if_compiled(self.backend):
                    hidden, logits = self.target_graph([input_ids, positions, slots, table, seq_lens],
                                                       (self.caches.target,), host_lengths=lens_host)
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
                                         num_draft_t, lens_host)
            finally:
                self._count_end(counter, stats)
        n_logprobs = max((s.params.logprobs or 0 for s in running), default=0)
        want_logprobs = any(s.params.logprobs is not None for s in running)
        lp = top_logprobs(logits[:, : sampled.shape[1]], sampled, n_logprobs) if want_logprobs else None
        # The step's transfers: tokens, valid counts and the next drafts for bookkeeping (and logprobs).
        with self._transfers(stats):
            lp_h = [t.tolist() for t in lp] if lp is not None else None
            sampled_h, valid_h = sampled.tolist(), valid.tolist()
            drafts_h = drafts.tolist() if drafts is not None else None
        tokens = [sampled_h[i][: valid_h[i]] for i in range(b)]
        logprobs = row_logprobs(running, tokens, lp_h) if lp_h is not None else None
        return StepOutput(tokens, num_draft, self.k_max, logprobs, drafts_h)

    def _draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor,
               table: torch.Tensor, seq_lens: torch.Tensor, next_ids: torch.Tensor, valid: torch.Tensor,
               num_draft: torch.Tensor, lens_host: tuple[int, ...] | None) -> torch.Tensor:
        assert self.proposer is not None and self.spec is not None
        b, q = input_ids.shape
        qsl = torch.arange(b + 1, device=input_ids.device) * q
        token_indices, _ = self.proposer.prepare_inputs_padded(qsl, num_draft, valid)
        sample_idx = token_indices - qsl[:-1]
        if self.spec.disable_padded_drafter_batch:  # rejected tokens dropped, on device at the same width
            input_ids, positions, hidden, slots, seq_lens = spec_decode.compact_rejected(
                input_ids, positions, hidden, slots, seq_lens, sample_idx)
        # unpadded: the verify's lengths still bound the compacted rows' (see graph.mla_kernels.npu_mla)
        return self.proposer.propose(DraftInputs(input_ids, positions, hidden, slots, next_ids, sample_idx, table,
                                                 seq_lens, lens_host))
