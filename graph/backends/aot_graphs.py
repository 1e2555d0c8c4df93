"""Compiled graphs saved whole and loaded without tracing: a warm start that skips Dynamo (inductor on CPU).
Each graph is a list of AOT-compiled variants with their guards; a call runs the first whose guards accept it.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import logging
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves, tree_map_only

from .base import DynamicDims, GraphFn
from .compile_cache import BadEntry, CacheKey, CompileCache, atomic_write, digest_sources, encode_entry
from .guards import keep_input_guards
from .lint import GraphLint, HostOp

log = logging.getLogger(__name__)

#: the message ``note_graph_failure`` recognises as a compile policy speaking, not a fault
_STANCE_REFUSAL = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def aot_available() -> bool:
    """Torch offers AOT compilation with loadable artifacts (2.10+)."""
    return all(hasattr(torch.compiler, name) for name in ("load_compiled_function", "keep_portable_guards_unsafe"))


def keep_portable_input_guards(entries: Any) -> list[bool]:
    """The guards a variant keeps: ``keep_input_guards``' that torch can rebuild in another process."""
    portable = torch.compiler.keep_portable_guards_unsafe(entries)
    return [a and b for a, b in zip(keep_input_guards(entries), portable)]


def _package_sources() -> list[Path]:
    """The folders of ``ascend_spec``, ``ascend_spec.graph`` and ``ascend_spec.compat``: apart in a checkout, one
    inside the other once installed."""
    folders = []
    for name in ("ascend_spec", "ascend_spec.graph", "ascend_spec.compat"):
        spec = importlib.util.find_spec(name)
        folders += [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    return folders


@functools.cache
def traced_code_digest() -> str:
    """sha256 over the sources a graph's trace can reach (the graph package, the engine's step code and, inside
    vLLM, the layers that wrap vLLM's modules)."""
    digests = [f"{folder.name}:{digest_sources(folder)}" for folder in _package_sources() if folder.is_dir()]
    return hashlib.sha256(";".join(digests).encode()).hexdigest()[:24]


_SCALARS = (int, float, str, bool, bytes, type(None), torch.dtype, torch.device)


def closure_fingerprint(obj: Any, depth: int = 0, seen: set[int] | None = None) -> str:
    """What a graph function closes over, as text stable across processes: its code's name, and recursively the
    values of its closure cells and defaults (ints, flags, modes; nested functions and the objects holding them).
    Modules and tensors count by kind and shape only: the model config in the key covers them. Two graph
    functions from one factory with different settings (K, a mode, a flag such as ``keep_hidden``) differ here,
    so their saved graphs never share a key."""
    seen = set() if seen is None else seen
    if isinstance(obj, _SCALARS):
        return repr(obj)
    if isinstance(obj, torch.nn.Module):
        return f"module {type(obj).__qualname__}"
    if isinstance(obj, torch.Tensor):
        return f"tensor {obj.dtype} {tuple(obj.shape)}"
    if id(obj) in seen or depth > 8:
        return f"<{type(obj).__qualname__}>"
    seen.add(id(obj))
    rec = functools.partial(closure_fingerprint, depth=depth + 1, seen=seen)
    if isinstance(obj, (tuple, list)):
        return "[" + ",".join(map(rec, obj)) + "]"
    if isinstance(obj, dict):
        return "{" + ",".join(f"{rec(k)}:{rec(v)}" for k, v in sorted(obj.items(), key=lambda kv: repr(kv[0]))) + "}"
    if inspect.ismethod(obj):
        return f"method {rec(obj.__func__)} of {rec(obj.__self__)}"
    if inspect.isfunction(obj):
        cells = [rec(c.cell_contents) for c in obj.__closure__ or ()]
        return (f"fn {obj.__module__}.{obj.__code__.co_qualname}({','.join(obj.__code__.co_freevars)}="
                f"{','.join(cells)}; defaults {rec(obj.__defaults__)} {rec(obj.__kwdefaults__)})")
    state = vars(obj) if hasattr(obj, "__dict__") else {
        name: getattr(obj, name) for name in getattr(type(obj), "__slots__", ()) if hasattr(obj, name)}
    return f"{type(obj).__module__}.{type(obj).__qualname__}{rec(state)}"


def device_capability(device: torch.device) -> str:
    """What compiled kernels depend on besides the device kind: the CPU's vector ISA, a GPU's name and capability."""
    if device.type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    return device.type


@dataclasses.dataclass
class GraphStore:
    """Where an engine's AOT-compiled graphs live: one cache entry per graph tag, holding its variants."""

    cache: CompileCache
    #: the key every graph of this engine shares (the tag goes into ``what``)
    base_key: CacheKey
    #: objects the graphs close over that must not be pickled (the model and each of its submodules, by name)
    external: dict[str, object]
    #: counters for the warm-up report
    loaded: int = 0
    compiled: int = 0
    #: run before each trace (a warm start that loads every graph traces nothing, and so runs it never)
    before_compile: Callable[[], None] | None = None

    def key(self, tag: str, closure: str = "") -> CacheKey:
        """``closure``: the graph function's :func:`closure_fingerprint` (its digest goes into the key)."""
        options = {**self.base_key.backend_options,
                   "closure": hashlib.sha256(closure.encode()).hexdigest()[:24]}
        return dataclasses.replace(self.base_key, what=f"graph.{tag}"[:64], graph_code=traced_code_digest(),
                                   backend_options=options)

    def read(self, key: CacheKey) -> dict[str, Any] | None:
        """The stored ``{"variants": [bytes], "findings": [...]}`` under ``key``; None on a miss (a bad entry warns
        once and is removed)."""
        payload = self.cache.read_payload(key)
        if payload is None:
            return None
        try:
            stored = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - a payload that does not un-pickle is a miss
            self.reject(key, f"unreadable payload ({exc.__class__.__name__}: {exc})")
            return None
        if not isinstance(stored, dict) or not isinstance(stored.get("variants"), list):
            self.reject(key, "unreadable payload (allowed: a dict with a list of variants)")
            return None
        return stored

    def write(self, key: CacheKey, variants: list[bytes], findings: list[HostOp]) -> None:
        payload = pickle.dumps({"variants": variants, "findings": [dataclasses.asdict(f) for f in findings]})
        atomic_write(self.cache.path_for(key), encode_entry(key, payload, variants=len(variants)))

    def reject(self, key: CacheKey, reason: str) -> None:
        self.cache.discard(self.cache.path_for(key), reason)


def module_refs(model: torch.nn.Module) -> dict[str, object]:
    """The model and every submodule by path: what a graph may close over, passed by reference at save and load."""
    return {"model" + (f".{name}" if name else ""): module for name, module in model.named_modules()}


def _deserialize(data: bytes, f_globals: dict[str, object], external: dict[str, object]) -> Any:
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with tracing(TracingContext(FakeTensorMode())):
        variant = AOTCompiledFunction.deserialize(data, f_globals, external)
    variant.disable_guard_check()  # checked by AotGraph before the call
    return variant


def _unmarked(args: tuple[Any, ...], dims: DynamicDims | None) -> tuple[Any, ...]:
    """``args`` with each dynamic-dimension tensor replaced by an alias of its own (same storage), which the
    compile marks: a marking left on the caller's tensor would fail every loaded variant's guards on it."""
    if dims is None:
        return args
    out = list(args)
    for i in {*dims.batch, *dims.width, *dims.query}:
        out[i] = args[i].detach()
    if dims.pools_from is not None:
        out[dims.pools_from:] = tree_map_only(torch.Tensor, torch.Tensor.detach, args[dims.pools_from:])
    return tuple(out)


def mark_pools(args: tuple[Any, ...], dims: DynamicDims) -> None:
    """Dim 0 of every cache tensor dynamic: the pool's block count is data (see ``DynamicDims.pools_from``)."""
    if dims.pools_from is not None:
        for leaf in tree_leaves(args[dims.pools_from:]):
            if isinstance(leaf, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(leaf, 0)


def _stance_refuses() -> bool:
    from torch._dynamo.eval_frame import _stance

    return getattr(_stance, "stance", "default") == "fail_on_recompile"


class AotGraph:
    """One graph: its variants, loaded on the first call, compiled (and saved) when none accepts a call."""

    def __init__(self, fn: GraphFn, tag: str, dims: DynamicDims | None, store: GraphStore, lint: GraphLint,
                 make_compiled: Callable[[GraphFn], Any], mark: Callable[[tuple[Any, ...], DynamicDims], None]
                 ) -> None:
        self.fn = fn
        self.tag = tag
        self.dims = dims
        self.store = store
        self.lint = lint
        self._make_compiled = make_compiled
        self._mark = mark
        self.variants: list[Any] = []
        self._saved: list[bytes] = []
        self._findings: list[HostOp] = []
        #: variants came from disk (a miss then is a guard failure, worth a warning; on a cold start it is not)
        self.store_loaded = False
        self._warned = False
        self.key: CacheKey | None = None  # set by the first call, which loads
        self.__name__ = tag

    def _load(self) -> None:
        self.key = self.store.key(self.tag, closure_fingerprint(self.fn))
        self._read_stored()

    def _read_stored(self) -> None:
        assert self.key is not None
        stored = self.store.read(self.key)
        if stored is None or len(stored["variants"]) <= len(self._saved):
            return
        try:
            variants = [_deserialize(data, self.fn.__globals__, self.store.external) for data in stored["variants"]]
            findings = [HostOp(**f) for f in stored.get("findings", [])]
        except Exception as exc:  # noqa: BLE001 - whatever torch raises, the answer is "recompile"
            self.store.reject(self.key, f"torch could not load it ({exc.__class__.__name__}: {exc})")
            return
        self.lint.report(findings, self.tag)  # as at compile: strict refuses, else counted
        self.store.loaded += len(variants) - len(self.variants)
        self.variants, self._saved, self._findings = variants, list(stored["variants"]), findings
        self.store_loaded = True

    def _compile(self, args: tuple[Any, ...]) -> Any:
        if self.variants and _stance_refuses():
            raise RuntimeError(f"{_STANCE_REFUSAL}: graph {self.tag!r} has no variant for these arguments")
        assert self.key is not None
        with self.store.cache.compiling(self.key):
            # another process may have saved a variant while this one waited (data-parallel ranks, engines side
            # by side): load it rather than compile it again
            self._read_stored()
            for variant in self.variants:
                if _accepts(variant, args):
                    return variant
            return self._compile_locked(args)

    def _compile_locked(self, args: tuple[Any, ...]) -> Any:
        if self.store_loaded and not self._warned:
            self._warned = True
            log.warning("saved graph %s: no stored variant accepts these arguments (a shape or dtype it was not "
                        "compiled for); compiling one and adding it to the cache", self.tag)
        example = _unmarked(args, self.dims)
        if self.dims is not None:
            self._mark(example, self.dims)
            mark_pools(example, self.dims)
        if self.store.before_compile is not None:
            self.store.before_compile()
        before = len(self.lint.findings)
        # Dynamo's capture counts it as a compile (``engine.dynamo_compile_count``), as any other
        variant = self._make_compiled(self.fn).aot_compile((example, {}))
        self.store.compiled += 1
        self.variants.append(variant)
        self._findings += self.lint.findings[before:]
        try:
            from torch._dynamo.aot_compile import AOTCompiledFunction

            self._saved.append(AOTCompiledFunction.serialize(variant, self.store.external).serialized_data)
            self.store.write(self.key, self._saved, self._findings)
        except Exception as exc:  # noqa: BLE001 - a graph that cannot be saved still runs
            log.warning("compiled graph %s not saved (%s: %s); the next start compiles it again", self.tag,
                        type(exc).__name__, exc)
        variant.disable_guard_check()
        return variant

    def __call__(self, *args: Any) -> Any:
        if self.key is None:
            self._load()
        for variant in self.variants:
            if _accepts(variant, args):
                return variant(*args)
        return self._compile(args)(*args)


def _accepts(variant: Any, args: tuple[Any, ...]) -> bool:
    """The variant's guards pass on ``args``; a guard that cannot be evaluated on them is a mismatch, as in Dynamo."""
    try:
        return bool(variant.guard_check(*args))
    except Exception:  # noqa: BLE001 - e.g. an attribute a guard reads is missing on these arguments
        return False
