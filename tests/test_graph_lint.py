"""The graph lint (``graph.backends.lint``): ops that need the host inside a compiled graph are found before
lowering, with their source line; strict mode refuses the graph, the users' mode counts them.

Most cases hand the captured graph to a backend that does not lower it (the lint runs before lowering either
way); one goes through the inductor backend itself, to prove it is wired in.
"""
import pytest
import torch

from ascend_spec.graph.backends import get_backend
from ascend_spec.graph.backends.lint import GraphHostOpError, GraphLint


def _lint(fn, strict: bool = True, **dynamo):
    lint = GraphLint(strict=strict)
    compiled = torch.compile(fn, fullgraph=True, backend=lint.wrap(lambda gm, _: gm.forward, "probe"))
    torch._dynamo.reset()
    x = torch.arange(6)
    if dynamo:
        with torch._dynamo.config.patch(**dynamo):
            compiled(x)
    else:
        compiled(x)
    return lint


def item(x):
    return x * x.sum().item()


def tolist(x):
    first, *_ = x[:2].tolist()
    return x + first


def host_copy(x):
    return x.cpu() + 1


def nonzero(x):
    return torch.nonzero(x > 2)


def masked(x):
    return x[x > 2] * 2


@torch.compiler.nested_compile_region
def _region(x):
    return x + x.max().item()


def in_region(x):
    return _region(x) * 2


def clean(x):
    return torch.where(x > 2, x, 0).cumsum(0)[torch.tensor([0, 2])] + x.shape[0]


@pytest.mark.parametrize("fn, kind, op, line, dynamo", [
    (item, "scalar output", "item", "x * x.sum().item()", {}),
    (tolist, "scalar output", "item", "x[:2].tolist()", {}),
    (host_copy, "device->host copy", "cpu", "x.cpu() + 1", {}),
    (nonzero, "data-dependent shape", "nonzero", "torch.nonzero(x > 2)", {"capture_dynamic_output_shape_ops": True}),
    (masked, "data-dependent shape", "getitem", "x[x > 2] * 2", {"capture_dynamic_output_shape_ops": True}),
    (in_region, "scalar output", "item", "x + x.max().item()", {}),
], ids=["item", "tolist", "cpu", "nonzero", "bool-mask", "nested-region"])
def test_each_host_op_is_found_with_its_source_line(fn, kind, op, line, dynamo):
    lint = _lint(fn, strict=False, **dynamo)
    assert lint.graphs_checked == 1
    assert lint.findings, "the lint found nothing"
    first = lint.findings[0]
    assert (first.kind, first.op, first.graph) == (kind, op, "probe"), lint.findings
    assert __file__.rsplit("/", 1)[-1] in first.where and line in first.where, first.where


def test_clean_graph_has_no_findings():
    lint = _lint(clean)
    assert lint.graphs_checked == 1 and lint.findings == []


def test_strict_refuses_the_graph_naming_op_and_line():
    with pytest.raises(Exception, match=r"(?s)GraphHostOpError.*scalar output item at .*x \* x.sum\(\).item\(\)"):
        _lint(item)


@pytest.mark.slow
def test_inductor_backend_lints_what_it_compiles():
    strict, lenient = get_backend("inductor", "cpu", graph_failure="raise"), get_backend("inductor", "cpu",
                                                                                          graph_failure="eager")
    x = torch.arange(6)
    with pytest.raises(Exception, match="GraphHostOpError"):
        strict.compile(item, "item_strict")(x)
    assert strict.lint.graphs_checked == 1
    assert torch.equal(lenient.compile(item, "item_eager")(x), item(x))  # compiled, with its sync: counted
    assert [(f.graph, f.op) for f in lenient.lint.findings] == [("item_eager", "item")]
    with pytest.raises(GraphHostOpError):
        strict.lint.check(torch.fx.symbolic_trace(host_copy), "traced")
