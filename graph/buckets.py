"""Batch buckets: padded batch sizes whose graphs are replayed every step, and the warm-up steps that replay them.
``BucketedGraph.rows_for`` gives the graph rows a batch runs; the nominal bucket is the K policy's.
"""
from __future__ import annotations

import bisect
import logging
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from .backends.base import Backend, DynamicDims, compile_per_bucket

logger = logging.getLogger(__name__)


def note_graph_failure(failures: dict, key: object, what: str, exc: Exception, policy: str) -> None:
    """A compiled graph's failure under ``key``: raised again where ``policy`` is ``raise``; else counted, with a
    warning and the traceback on the first one of that key (later ones at debug level).

    A compile policy speaking (``torch.compiler.set_stance("fail_on_recompile")`` refusing to compile) is no
    fault to hide: it is raised again whatever the policy."""
    if policy == "raise" or "torch.compile stance" in str(exc):
        raise exc
    n = failures[key] = failures.get(key, 0) + 1
    (logger.warning if n == 1 else logger.debug)("%s failed (%s: %s); this step runs eagerly (failure %d)", what,
                                                 type(exc).__name__, exc, n, exc_info=exc if n == 1 else None)


def warm_widths(max_blocks: int, smallest: int = 3, step: int = 8) -> list[int]:
    """Block-table widths a warm-up replays on backends with a dynamic width: the smallest (3: distinct from the
    warm-up batch of 2 rows, so Dynamo gives the two dimensions separate symbols), then ×``step`` up to the full
    width. A dynamic-width graph is compiled for a range of widths around its first one (inductor chooses,
    say, a reduction strategy for the keys and guards on it: "width <= 256"); replaying across the whole range at
    warm-up compiles every variant a run can reach, so contexts up to ``max_model_len`` never recompile."""
    widths, w = [], min(smallest, max_blocks)
    while w < max_blocks:
        widths.append(w)
        w *= step
    return widths + [max_blocks]


@dataclass(frozen=True, slots=True)
class WarmStep:
    """One entry of a warm-up plan: ``run`` compiles (or loads, or on CUDA captures) one graph by replaying it on
    inert inputs; ``tag`` names it in the report, ``why`` tells the progress bar what it is for."""

    tag: str
    run: Callable[[], None]
    why: str = ""


def run_warm_steps(steps: Sequence[WarmStep], progress: bool = True, desc: str = "compiling graphs"
                   ) -> dict[str, float]:
    """Run a warm-up plan under one progress bar on stderr; each step's seconds by its tag."""
    seconds: dict[str, float] = {}
    with torch.no_grad(), tqdm(total=len(steps), desc=desc, unit="graph", file=sys.stderr,
                               disable=not progress or not steps, dynamic_ncols=True) as bar:
        for step in steps:
            bar.set_postfix_str(f"{step.tag} ({step.why})" if step.why else step.tag)
            t0 = time.perf_counter()
            step.run()
            seconds[step.tag] = time.perf_counter() - t0
            logger.info("%s ready in %.2fs", step.tag, seconds[step.tag])
            bar.update()
    return seconds


@dataclass(frozen=True, slots=True)
class BatchArg:
    """A per-request input (first dim = batch) and the value its pad rows hold."""

    name: str
    pad_value: float | int
    #: dim 1 is the block-table width (trimmed to the live blocks by callers on ``trim_context`` backends)
    width: bool = False
    #: dim 1 is the query width (tokens per request): one dynamic dimension on ``dynamic_batch`` backends
    query: bool = False


