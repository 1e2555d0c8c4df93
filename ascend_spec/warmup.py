"""Warm-up: which compiled graphs a run needs before its first step, which it defers, and their step costs.

The runner replays graphs; this module decides which to compile (or load) and when. ``warm_graphs: all`` compiles
every graph up front; ``first`` (the default) compiles what the first steps run: the fused step at K_max for the
batch shapes a run starts with, the prompt graphs only for runs of many prompts, and the other K values of adaptive
K when the policy first picks one (:meth:`GraphWarmup.compile_deferred`). Adaptive K's step costs per bucket and K
are measured here, on inert batches, since shapes, not data, set a step's cost.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from .adaptive import WARMUP_COST_CONTEXT, interpolated_costs
from .fused_step import GREEDY, time_call
from .graph.buckets import warm_widths

if TYPE_CHECKING:
    from .runner import ModelRunner

#: ``warm_graphs: first`` compiles the prompt graph and the prompts' draft chain only for a run of this many
#: prompts: they save about 8 ms a prompt (bundled model, a lone 20-token prompt: 23 ms eagerly, 15 ms as a graph),
#: and cost 0.6 s to load and about a minute to compile cold (2-core CPU)
PROMPT_GRAPHS_FROM = 64


def dynamo_compile_count() -> int:
    """Graphs Dynamo has compiled in this process (each recompile of a frame counts once)."""
    if "torch._dynamo" not in sys.modules:  # none, and importing Dynamo to say so would cost a second
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


@dataclass
class WarmupReport:
    graphs_compiled: int = 0
    compile_seconds: float = 0.0
    seconds_by_graph: dict[str, float] = field(default_factory=dict)
    #: the on-disk compile cache held this warm-up's artifacts (None: no cache in use)
    cache_hit: bool | None = None


class GraphWarmup:
    """What is warm of one runner's graphs, and the warm-ups that make more of them so."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cfg = runner.cfg
        self.k_max = runner.k_max
        self.shapes = runner.shapes
        self.device = runner.device
        self.max_blocks = runner.max_blocks
        self.adaptive = runner.k_policy.costs
        first = self.cfg.warm_graphs == "first" and runner.backend.name != "eager"
        defers = first and self.cfg.adaptive_k and self.cfg.fused_step
        #: fused-step K values whose graphs warm-up leaves for their first use (``warm_graphs: first``)
        self.deferred: set[int] = set(range(self.k_max)) if defers else set()
        #: lone-request (one-row) graphs and batch graphs warm, or compiled on first use (``warm_graphs: all``)
        self.lone = self.batched = not first
        #: the prompt graph and the prompts' draft chain are warm
        self.prompts_warm = False
        #: (sampling mode, logprobs) pairs the fused path was warmed for, and the (rows, K, mode, logprobs) graphs
        self.modes: list[tuple[str, bool]] = []
        self.graphs: set[tuple[int, int, str, bool]] = set()
        self.progress = False
        #: Dynamo graphs the deferred compiles made (planned, not recompiles), and their seconds
        self.deferred_compiles = 0
        self.deferred_seconds = 0.0

    def run(self, progress: bool = True, modes: tuple[str, ...] = (GREEDY,), logprobs: bool = False,
            lone: bool = False, batched: bool = True, prompts: int | None = None) -> WarmupReport:
        """Compile the graphs a run with sampling ``modes`` (and ``logprobs``) replays: the fused step per K
        (``adaptive_k``: every K in 0..K_max, then timed; ``warm_graphs: first``: K_max only, see ``_warm_ks``) —
        per batch bucket only where the backend compiles per shape, for a lone request where ``lone`` says the
        first batch is one, for batches unless ``batched`` says none comes (both always with ``warm_graphs: all``)
        — or the target step and draft chain; the prompt graphs once, with ``warm_graphs: first`` only for a run of
        ``PROMPT_GRAPHS_FROM`` ``prompts`` or more (None: as many). Graphs already warm are skipped. A bar on
        stderr names each graph and why it runs; one summary line ends it."""
        report = WarmupReport()
        self.progress = progress
        every = self.cfg.warm_graphs == "all" or not self.shapes.dynamic_batch
        lone, batched = lone or every, batched or every
        ks = self._warm_ks()
        rows = ("_lone" if lone else "") + ("_batched" if batched else "")
        what = (f"fused_k{'-'.join(map(str, ks))}{rows}_{'-'.join(modes)}"
                f"{'_logprobs' if logprobs else ''}" if self.cfg.fused_step else f"step_by_step_k{self.k_max}")
        first = self.prompts_unwarmed(prompts)
        if first:  # once per engine: prompts are prompts whatever the sampling modes
            what += "_prefill_q" + "-".join(map(str, self.runner.prefill_graph.query_widths))
        # torch's artifacts cache where graphs are not stored whole (the store needs neither Dynamo nor it)
        cached = (self.runner.compile_cache.around_warmup(self.runner.cache_key(what))
                  if self.runner.compile_cache is not None and self.runner.graph_store is None else nullcontext(None))
        store = self.runner.graph_store
        before = (store.loaded, store.compiled) if store is not None else (0, 0)
        with torch.no_grad(), cached as hit:
            if self.cfg.fused_step:
                self._fused(report, progress, modes, logprobs, lone, batched)
            else:
                self._step_by_step(report, progress)
            if first:
                self._prompts(report, progress)
        if store is not None:
            loaded, compiled = store.loaded - before[0], store.compiled - before[1]
            # a hit: every graph this warm-up needed came from the cache (None: it needed none, all were live)
            hit = compiled == 0 if loaded or compiled else None
        report.cache_hit = hit
        if progress and report.graphs_compiled:
            cache = {None: "", True: ", compile cache: hit", False: ", compile cache: cold"}[hit]
            later = (f"; K = {', '.join(map(str, sorted(self.deferred)))} when adaptive K first needs it"
                     if self.deferred else "")
            print(f"ascend-spec: {report.graphs_compiled} graph(s) ready in {report.compile_seconds:.1f} s "
                  f"({self.runner.backend.name}, attention '{self.runner.backend.attention_kernel}'{cache}){later}",
                  file=sys.stderr)
        return report

    def prompts_unwarmed(self, prompts: int | None) -> bool:
        """A warm-up for a run of ``prompts`` prompts (None: unknown) compiles the prompt graphs, not yet warm."""
        wanted = self.cfg.warm_graphs == "all" or prompts is None or prompts >= PROMPT_GRAPHS_FROM
        return self.runner.prefill_graph is not None and not self.prompts_warm and wanted

    def _warm_ks(self) -> list[int]:
        """The K values warm-up compiles: K_max (fixed K, or adaptive K while it learns acceptance) and, adaptive,
        K = 0 and the K values between unless ``warm_graphs: first`` defers them (K = 0 to the end of learning,
        the others to the policy's first pick)."""
        if not (self.cfg.adaptive_k and self.k_max):
            return [self.k_max]
        return [k for k in range(self.k_max + 1) if k not in self.deferred]

    def _fused_plan(self, ks: list[int], lone: bool, batched: bool) -> list[tuple[int, int, str, bool]]:
        """(rows, K, mode, logprobs) of the fused graphs not yet warm: one row count per compiled graph (or CUDA
        graph capture), largest first, then the lone-request graphs, for every mode warmed so far."""
        sizes = self.runner.target_graph.warm_sizes() if batched else []
        if lone and self.shapes.dynamic_batch and 1 in self.runner.batch_sizes and 1 not in sizes:
            sizes = [*sizes, 1]
        plan = [(r, k, mode, lp) for r in sizes for k in ks for mode, lp in self.modes]
        return [g for g in plan if g not in self.graphs]

    def _why(self, rows: int, k: int) -> str:
        """What a fused graph is for, as the warm-up bar says it."""
        if rows == 1 and self.shapes.dynamic_batch:
            return "a lone request"
        if not (self.cfg.adaptive_k and self.k_max):
            return "every step" if k or not self.k_max else "plain decoding"
        return {self.k_max: "K_max: drafts while acceptance is learned", 0: "plain decoding where drafts do not pay"
                }.get(k, "adaptive K")

    def _compile_fused(self, plan: list[tuple[int, int, str, bool]], bar: tqdm | None,
                       report: WarmupReport | None) -> None:
        widths = warm_widths(self.max_blocks) if self.shapes.trim_context else [self.max_blocks]
        for rows, k, mode, logprobs in plan:
            batch = dataclasses.replace(self.runner.inert_batch(rows, k), mode=mode, logprobs=logprobs)
            key = self.runner.spec_graphs.key(rows, k, mode, logprobs)
            # a dynamic-batch key's lone-request graph is its one-row specialisation
            tag = key.tag + ("_rows1" if rows == 1 and key.batch is None else "")
            if bar is not None:
                bar.set_postfix_str(f"{tag} ({self._why(rows, k)})")
            t0 = time.perf_counter()
            for width in widths:
                self.runner.replay(batch, width, None)
            self.graphs.add((rows, k, mode, logprobs))
            if report is not None:
                report.seconds_by_graph[tag] = time.perf_counter() - t0
            if bar is not None:
                bar.update()

    def _fused(self, report: WarmupReport, progress: bool, modes: tuple[str, ...], logprobs: bool,
               lone: bool, batched: bool) -> None:
        ks = self._warm_ks()
        self.modes += [(m, logprobs) for m in modes if (m, logprobs) not in self.modes]
        lone, batched = lone or self.lone, batched or self.batched  # what earlier warm-ups warmed, for new modes
        plan = self._fused_plan(ks, lone, batched)
        t_all = time.perf_counter()
        with tqdm(total=len(plan), desc="compiling graphs", unit="graph", file=sys.stderr,
                  disable=not progress or not plan, dynamic_ncols=True) as bar:
            self._compile_fused(plan, bar, report)
        self.lone, self.batched = lone, batched
        report.graphs_compiled = len(plan)
        report.compile_seconds = time.perf_counter() - t_all
        if self.cfg.adaptive_k and len(ks) > 1 and plan:  # one K alone has nothing to be weighed against yet
            self._time_steps(ks)
        self.runner.drop_batch()

    def _prompts(self, report: WarmupReport, progress: bool) -> None:
        """Compile the prompt graph(s) and the draft chain the prompts' drafts replay: one dynamic-query graph each
        replayed at a short and the widest width, or one per bucket and width where graphs replay one shape."""
        graph = self.runner.prefill_graph
        assert graph is not None
        t0 = time.perf_counter()
        widths = warm_widths(self.max_blocks) if self.shapes.trim_context else None
        # first call: rows (2), query (5) and table width (3) distinct, so Dynamo gives each its own symbol
        queries = sorted({min(5, graph.query_widths[-1]), graph.query_widths[-1]}) if graph.query_dynamic else None
        rows = graph.max_size
        dev = self.device
        z = torch.zeros(rows, graph.query_widths[0], dtype=torch.long, device=dev)
        per_row = torch.zeros(rows, dtype=torch.long, device=dev)
        table = torch.zeros(rows, self.max_blocks, dtype=torch.long, device=dev)
        example = [z, z.clone(), torch.full_like(z, -1), table, per_row, per_row.clone()]
        times = graph.warmup(example, (self.runner.caches.target,), progress=progress, widths=widths, queries=queries)
        report.seconds_by_graph.update({f"prefill_bs{b}": t for b, t in times.items()})
        report.graphs_compiled += len(times)
        if self.runner.proposer is not None and self.cfg.fused_step:  # the prompts' drafts (step by step warmed it)
            times = self.runner.proposer.warmup(progress=progress)
            report.seconds_by_graph.update({f"draft_bs{b}": t for b, t in times.items()})
            report.graphs_compiled += len(times)
        report.compile_seconds += time.perf_counter() - t0
        self.prompts_warm = True

    def _time_steps(self, ks: list[int], rounds: int = 5) -> None:
        """Step cost per bucket of each K in ``ks`` for adaptive K: medians of ``rounds`` rounds, the K values
        interleaved in each so machine noise weighs on all of them alike; deferred K values interpolated."""
        # the buckets whose graphs are warm (``warm_graphs: first`` may have left the batch or lone-request ones out)
        warm = [b for b in self.runner.batch_sizes if (self.lone if self.runner.rows_for(b) == 1 else self.batched)]
        for bucket in warm:
            self.adaptive.step_seconds[bucket] = self._median_step_times(bucket, ks, rounds)
        self._interpolate_deferred()

    def _median_step_times(self, bucket: int, ks: list[int], rounds: int) -> dict[int, float]:
        """Median seconds of a step of ``bucket`` at each K in ``ks`` over ``rounds`` rounds, K values interleaved."""
        times: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(rounds):
            for k in times:
                times[k].append(self.time_step(bucket, k, context=WARMUP_COST_CONTEXT, repeats=3))
        return {k: sorted(t)[len(t) // 2] for k, t in times.items()}

    def _interpolate_deferred(self) -> None:
        """Figures for the deferred K values between K = 0 and K_max, on the line through theirs once both are
        timed; the policy never explores them, and compiles one it picks."""
        between = sorted(j for j in self.deferred if j)
        for costs in self.adaptive.step_seconds.values():
            if 0 in costs and self.k_max in costs:
                costs.update(interpolated_costs({0: costs[0], self.k_max: costs[self.k_max]}, between))
        self.adaptive.pending = set(between)

    def compile_deferred(self, k: int, why: str) -> None:
        """Compile (or load from the cache) the fused graphs of a K that warm-up deferred, for every mode it warmed,
        and time it (against K_max, whose figure follows the run's drift, in each bucket timed before): the step
        that needs them waits, no other step does."""
        t0 = time.perf_counter()
        compiles = dynamo_compile_count()
        if self.progress:
            print(f"ascend-spec: compiling the K = {k} step ({why}) ...", file=sys.stderr, flush=True)
        with torch.no_grad():
            self._compile_fused(self._fused_plan([k], self.lone, self.batched), None, None)
            self.deferred.discard(k)
            if self.cfg.adaptive_k and not self.adaptive.step_seconds:
                self._time_steps(self._warm_ks())
            elif self.cfg.adaptive_k:
                for bucket, costs in self.adaptive.step_seconds.items():
                    mid = self._median_step_times(bucket, [k, self.k_max], rounds=3)
                    costs[k] = costs[self.k_max] * mid[k] / mid[self.k_max]
                self._interpolate_deferred()
        self.deferred_compiles += dynamo_compile_count() - compiles
        seconds = time.perf_counter() - t0
        self.deferred_seconds += seconds
        if self.progress:
            print(f"ascend-spec: K = {k} ready in {seconds:.1f} s", file=sys.stderr, flush=True)

    def _step_by_step(self, report: WarmupReport, progress: bool) -> None:
        t0 = time.perf_counter()
        widths = warm_widths(self.max_blocks) if self.shapes.trim_context else None
        ex = self._inert_target_inputs(self.runner.target_graph.max_size, 1 + self.k_max, self.max_blocks)
        times = self.runner.target_graph.warmup(ex, (self.runner.caches.target,), progress=progress, widths=widths)
        report.seconds_by_graph.update({f"target_bs{b}": t for b, t in times.items()})
        report.graphs_compiled += len(times)
        if self.runner.proposer is not None:
            times = self.runner.proposer.warmup(progress=progress)
            report.seconds_by_graph.update({f"draft_bs{b}": t for b, t in times.items()})
            report.graphs_compiled += len(times)
        report.compile_seconds = time.perf_counter() - t0

    def time_step(self, bucket: int, k: int, context: int = 256, repeats: int = 5) -> float:
        """Median seconds of one fused greedy step (``bucket`` rows, K, ``context`` tokens of block table) on an
        inert batch; shapes, not data, set its cost."""
        rows = self.runner.rows_for(bucket) or bucket
        batch = self.runner.inert_batch(rows, k)
        width = self.runner.width_for(context)
        with torch.no_grad():
            return time_call(lambda: self.runner.replay(batch, width, None), repeats=repeats, device=self.device)

    def _inert_target_inputs(self, b: int, q: int, width: int) -> list[torch.Tensor]:
        dev = self.device
        z = torch.zeros(b, q, dtype=torch.long, device=dev)
        return [z, z.clone(), torch.full_like(z, -1), torch.zeros(b, width, dtype=torch.long, device=dev),
                torch.zeros(b, dtype=torch.long, device=dev)]
