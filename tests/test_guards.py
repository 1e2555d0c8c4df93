"""The CPU backend's guard filter: guards on what a call passes are kept, guards on the model and globals go."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ascend_spec.engine import Engine
from ascend_spec.graph.backends import get_backend, guards
from ascend_spec.graph.backends.guards import GLOBAL_STATE_GUARDS, keep_input_guards
from ascend_spec.graph.backends import inductor

from .conftest import TWO_ROW_BUCKETS, inductor_config

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def _recording(kept: list[list[tuple[str, str, bool]]]):
    def record(entries):
        flags = keep_input_guards(entries)
        kept.append([(e.guard_type, e.name, e.has_value and isinstance(e.value, nn.Parameter))
                     for e, f in zip(entries, flags) if f])
        assert len(flags) == len(entries)
        return flags

    return record


def test_engine_graphs_keep_only_argument_and_global_state_guards(trained_dir, monkeypatch):
    """Over 90 s: Dynamo must trace the engine's graphs anew to show what its filter keeps (no graph store)."""
    kept: list[list[tuple[str, str, bool]]] = []
    # the backend takes the module's filter when the engine builds it: record what that filter keeps. Dynamo's own
    # dispatch (no graph store); graphs saved whole keep a subset of the same (aot_graphs.keep_portable_input_guards)
    monkeypatch.setenv("ASCEND_SPEC_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.setattr(inductor, "keep_input_guards", _recording(kept))
    from ascend_spec.graph.weights import load_model

    # test_fused_step's engine at two-row buckets (no one-row graph): Dynamo traces (and filters) anew; in the
    # suite, inductor's cache has its graphs
    eng = Engine(load_model(trained_dir), inductor_config(2, TWO_ROW_BUCKETS))
    eng.warmup(progress=False)
    assert kept, "no graph compiled through the filter"
    for graph in kept:
        names = {name for kind, name, _ in graph if kind == "TENSOR_MATCH"}
        # the step's own tensors stay guarded (dtype, rank, static sizes, strides) ...
        assert "block_table" in names and any(n.startswith("caches[") or n == "cache" for n in names), graph
        for kind, name, is_param in graph:
            # ... and nothing reached through the closure, a module or an import is
            assert kind in GLOBAL_STATE_GUARDS or guards._is_argument(name), (kind, name)
            assert not is_param, name
    assert len(kept) >= 2


def test_argument_guards_still_recompile_on_a_new_dtype_or_rank():
    weight = nn.Parameter(torch.randn(4, 4))

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x @ weight

    compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"guard_filter_fn": keep_input_guards})
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), fn(x))
    with torch.compiler.set_stance("fail_on_recompile"):
        compiled(torch.randn(2, 4))  # same dtype and shape: the same graph, no recompile
        for bad in (torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4), torch.randn(1, 2, 4)):
            with pytest.raises(RuntimeError, match="recompil"):
                compiled(bad)
    # and a parameter updated in place is read, not baked in
    with torch.no_grad():
        weight.mul_(2)
    torch.testing.assert_close(compiled(x), fn(x))


@pytest.mark.parametrize("name, expected", [("live", True), ("caches[3]", True), ("draft_cache", True),
                                            ("phases.verify.__closure__[2]", False),
                                            ("__import__('torch').utils", False), ("G['torch']", False),
                                            ("", False)])
def test_is_argument(name, expected):
    assert guards._is_argument(name) is expected


def test_only_the_engine_opts_in():
    # The engine's graphs take every per-step value as an argument; other callers (the drafter inside vLLM, whose
    # modules may read per-call state) keep Dynamo's guards.
    assert get_backend("inductor", "cpu").guard_filter is None
    assert get_backend("inductor", "cpu", input_guards_only=True).guard_filter is keep_input_guards
