"""Warm-up: which compiled graphs a run needs before its first step, which it defers, and their step costs.
It plans :class:`~.graph.buckets.WarmStep` lists for the registry and compiles a deferred K when first picked.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .adaptive import WARMUP_COST_CONTEXT, AdaptiveK, interpolated_costs
from .graph.buckets import WarmStep, warm_widths
from .runner_parts import RunnerParts
from .sampling import GREEDY
from .timing import time_call

#: ``warm_graphs: first`` compiles the prompt graphs only for a run of this many prompts: below it their load and
#: compile cost more than they save (docs/performance.md, "Tuned constants")
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

    def __init__(self, parts: RunnerParts, costs: AdaptiveK, drop_batch: Callable[[], None]) -> None:
        """``costs``: the K policy's step costs, which warm-up measures; ``drop_batch``: tells the runner that
        warm-up replayed inert batches through its graphs (its next fused step builds its device batch anew)."""
        self.parts = parts
        self.cfg = parts.cfg
        self.k_max = parts.k_max
        self.shapes = parts.shapes
        self.device = parts.device
        self.max_blocks = parts.max_blocks
        self.adaptive = costs
        self._drop_batch = drop_batch
        first = self.cfg.warm_graphs == "first" and parts.backend.name != "eager"
        defers = first and self.cfg.adaptive_k and self.cfg.fused_step
        #: fused-step K values whose graphs warm-up leaves for their first use (``warm_graphs: first``)
        self.deferred: set[int] = set(range(self.k_max)) if defers else set()
        #: lone-request (one-row) graphs and batch graphs warm, or compiled on first use (``warm_graphs: all``)
        self.lone = self.batched = not first
        #: the prompt graph and the prompts' draft chain are warm
        self.prompts_warm = False
        #: (sampling mode, logprobs) pairs the fused path was warmed for, and the (rows, K, mode, logprobs) graphs
        self.modes: list[tuple[str, bool]] = []
        self.fused_warm: set[tuple[int, int, str, bool]] = set()
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
        self.progress = progress
        every = self.cfg.warm_graphs == "all" or not self.shapes.dynamic_batch
        lone, batched = lone or every, batched or every
        ks = self._warm_ks()
        rows = ("_lone" if lone else "") + ("_batched" if batched else "")
        what = (f"fused_k{'-'.join(map(str, ks))}{rows}_{'-'.join(modes)}"
                f"{'_logprobs' if logprobs else ''}" if self.cfg.fused_step else f"step_by_step_k{self.k_max}")
        prompts_too = self.prompts_unwarmed(prompts)
        if prompts_too:  # once per engine: prompts are prompts whatever the sampling modes
            what += "_prefill_q" + "-".join(map(str, self.parts.prefill_graph.query_widths))
        if self.cfg.fused_step:
            self.modes += [(m, logprobs) for m in modes if (m, logprobs) not in self.modes]
            lone, batched = lone or self.lone, batched or self.batched  # what earlier warm-ups warmed, for new modes
            fused = self._fused_plan(ks, lone, batched)
            plan = self._fused_steps(fused)
        else:
            plan = self._step_by_step_steps()
        if prompts_too:
            plan += self._prompt_steps()
        seconds, wall, hit = self.parts.graphs.warm(plan, progress, what)
        report = WarmupReport(len(plan), wall, seconds, hit)
        if self.cfg.fused_step:
            self.lone, self.batched = lone, batched
            if self.cfg.adaptive_k and len(ks) > 1 and fused:  # one K alone has nothing to be weighed against yet
                self._time_steps(ks)
            self._drop_batch()
        if prompts_too:
            self.prompts_warm = True
        if progress and report.graphs_compiled:
            cache = {None: "", True: ", compile cache: hit", False: ", compile cache: cold"}[hit]
            later = (f"; K = {', '.join(map(str, sorted(self.deferred)))} when adaptive K first needs it"
                     if self.deferred else "")
            print(f"ascend-spec: {report.graphs_compiled} graph(s) ready in {report.compile_seconds:.1f} s "
                  f"({self.parts.backend.name}, attention '{self.parts.backend.attention_kernel}'{cache}){later}",
                  file=sys.stderr)
        return report

    def rows_for(self, batch: int) -> int | None:
        """Graph rows for ``batch`` requests, at any K. On dynamic-batch backends a lone request runs a one-row
        graph of its own (a size-1 dimension specialises a compile; padded to two rows it would pay for twice its
        tokens); other batches, and a lone request whose graphs warm-up left out, pad to ``min_batch``."""
        if batch == 1 and self.shapes.dynamic_batch and 1 in self.parts.batch_sizes and self.lone:
            return 1
        return self.parts.target_graph.rows_for(batch)

    def prompts_unwarmed(self, prompts: int | None) -> bool:
        """A warm-up for a run of ``prompts`` prompts (None: unknown) compiles the prompt graphs, not yet warm."""
        wanted = self.cfg.warm_graphs == "all" or prompts is None or prompts >= PROMPT_GRAPHS_FROM
        return self.parts.prefill_graph is not None and not self.prompts_warm and wanted

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
        sizes = self.parts.target_graph.warm_sizes() if batched else []
        if lone and self.shapes.dynamic_batch and 1 in self.parts.batch_sizes and 1 not in sizes:
            sizes = [*sizes, 1]
        plan = [(r, k, mode, lp) for r in sizes for k in ks for mode, lp in self.modes]
        return [g for g in plan if g not in self.fused_warm]

    def _why(self, rows: int, k: int) -> str:
        """What a fused graph is for, as the warm-up bar says it."""
        if rows == 1 and self.shapes.dynamic_batch:
            return "a lone request"
        if not (self.cfg.adaptive_k and self.k_max):
            return "every step" if k or not self.k_max else "plain decoding"
        return {self.k_max: "K_max: drafts while acceptance is learned", 0: "plain decoding where drafts do not pay"
                }.get(k, "adaptive K")

    def _fused_steps(self, plan: list[tuple[int, int, str, bool]]) -> list[WarmStep]:
        """Warm-up steps of the fused graphs in ``plan``, each replayed across the block-table widths a run reaches."""
        widths = warm_widths(self.max_blocks) if self.shapes.trim_context else [self.max_blocks]

        def replay(rows: int, k: int, mode: str, logprobs: bool) -> None:
            batch = dataclasses.replace(self.parts.inert_batch(rows, k), mode=mode, logprobs=logprobs)
            for width in widths:
                self.parts.replay(batch, width)
            self.fused_warm.add((rows, k, mode, logprobs))

        steps = []
        for rows, k, mode, logprobs in plan:
            key = self.parts.spec_graphs.key(rows, k, mode, logprobs)
            # a dynamic-batch key's lone-request graph is its one-row specialisation
            tag = key.tag + ("_rows1" if rows == 1 and key.batch is None else "")
            steps.append(WarmStep(tag, functools.partial(replay, rows, k, mode, logprobs), self._why(rows, k)))
        return steps

    def _prompt_steps(self) -> list[WarmStep]:
        """Warm-up steps of the prompt graph(s) and of the draft chain the prompts' drafts replay: one
        dynamic-query graph each replayed at a short and the widest width, or one per bucket and width where
        graphs replay one shape."""
        graph = self.parts.prefill_graph
        assert graph is not None
        widths = warm_widths(self.max_blocks) if self.shapes.trim_context else None
        # first call: rows (2), query (5) and table width (3) distinct, so Dynamo gives each its own symbol
        queries = sorted({min(5, graph.query_widths[-1]), graph.query_widths[-1]}) if graph.query_dynamic else None
        rows = graph.max_size
        dev = self.device
        z = torch.zeros(rows, graph.query_widths[0], dtype=torch.long, device=dev)
        per_row = torch.zeros(rows, dtype=torch.long, device=dev)
        table = torch.zeros(rows, self.max_blocks, dtype=torch.long, device=dev)
        example = [z, z.clone(), torch.full_like(z, -1), table, per_row, per_row.clone()]
        steps = graph.warm_steps(example, (self.parts.caches.target,), widths=widths, queries=queries,
                                 why="prompts")
        if self.parts.proposer is not None and self.cfg.fused_step:  # the prompts' drafts (step by step warmed it)
            steps += self.parts.proposer.warm_steps(why="the prompts' drafts")
        return steps

    def _time_steps(self, ks: list[int], rounds: int = 5) -> None:
        """Step cost per bucket of each K in ``ks`` for adaptive K: medians of ``rounds`` rounds, the K values
        interleaved in each so machine noise weighs on all of them alike; deferred K values interpolated."""
        # the buckets whose graphs are warm (``warm_graphs: first`` may have left the batch or lone-request ones out)
        warm = [b for b in self.parts.batch_sizes if (self.lone if self.rows_for(b) == 1 else self.batched)]
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
        self.parts.graphs.warm(self._fused_steps(self._fused_plan([k], self.lone, self.batched)), progress=False)
        with torch.no_grad():
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

    def _step_by_step_steps(self) -> list[WarmStep]:
        """Warm-up steps of the step-by-step path: the target step (the verify) and the draft chain."""
        widths = warm_widths(self.max_blocks) if self.shapes.trim_context else None
        ex = self._inert_target_inputs(self.parts.target_graph.max_size, 1 + self.k_max, self.max_blocks)
        steps = self.parts.target_graph.warm_steps(ex, (self.parts.caches.target,), widths=widths,
                                                    why="the verify")
        if self.parts.proposer is not None:
            steps += self.parts.proposer.warm_steps()
        return steps

    def time_step(self, bucket: int, k: int, context: int = 256, repeats: int = 5) -> float:
        """Median seconds of one fused greedy step (``bucket`` rows, K, ``context`` tokens of block table) on an
        inert batch; shapes, not data, set its cost."""
        rows = self.rows_for(bucket) or bucket
        batch = self.parts.inert_batch(rows, k)
        width = self.parts.width_for(context)
        with torch.no_grad():
            return time_call(lambda: self.parts.replay(batch, width), repeats=repeats, device=self.device)

    def _inert_target_inputs(self, b: int, q: int, width: int) -> list[torch.Tensor]:
        dev = self.device
        z = torch.zeros(b, q, dtype=torch.long, device=dev)
        return [z, z.clone(), torch.full_like(z, -1), torch.zeros(b, width, dtype=torch.long, device=dev),
                torch.zeros(b, dtype=torch.long, device=dev)]
