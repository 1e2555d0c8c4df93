"""The compiled graphs of one runner, in one registry: each by name, the one warm-up that compiles a plan of them,
one count of their failures, and the one key scheme their compiled artifacts are kept under on disk.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from .graph.backends import Backend
from .graph.backends.aot_graphs import GraphStore, aot_available, device_capability, module_refs
from .graph.backends.compile_cache import CacheKey, CompileCache, open_default_cache
from .graph.buckets import WarmStep, run_warm_steps
from .graph.model import DeepseekV3ForCausalLM

GRAPH_NAMES = ("fused", "target", "prefill", "draft")
#: key options the graph functions that read them close over: a graph saved whole carries them in its closure
#: fingerprint, so the store's key leaves them out, and engines that differ only in them share the graphs that
#: never read them (the unpadded drafter layout: all but the fused step)
CLOSURE_OPTIONS = frozenset({"disable_padded_drafter_batch"})


class CompiledGraphs(Protocol):
    """What the registry asks of a graph: its failures (each step reran eagerly), by key."""

    failures: dict


def graph_cache_key(what: str, model: DeepseekV3ForCausalLM, backend: Backend, device: torch.device,
                    dtype: torch.dtype | str, **options: Any) -> CacheKey:
    """The key of compiled graphs on disk: the model, the backend, the device and its vector ISA or GPU, the dtype
    and the attention kernel, and ``options`` (whatever else shapes the traced code where they are built: block
    size, cache layout, buckets, vLLM's version ...). The graph code and torch's version join in ``CacheKey``."""
    return CacheKey(what=what, model_config=model.cfg.to_hf_dict(), backend=backend.name,
                    backend_options={"device": str(device), "capability": device_capability(device),
                                     "dtype": str(dtype), "attention": backend.attention_kernel, **options})


class GraphRegistry:
    def __init__(self, model: DeepseekV3ForCausalLM, backend: Backend, device: torch.device,
                 key_options: dict[str, Any]) -> None:
        """``key_options``: what besides :func:`graph_cache_key`'s own fields shapes this runner's graphs."""
        self.model = model
        self.backend = backend
        self.device = device
        self.key_options = dict(key_options)
        self._graphs: dict[str, CompiledGraphs] = {}
        # compiled graphs kept across runs (torchair keeps its own: use_cached_graph / cache_compile)
        self.compile_cache: CompileCache | None = open_default_cache() if backend.name == "inductor" else None
        #: graphs saved whole where the backend can load them without tracing (CPU inductor)
        self.store: GraphStore | None = None
        if self.compile_cache is not None and device.type == "cpu" and aot_available():
            self.store = backend.store = GraphStore(self.compile_cache, self.cache_key("graphs", CLOSURE_OPTIONS),
                                                    external=module_refs(model))

    def cache_key(self, what: str, leave_out: frozenset[str] = frozenset()) -> CacheKey:
        options = {k: v for k, v in self.key_options.items() if k not in leave_out}
        return graph_cache_key(what, self.model, self.backend, self.device, self.model.lm_head.weight.dtype,
                               **options)

    def add(self, name: str, graph: CompiledGraphs) -> Any:
        """Register ``graph`` under ``name`` (one of ``GRAPH_NAMES``); returns it."""
        if name not in GRAPH_NAMES or name in self._graphs:
            raise ValueError(f"graph name {name!r}; allowed: one of {list(GRAPH_NAMES)} not yet registered "
                             f"(registered: {sorted(self._graphs)})")
        self._graphs[name] = graph
        return graph

    def __getitem__(self, name: str) -> CompiledGraphs | None:
        return self._graphs.get(name)

    def failures(self) -> dict[str, int]:
        """Failures so far per registered graph (``graph_failure: eager``: each of those steps reran eagerly)."""
        return {name: sum(g.failures.values()) for name, g in self._graphs.items()}

    def num_failures(self) -> int:
        return sum(self.failures().values())

    def warm(self, plan: list[WarmStep], progress: bool = True, what: str | None = None
             ) -> tuple[dict[str, float], float, bool | None]:
        """Run a warm-up ``plan`` under one bar: each step's seconds, the wall seconds of them all, and whether
        the compile cache held every graph it needed (None: it needed none or keeps none). ``what`` names the
        plan's artifacts where torch's cache keeps them per warm-up (graphs not saved whole); None: no such
        entry (a graph compiled on first use)."""
        t0 = time.perf_counter()
        per_warmup = self.compile_cache is not None and self.store is None and what is not None
        cached = self.compile_cache.around_warmup(self.cache_key(what)) if per_warmup else nullcontext(None)
        before = (self.store.loaded, self.store.compiled) if self.store is not None else (0, 0)
        with cached as hit:
            seconds = run_warm_steps(plan, progress)
        if self.store is not None:
            loaded, compiled = self.store.loaded - before[0], self.store.compiled - before[1]
            hit = compiled == 0 if loaded or compiled else None
        return seconds, time.perf_counter() - t0, hit
