"""The ops of a graph as torchair's GE translation receives them, checked against torchair's converters.
:func:`torchair_inference_graph` repeats torchair's steps with torch alone; :func:`audit` gives each op its verdict.
"""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

#: verdicts: ``converts`` (implemented, our dtypes among its declared cases or none declared), ``undeclared
#: dtype`` (implemented, a dtype its cases do not list), ``not implemented`` (the converter only raises),
#: ``no converter`` (nothing registered: the compile stops there)
CONVERTS, UNDECLARED, STUB, MISSING = "converts", "undeclared dtype", "not implemented", "no converter"
FAILING = (STUB, MISSING)
#: FX nodes torchair interprets in Python (no GE op): non-arithmetic builtins such as ``operator.getitem``
INTERPRETED = frozenset({"getitem"})
_BINARY = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.floordiv: "floordiv",
           operator.truediv: "truediv", operator.pow: "pow", operator.mod: "mod", operator.neg: "neg"}
_DTYPE_CLASSES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                  "I32": torch.int32, "I16": torch.int16, "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool, "C64": torch.complex64}


def _view_to_reshape(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.target == torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default


def torchair_inference_graph(on_graph: Callable[[torch.fx.GraphModule], None]) -> Callable[..., Any]:
    """A Dynamo backend that calls ``on_graph`` with the aten graph torchair would convert, then runs it."""

    def inference(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.fx_passes.post_grad import remove_noop_ops

        remove_noop_ops(gm.graph)
        _view_to_reshape(gm)
        gm.recompile()
        on_graph(gm)
        return make_boxed_func(gm.forward)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return aot_module_simplified(gm, example_inputs, fw_compiler=inference, inference_compiler=inference,
                                     decompositions={}, keep_inference_input_mutations=True)

    return backend


@dataclass(frozen=True, slots=True)
class OpUse:
    """One op of a graph: its name (``aten.index_put.default``) and its tensor inputs' dtypes by argument."""

    op: str
    dtypes: tuple[tuple[str, str], ...]

    def dtype_text(self) -> str:
        return ", ".join(f"{a}: {d}" for a, d in self.dtypes) or "-"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_dtypes(value: Any) -> list[str]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [_dtype_name(v.meta["val"].dtype) for v in values
            if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)]


def op_name(target: Any) -> str:
    if target in _BINARY:
        return f"operator.{_BINARY[target]}"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return str(target)
    return getattr(target, "__name__", str(target))


def graph_ops(gm: torch.fx.GraphModule) -> set[OpUse]:
    """Every ``call_function`` node of ``gm`` as an :class:`OpUse` (an ``auto_functionalized_v2`` node as the
    mutable op it wraps, which is what torchair converts)."""
    uses = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target, args, kwargs = node.target, node.args, node.kwargs
        if op_name(target) == "auto_functionalized_v2":
            target, args = args[0], ()
        names = [a.name for a in target._schema.arguments] if isinstance(target, torch._ops.OpOverload) else []
        dtypes = []
        for i, arg in enumerate(args):
            dtypes += [(names[i] if i < len(names) else f"#{i}", d) for d in _tensor_dtypes(arg)]
        for name, arg in kwargs.items():
            dtypes += [(name, d) for d in _tensor_dtypes(arg)]
        uses.add(OpUse(op_name(target), tuple(sorted(set(dtypes)))))
    return uses


def _registered_name(call: ast.Call) -> str | None:
    """``torch.ops.aten.add.Tensor`` or ``getattr(torch.ops.aten.add, "Tensor", None)`` → ``aten.add.Tensor``;
    ``operator.add`` → ``operator.add``."""
    arg = call.args[0] if call.args else None
    if isinstance(arg, ast.Call) and ast.unparse(arg.func) == "getattr" and isinstance(arg.args[1], ast.Constant):
        return ast.unparse(arg.args[0]).removeprefix("torch.ops.") + "." + arg.args[1].value
    if isinstance(arg, (ast.Attribute, ast.Name)):
        return ast.unparse(arg).removeprefix("torch.ops.")
    return None


def _only_raises(fn: ast.FunctionDef) -> bool:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _case_dtypes(case: ast.Call, arg_names: list[str]) -> dict[str, str]:
    """The dtype of each tensor argument of one ``Support(...)`` case, by the converter's argument names."""
    found = {}
    pairs = list(zip(arg_names, case.args)) + [(k.arg, k.value) for k in case.keywords if k.arg]
    for name, value in pairs:
        for item in (value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]):
            if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name)):
                continue
            cls = item.func.id
            if cls in _DTYPE_CLASSES:
                found[name] = _dtype_name(_DTYPE_CLASSES[cls])
            elif cls == "T":
                kw = {k.arg: ast.unparse(k.value) for k in item.keywords}
                if "dtype" in kw:
                    found[name] = kw["dtype"].removeprefix("torch.")
    return found


