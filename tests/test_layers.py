"""The layers of docs/design.md, enforced: every import of the package (AST: module level, function level and under
``TYPE_CHECKING`` alike) points down a layer or within one, and no imports form a cycle.

No module is imported: the sources are parsed, so the test needs no vLLM, no NPU and no model.
"""
from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: checkout folder → the package it installs as (pyproject's package-dir); tools/ and examples/ are scripts
SOURCES = {"ascend_spec": "ascend_spec", "graph": "ascend_spec.graph", "compat": "ascend_spec.compat",
           "ascend_spec_tools": "ascend_spec_tools", "tools": "tools", "examples": "examples"}

#: lowest first; a module may import its own layer and the ones below. Every module must match one pattern.
LAYERS: list[tuple[str, list[str]]] = [
    ("graph", ["ascend_spec.graph", "ascend_spec.graph.*"]),
    ("base", ["ascend_spec", "ascend_spec.requests", "ascend_spec.sampling", "ascend_spec.timing",
              "ascend_spec.metrics", "ascend_spec.sync_counter", "ascend_spec.adaptive", "ascend_spec.tokenizer",
              "ascend_spec.config", "ascend_spec.kv_cache", "ascend_spec.spec_decode", "ascend_spec.models",
              "ascend_spec.model_info"]),
    ("graphs", ["ascend_spec.proposer", "ascend_spec.torchair_proposer", "ascend_spec.fused_step",
                "ascend_spec.graphs", "ascend_spec.inputs"]),
    ("parts", ["ascend_spec.k_policy", "ascend_spec.k_schedule", "ascend_spec.runner_parts", "ascend_spec.learnings",
               "ascend_spec.deferred_writes"]),
    ("rooms", ["ascend_spec.warmup", "ascend_spec.chunks", "ascend_spec.step_by_step"]),
    ("runner", ["ascend_spec.runner", "ascend_spec.scheduler"]),
    ("engine", ["ascend_spec.engine"]),
    ("cli", ["ascend_spec.cli"]),
    ("compat", ["ascend_spec.compat", "ascend_spec.compat.*"]),
    ("tools", ["ascend_spec_tools", "ascend_spec_tools.*", "tools.*", "examples.*"]),
]

#: upward edges allowed for now, each with why: none.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
#: cycles allowed for now, as the sets of modules forming them. TEMPORARY, for compat/ only while it is rewritten;
#: empty: compat/ has none today.
ALLOWED_CYCLES: list[frozenset[str]] = []

#: only compat/ and the tools above it may import these
VLLM_PACKAGES = ("vllm", "vllm_ascend")


def discover() -> dict[str, Path]:
    """Module name → source file, for every module of the package and of the scripts above it."""
    mods: dict[str, Path] = {}
    for folder, pkg in SOURCES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            name = ".".join([pkg, *[p for p in parts if p != "__init__"]])
            mods[name] = path
    return mods


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """What ``name`` imports (known modules only, a package's submodule where ``from pkg import sub`` names one;
    external packages by their top-level name), wherever the import statement sits."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            targets = subs if len(subs) == len(node.names) else [mod, *subs]
        else:
            continue
        for target in targets:
            while target and target not in known and "." in target:  # ``import a.b.c`` of a known package a.b
                target = target.rsplit(".", 1)[0]
            if target in known or target.split(".")[0] in VLLM_PACKAGES:
                out.add(target)
    out.discard(name)
    return out


def layer_of(name: str) -> int | None:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return i
    return None


def import_graph() -> dict[str, set[str]]:
    mods = discover()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, dsts in graph.items():
        for dst in dsts:
            if dst.split(".")[0] in VLLM_PACKAGES:
                continue
            s, d = layer_of(src), layer_of(dst)
            if s is not None and d is not None and d > s and (src, dst) not in ALLOWED_UPWARD:
                bad.append(f"{src} ({LAYERS[s][0]}) imports {dst} ({LAYERS[d][0]})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        scc.append(top)
                        if top == node:
                            break
                    if len(scc) > 1:
                        found.append(sorted(scc))
            elif child not in graph:
                continue
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return [c for c in found if frozenset(c) not in ALLOWED_CYCLES]


def test_every_module_has_a_layer():
    assert [m for m in import_graph() if layer_of(m) is None] == []


def test_no_import_points_up_a_layer():
    assert upward_edges(import_graph()) == []


def test_no_imports_form_a_cycle():
    assert cycles(import_graph()) == []


def test_only_compat_and_tools_import_vllm():
    compat = layer_of("ascend_spec.compat")
    assert compat is not None
    bad = [f"{src} imports {dst}" for src, dsts in import_graph().items() for dst in dsts
           if dst.split(".")[0] in VLLM_PACKAGES and (layer_of(src) or 0) < compat]
    assert bad == []


def test_the_runtime_package_holds_no_tools():
    """What every vLLM worker imports (``ascend_spec``, graphs and compat included) never reaches the tools."""
    graph = import_graph()
    runtime = [m for m in graph if m == "ascend_spec" or m.startswith("ascend_spec.")]
    bad = [f"{m} imports {d}" for m in runtime for d in graph[m]
           if d.startswith(("ascend_spec_tools", "tools.", "examples.")) and (m, d) not in ALLOWED_UPWARD]
    assert bad == []


def test_the_checks_catch_an_upward_edge_and_a_cycle():
    """The checks themselves: a planted upward import and a planted cycle are both reported."""
    graph = {"ascend_spec.requests": {"ascend_spec.scheduler"}, "ascend_spec.scheduler": {"ascend_spec.requests"},
             "ascend_spec.graph.model": {"ascend_spec.engine"}, "ascend_spec.engine": set()}
    assert upward_edges(graph) == ["ascend_spec.graph.model (graph) imports ascend_spec.engine (engine)",
                                   "ascend_spec.requests (base) imports ascend_spec.scheduler (runner)"]
    assert cycles(graph) == [["ascend_spec.requests", "ascend_spec.scheduler"]]


def runtime_modules() -> dict[str, Path]:
    """What every vLLM worker may import: ``ascend_spec``, its graphs and compat, not the tools beside it."""
    return {m: p for m, p in discover().items() if m == "ascend_spec" or m.startswith("ascend_spec.")}


def test_every_runtime_module_opens_with_at_most_two_lines():
    """Each runtime module's docstring says what it holds in two lines; the rest goes to docs/modules.md."""
    bad = []
    for path in sorted(runtime_modules().values()):
        doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
        if not doc:
            bad.append(f"{path.relative_to(ROOT)}: no module docstring")
        elif len(doc.splitlines()) > 2:
            bad.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert bad == [], ("module docstrings missing or over two lines (the rest goes to docs/modules.md):\n"
                       + "\n".join(bad))
