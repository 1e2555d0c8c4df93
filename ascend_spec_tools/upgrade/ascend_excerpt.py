"""Excerpts of vllm-ascend's sources: what the offline tests read of each supported release.

The files ``compat/ascend.py`` relies on are large (the NPU model runner is ~250 kB); the tests keep, per release,
only what the adapter's checks read: the factory and ``AscendEagleProposer`` verbatim, the base proposer's and the
forward context's signatures (bodies dropped), the runner's methods that touch ``self.drafter`` (and the DP sync
the drafter calls) verbatim, the V2 speculator factory verbatim, its speculator classes' signatures and the platform's class attributes. Module-level
imports are kept so that names resolve as in the release. ``tools/vendor_vllm_ascend.py`` writes them into
``tests/data/vllm_ascend/<tag>/``.
"""
from __future__ import annotations

import ast
from pathlib import Path

#: file -> how it is cut: "verbatim", "signatures" (defs keep signatures, bodies become ``...``),
#: "runner" (class NPUModelRunner, only the methods in RUNNER_KEEP), "class-attrs" (class-level assignments)
EXCERPTS: dict[str, str] = {
    "vllm_ascend/__init__.py": "empty",
    "vllm_ascend/spec_decode/__init__.py": "verbatim",
    "vllm_ascend/spec_decode/eagle_proposer.py": "verbatim",
    "vllm_ascend/spec_decode/llm_base_proposer.py": "signatures",
    "vllm_ascend/ascend_forward_context.py": "signatures",
    "vllm_ascend/worker/__init__.py": "empty",
    "vllm_ascend/worker/model_runner_v1.py": "runner",
    "vllm_ascend/worker/worker.py": "signatures",
    "vllm_ascend/worker/v2/__init__.py": "empty",
    "vllm_ascend/worker/v2/model_runner.py": "runner",
    "vllm_ascend/worker/v2/spec_decode/__init__.py": "verbatim",
    "vllm_ascend/worker/v2/spec_decode/eagle/__init__.py": "verbatim",
    "vllm_ascend/worker/v2/spec_decode/eagle/speculator.py": "signatures",
    "vllm_ascend/worker/v2/spec_decode/autoregressive/__init__.py": "empty",
    "vllm_ascend/worker/v2/spec_decode/autoregressive/speculator.py": "signatures",
    "vllm_ascend/worker/v2/spec_decode/mtp/__init__.py": "empty",
    "vllm_ascend/worker/v2/spec_decode/mtp/speculator.py": "verbatim",
    "vllm_ascend/platform.py": "class-attrs",
    "vllm_ascend/attention/sfa_v1.py": "signatures",
    "vllm_ascend/core/kv_cache_interface.py": "signatures",
}
#: defs kept verbatim in a ``signatures`` excerpt: the DSA seams the tests read (the SFA cache tuple and its block
#: size, the GLM drafter's eager gate, the drafter's share of the target's top-k buffer)
VERBATIM_DEFS: dict[str, tuple[str, ...]] = {
    "vllm_ascend/attention/sfa_v1.py": ("get_kv_cache_shape", "get_supported_kernel_block_sizes",
                                        "_compose_sfa_kv_cache", "kv_cache_indexer_k_idx",
                                        "kv_cache_indexer_scale_idx"),
    "vllm_ascend/spec_decode/llm_base_proposer.py": ("_is_glm_model", "_maybe_share_topk_indices"),
}
RUNNER_CLASS = "NPUModelRunner"
#: runner methods kept verbatim: those touching the drafter or calling its factory (V1), the speculator (V2)
RUNNER_KEEP = {"vllm_ascend/worker/model_runner_v1.py": ("self.drafter", "get_spec_decode_method"),
               "vllm_ascend/worker/v2/model_runner.py": ("init_speculator",)}
#: runner methods kept verbatim by name: the data-parallel sync the drafter calls (V1)
RUNNER_NAMES = {"vllm_ascend/worker/model_runner_v1.py": ("_sync_metadata_across_dp",)}


def _stub(fn: ast.FunctionDef | ast.AsyncFunctionDef, keep: tuple[str, ...] = ()) -> ast.stmt:
    if fn.name not in keep:
        fn.body = [ast.Expr(ast.Constant(...))]
    return fn


def _imports(tree: ast.Module) -> list[ast.stmt]:
    return [st for st in tree.body if isinstance(st, (ast.Import, ast.ImportFrom))]


def excerpt(path: str, source: str) -> str | None:
    """The excerpt of ``path`` (None when the release lacks the file's content, e.g. an empty module)."""
    how = EXCERPTS[path]
    if how == "empty":
        return ""
    if how == "verbatim":
        return source
    tree = ast.parse(source)
    body: list[ast.stmt] = _imports(tree)
    keep = VERBATIM_DEFS.get(path, ())
    for st in tree.body:
        if how == "signatures":
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body.append(_stub(st, keep))
            elif isinstance(st, ast.ClassDef):
                st.body = [_stub(f, keep) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) else f
                           for f in st.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Assign,
                                                              ast.AnnAssign))] or [ast.Pass()]
                body.append(st)
        elif how == "runner" and isinstance(st, ast.ClassDef) and st.name == RUNNER_CLASS:
            keep = RUNNER_NAMES.get(path, ())
            st.body = [f for f in st.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       and (f.name in keep or any(k in ast.unparse(f) for k in RUNNER_KEEP[path]))]
            body.append(st)
        elif how == "class-attrs" and isinstance(st, ast.ClassDef):
            st.body = [f for f in st.body if isinstance(f, (ast.Assign, ast.AnnAssign))] or [ast.Pass()]
            body.append(st)
    return ast.unparse(ast.Module(body=body, type_ignores=[])) + "\n"


def write_excerpts(files: dict[str, str], out: Path, header: str) -> list[str]:
    """Write the excerpts of ``files`` (path -> source) under ``out``; returns the paths written."""
    written = []
    for path in EXCERPTS:
        if path not in files:
            continue
        text = excerpt(path, files[path])
        dest = out / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(f"# {header}: {path} ({EXCERPTS[path]})\n" + (text or ""))
        written.append(path)
    return written