@dataclass
class Converter:
    name: str
    source: str
    implemented: bool
    #: dtypes each tensor argument takes in the declared cases (empty: nothing declared)
    declared: dict[str, set[str]] = field(default_factory=dict)


@dataclass
class ConverterIndex:
    """torchair's GE converters, read from its sources: overload name → :class:`Converter`."""

    converters: dict[str, Converter]

    @classmethod
    def from_sources(cls, sources: dict[str, str]) -> "ConverterIndex":
        converters: dict[str, Converter] = {}
        for path, text in sources.items():
            for fn in ast.walk(ast.parse(text)):
                if not isinstance(fn, ast.FunctionDef):
                    continue
                names, cases = [], []
                for deco in fn.decorator_list:
                    if not isinstance(deco, ast.Call):
                        continue
                    callee = ast.unparse(deco.func)
                    if callee == "register_fx_node_ge_converter":
                        names.append(_registered_name(deco))
                    elif callee == "declare_supported" and deco.args and isinstance(deco.args[0], ast.List):
                        cases = [c for c in deco.args[0].elts if isinstance(c, ast.Call)]
                arg_names = [a.arg for a in fn.args.args + fn.args.kwonlyargs]
                for name in filter(None, names):
                    conv = Converter(name, path, not _only_raises(fn))
                    for case in cases:
                        for arg, dtype in _case_dtypes(case, arg_names).items():
                            conv.declared.setdefault(arg, set()).add(dtype)
                    converters[name] = conv
            # ``register_fx_node_ge_converter(op)(fn)`` as a statement (npu_grouped_matmul's form)
            tree = ast.parse(text)
            fns = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
            for call in ast.walk(tree):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Call)
                        and ast.unparse(call.func.func) == "register_fx_node_ge_converter"
                        and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in fns):
                    name = _registered_name(call.func)
                    if name:
                        converters[name] = Converter(name, path, not _only_raises(fns[call.args[0].id]))
        return cls(converters)

    def verdict(self, use: OpUse) -> tuple[Converter | None, str]:
        if use.op.split(".")[-1] in INTERPRETED or use.op in ("aten.sym_stride.int",
                                                               "aten.sym_storage_offset.default"):
            return None, CONVERTS
        conv = self.converters.get(use.op)
        if conv is None:
            return None, MISSING
        if not conv.implemented:
            return conv, STUB
        if conv.declared and any(arg in conv.declared and d not in conv.declared[arg] for arg, d in use.dtypes):
            return conv, UNDECLARED
        return conv, CONVERTS


@dataclass(frozen=True, slots=True)
class AuditRow:
    op: str
    converter: str
    dtypes: str
    declared: str
    verdict: str
    graphs: tuple[str, ...]


def audit(uses_by_graph: dict[str, set[OpUse]], index: ConverterIndex) -> list[AuditRow]:
    """One row per (op, input dtypes), with the graphs it occurs in, sorted failing first."""
    graphs_of: dict[OpUse, list[str]] = {}
    for graph, uses in uses_by_graph.items():
        for use in uses:
            graphs_of.setdefault(use, []).append(graph)
    rows = []
    for use, graphs in graphs_of.items():
        conv, verdict = index.verdict(use)
        declared = "; ".join(f"{a}: {'/'.join(sorted(d))}" for a, d in sorted(conv.declared.items())) if conv else ""
        rows.append(AuditRow(use.op, conv.source if conv else "-", use.dtype_text(), declared or "-", verdict,
                             tuple(sorted(graphs))))
    order = {MISSING: 0, STUB: 1, UNDECLARED: 2, CONVERTS: 3}
    return sorted(rows, key=lambda r: (order[r.verdict], r.op, r.dtypes))
