"""Which model runner a release builds for an MTP engine, which seam each runner builds its drafter from, and whether
our shims cover that seam: a release whose default runner bypasses our seam is BROKEN whatever its items say.

Read statically: ``VllmConfig.use_v2_model_runner`` (V2 by default when its last statement returns True), the method
names ``_get_v2_model_runner_unsupported_features`` sends back to V1, and the readings of the two seam items.
"""
from __future__ import annotations

import ast
import dataclasses

from .common import M
from .reader import Reader
from .source_tree import SourceTree

CONFIG_MODULE = "vllm.config.vllm"
V2_MODULE = "vllm.v1.worker.gpu.model_runner"
MTP_METHODS = ("mtp", "deepseek_mtp")
#: the manifest item of each runner's drafter seam
SEAMS = {"v1": "gpu_model_runner.EagleProposer", "v2": "v2_model_runner.init_speculator"}
V2_CONDITION = "unless VLLM_USE_V2_MODEL_RUNNER=0, Triton is missing, or a feature V2 lacks is asked for"


@dataclasses.dataclass
class RunnerReading:
    default: str  # the runner an MTP engine gets without VLLM_USE_V2_MODEL_RUNNER: "v1" | "v2"
    condition: str
    seams: dict[str, str]  # runner -> verdict text of its seam ("absent" where the runner does not exist)
    broken: bool

    def cell(self) -> str:
        seams = "; ".join(f"{r.upper()}: {v}" for r, v in self.seams.items())
        head = "**BROKEN**: " if self.broken else ""
        return f"{head}default {self.default.upper()} ({self.condition}); {seams}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _method(tree: SourceTree, module: str, cls: str, name: str) -> ast.FunctionDef | None:
    mod = tree.module_ast(module)
    for node in (mod.body if mod is not None else []):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == name:
                    return fn
    return None


def _unsupported_methods(fn: ast.FunctionDef | None) -> set[str]:
    """String constants in ``<x>.method in (...)`` / ``== "..."`` tests of the unsupported-features list."""
    out: set[str] = set()
    for node in ast.walk(fn) if fn is not None else []:
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "method":
            for comp in node.comparators:
                elts = comp.elts if isinstance(comp, (ast.Tuple, ast.List, ast.Set)) else [comp]
                out |= {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


def default_runner(tree: SourceTree) -> tuple[str, str]:
    """``(runner, condition)`` an MTP engine of this release gets by default."""
    if tree.module_file(V2_MODULE) is None:
        return "v1", "the only runner"
    prop = _method(tree, CONFIG_MODULE, "VllmConfig", "use_v2_model_runner")
    last = prop.body[-1] if prop is not None and prop.body else None
    v2_default = isinstance(last, ast.Return) and isinstance(last.value, ast.Constant) and last.value.value is True
    if not v2_default:
        return "v1", "V2 only with VLLM_USE_V2_MODEL_RUNNER=1"
    refused = _unsupported_methods(_method(tree, CONFIG_MODULE, "VllmConfig",
                                           "_get_v2_model_runner_unsupported_features")) & set(MTP_METHODS)
    if refused:
        return "v1", f"V2 refuses speculative method {sorted(refused)}"
    return "v2", V2_CONDITION


def read_runners(manifest, tree: SourceTree, reference: SourceTree) -> RunnerReading:
    """The runner verdict of ``tree``, each seam item judged against ``reference`` (the release compat targets)."""
    default, condition = default_runner(tree)
    items = {it.id: it for it in manifest.items}
    now, ref = Reader(tree), Reader(reference)
    seams: dict[str, str] = {}
    broken = False
    for runner, item_id in SEAMS.items():
        it = items[item_id]
        after = now.read(it).fp
        if runner == "v2" and tree.module_file(V2_MODULE) is None:
            seams[runner] = "absent"
            continue
        v = M.verdict(manifest, it, ref.read(it).fp, after)
        reached = not v.broken and after.get("found", False)
        seams[runner] = f"{item_id} {'reached' if reached else 'BYPASSED'} ({v.text})"
        broken |= runner == default and not reached
    return RunnerReading(default, condition, seams, broken)


V2_ONLY_SHIM = "v2_runner_absent"


def apply_runner_verdict(manifest, rows: list, runners: RunnerReading, tree: SourceTree) -> list:
    """The V2 items judged by the runner: absence is fine only where the release has no V2 runner; where V1 is the
    MTP default a V2 item's drift breaks nothing an MTP engine builds by default (an engine forced onto V2 there is
    refused at start by the adapter's probe), so those rows say that instead of BROKEN."""
    v2_items = {it.id for it in manifest.items if V2_ONLY_SHIM in it.shims}
    has_v2 = tree.module_file(V2_MODULE) is not None
    for r in rows:
        if r.id not in v2_items:
            continue
        if has_v2 and r.verdict.shim == V2_ONLY_SHIM:
            r.verdict = dataclasses.replace(r.verdict, text="absent although the V2 runner exists", shim=None,
                                            broken=True)
        if r.verdict.broken and runners.default != "v2":
            r.verdict = dataclasses.replace(r.verdict, text="V2 not the MTP default here (probe refuses it at start)",
                                            broken=False)
    return rows