class BucketedGraph:
    def __init__(self, backend: Backend, fn: Callable, prefix: str, sizes: Sequence[int],
                 batch_args: Sequence[BatchArg], query_widths: Sequence[int] = (), host_lengths: bool = False
                 ) -> None:
        """``host_lengths``: ``fn`` takes last the KV lengths as host ints (attention that reads them, see
        ``paging.PagedInputs.seq_lens_host``); every call passes them, padded here with the pad rows' 0 and,
        where the query pads with inert tokens, lengthened as the query block is."""
        if not sizes:
            raise ValueError(f"{prefix}: graph batch sizes must not be empty")
        self.backend = backend
        self.eager_fn = fn
        self.prefix = prefix
        self.shapes = backend.shapes
        #: the buckets, in requests (graphs serve batches up to the largest; rows pad to ``min_batch`` at least)
        self.sizes = sorted(set(sizes))
        self.batch_args = tuple(batch_args)
        self.host_lengths = host_lengths
        self.dims = DynamicDims(batch=tuple(range(len(self.batch_args))),
                                width=tuple(i for i, a in enumerate(self.batch_args) if a.width),
                                query=tuple(i for i, a in enumerate(self.batch_args) if a.query),
                                pools_from=len(self.batch_args))  # the caches come after the batch
        if bool(self.dims.query) != bool(query_widths) or min(query_widths, default=1) < 1:
            raise ValueError(f"{prefix}: query_widths={list(query_widths)!r}; allowed: widths >= 1, given exactly "
                             "when an argument has a query axis")
        #: the query widths graphs serve (see the module's docstring); empty without a query axis
        self.query_widths = sorted(set(query_widths))
        #: one compile serves every query width up to the largest (else: one graph per bucket and width)
        self.query_dynamic = self.shapes.exact_batch
        keyed = [] if self.query_dynamic or len(self.query_widths) < 2 else self.query_widths
        self.graphs = compile_per_bucket(backend, fn, prefix, self.sizes, self.dims, keyed)
        self._buffers: dict[tuple[str, int | None], torch.Tensor] = {}
        self._warned_eager = False
        #: run-time failures of each bucket's compiled graph (each step reran eagerly)
        self.failures: dict[int, int] = {}

    @property
    def num_failures(self) -> int:
        return sum(self.failures.values())

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def rows_for(self, batch: int) -> int | None:
        """Rows the graph runs for ``batch`` requests; None above the largest bucket (eager)."""
        if batch > self.max_size:
            return None
        rows = batch if self.shapes.exact_batch else self.sizes[bisect.bisect_left(self.sizes, batch)]
        return max(rows, self.shapes.min_batch)

    def warm_sizes(self) -> list[int]:
        """Rows warm-up runs: one per compiled graph (or CUDA graph capture), largest first (as nano-vllm)."""
        rows = sorted({max(s, self.shapes.min_batch) for s in self.sizes}, reverse=True)
        return rows[-1:] if self.shapes.dynamic_batch and not self.backend.reuses_outputs else rows

    def query_for(self, query: int) -> int | None:
        """The query width a graph runs for ``query`` tokens a request; None above the largest (eager)."""
        if query > self.query_widths[-1]:
            return None
        if self.query_dynamic:
            return max(query, 2)  # a dynamic dimension of size 1 would specialise the compile: one inert token more
        return self.query_widths[bisect.bisect_left(self.query_widths, query)]

    def serves(self, batch: int, query: int | None = None) -> bool:
        """Whether ``batch`` requests (× ``query`` tokens each, on a graph with a query axis) replay a graph."""
        return self.rows_for(batch) is not None and (query is None or self.query_for(query) is not None)

    def tokens_for(self, batch: int, query: int) -> int:
        """Tokens a call of ``batch`` requests × ``query`` tokens each runs: the graph's padded rows × width, or
        the call's own where it runs eagerly (a forward context sized for the draft must say this)."""
        rows = self.rows_for(batch)
        width = self.query_for(query) if self.dims.query else query
        return batch * query if rows is None or width is None else rows * width

    def _graph(self, rows: int, query: int | None) -> Callable:
        for key in ((rows, query), rows):
            if key in self.graphs:
                return self.graphs[key]
        return self.graphs[self.sizes[0]]

    def _buffer(self, arg: BatchArg, like: torch.Tensor) -> torch.Tensor:
        """The persistent max-rows buffer of ``arg`` at ``like``'s trailing shape: one per query width where graphs
        replay one shape (an input keeps its address), else one per argument, replaced when its shape changes (a
        dynamic width must not keep a buffer for every width it has seen)."""
        key = (arg.name, like.shape[1] if arg.query and not self.query_dynamic else None)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[1:] != like.shape[1:] or buf.dtype != like.dtype or buf.device != like.device:
            rows = max(self.max_size, self.shapes.min_batch)
            buf = torch.full((rows, *like.shape[1:]), arg.pad_value, dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf

    def _pad(self, arg: BatchArg, x: torch.Tensor, bucket: int, width: int | None) -> torch.Tensor:
        """``x`` padded to ``bucket`` rows (and, on a query argument, ``width`` tokens) with ``arg``'s pad value, in
        the argument's buffer: warm-up and run pass the same kind of input (a view of a buffer; Dynamo guards on
        its base)."""
        b = x.shape[0]
        trailing = (width, *x.shape[2:]) if arg.query else x.shape[1:]
        buf = self._buffer(arg, x.new_empty(0, *trailing))[:bucket]
        buf[b:].fill_(arg.pad_value)
        if arg.query:
            buf[:b, x.shape[1]:].fill_(arg.pad_value)
        (buf[:b, : x.shape[1]] if arg.query else buf[:b]).copy_(x)
        return buf

    def __call__(self, batch_inputs: Sequence[torch.Tensor], static_inputs: Sequence[object] = (),
                 host_lengths: tuple[int, ...] | None = None) -> tuple:
        if len(batch_inputs) != len(self.batch_args):
            raise ValueError(f"{self.prefix}: expected {len(self.batch_args)} batch inputs "
                             f"({[a.name for a in self.batch_args]}), got {len(batch_inputs)}")
        b = batch_inputs[0].shape[0]
        if self.host_lengths != (host_lengths is not None) or host_lengths is not None and len(host_lengths) != b:
            raise ValueError(f"{self.prefix}: host_lengths={host_lengths!r}; allowed: "
                             + (f"{b} host ints, one per request" if self.host_lengths else
                                "None (this graph's attention reads the device lengths)"))
        if host_lengths is not None:
            static_inputs = (*static_inputs, tuple(host_lengths))
        bucket = self.rows_for(b)
        query = batch_inputs[self.dims.query[0]].shape[1] if self.dims.query else None
        width = None if query is None else self.query_for(query)
        if bucket is None:
            if not self._warned_eager:
                logger.warning("%s: batch of %d requests exceeds the largest graph bucket (%d); running eagerly",
                               self.prefix, b, self.max_size)
                self._warned_eager = True
            return tuple(self.eager_fn(*batch_inputs, *static_inputs))
        if query is not None and width is None:  # wider than every graph: the caller knew (``serves``)
            return tuple(self.eager_fn(*batch_inputs, *static_inputs))
        padded = [self._pad(arg, x, bucket, width) for arg, x in zip(self.batch_args, batch_inputs)]
        if host_lengths is not None:
            # a query padded with inert tokens ends later: each live row's length follows its query block
            longer = 0 if query is None or width is None else width - query
            lengths = tuple(n + longer if n else 0 for n in host_lengths) + (0,) * (bucket - b)
            static_inputs = (*static_inputs[:-1], lengths)
        try:
            outputs = self._graph(bucket, width)(*padded, *static_inputs)
        except Exception as exc:  # noqa: BLE001 - any graph/runtime fault: rerun this step on the reference
            note_graph_failure(self.failures, bucket, f"{self.prefix}: compiled graph for batch size {bucket}", exc,
                               self.backend.graph_failure)
            return tuple(self.eager_fn(*batch_inputs, *static_inputs))
        if self.backend.reuses_outputs:
            return tuple(o[:b].clone() for o in outputs)
        return tuple(o[:b] for o in outputs)

    def warm_steps(self, example_batch_inputs: Sequence[torch.Tensor], static_inputs: Sequence[object] = (),
                   widths: Sequence[int] | None = None, queries: Sequence[int] | None = None, why: str = ""
                   ) -> list[WarmStep]:
        """The warm-up plan of this graph: one step per compiled graph (or CUDA graph capture), largest rows first,
        each replaying its graph with all rows padded (inert). ``widths``: the block-table widths to replay (see
        :func:`warm_widths`); ``queries``: the query widths, each replayed at the narrowest table (a dynamic query
        axis: the widths prefills take); default the examples' own, and on a graph with a query axis that replays
        one shape per key, every one of ``query_widths``."""
        if queries is None and self.query_widths and not self.query_dynamic:
            queries = self.query_widths
        tables = list(widths or [None])
        if queries and not self.query_dynamic:  # one graph per query width: each replays every table width
            shapes = [(w, q) for q in queries for w in tables]
        else:
            # Query widths first (the first call compiles: a query width of 1 + K could equal the row count and
            # share its symbol), at the narrowest table: a wide query over a long context is a large warm-up.
            shapes = [(tables[0], q) for q in queries or []] + [(w, None) for w in tables]

        def replay(size: int) -> None:
            for width, query in shapes:
                padded = []
                for arg, x in zip(self.batch_args, example_batch_inputs):
                    if width is not None and arg.width:
                        x = x[:, :width] if x.shape[1] >= width else x.new_zeros(x.shape[0], width)
                    if query is not None and arg.query:
                        x = x.new_zeros(x.shape[0], query, *x.shape[2:])
                    padded.append(self._pad(arg, x[:0], size, x.shape[1] if arg.query else None))
                lengths = ((0,) * size,) if self.host_lengths else ()
                self._graph(size, query if query is not None else self._example_query(example_batch_inputs))(
                    *padded, *static_inputs, *lengths)

        return [WarmStep(f"{self.prefix}_bs{size}", lambda size=size: replay(size), why)
                for size in self.warm_sizes()]

    def _example_query(self, batch_inputs: Sequence[torch.Tensor]) -> int | None:
        return batch_inputs[self.dims.query[0]].shape[1] if self.dims.query else None
