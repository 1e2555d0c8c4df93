"""Every op of every graph our torchair backend compiles, against torchair's GE converters (torch_npu 2.14.0).

The engine runs on CPU with the real ``TorchairBackend`` over a stand-in torchair whose NPU backend is
torchair's own front half (``ge_audit.torchair_inference_graph``: AOT, its decompositions, its FX passes) and
whose ``cache_compile`` refuses what torchair's refuses; the NPU ops are ``torch.ops.npu.*`` with the wheel's
schemas (``npu_standin``). Graphs: the fused step at K = 1, 2, 3 (greedy, random, logprobs; K = 2 under
``use_cached_graph``), the step-by-step target and draft graphs, prefill and the prompts' draft chain; bf16, block
128, the nope/rope pair; dense and MoE. One traced set serves every test (each engine traces once). Each op with its input dtypes must have a converter that does more than raise, and the
table in ``docs/ge-op-audit.md`` must list exactly what the graphs hold (regenerate:
``ASCEND_SPEC_WRITE_GE_AUDIT=1 pytest tests/test_ge_op_audit.py``).
"""
from __future__ import annotations

import os
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.backends import torchair as torchair_backend
from ascend_spec.graph.backends.ge_audit import (FAILING, ConverterIndex, OpUse, audit, graph_ops,
                                                 torchair_inference_graph)
from ascend_spec.graph.backends.lint import GraphLint
from ascend_spec.models import BUNDLED_DSA_MODEL_DIR
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

from . import npu_standin
from .test_torchair_contract import GE_CONVERTERS, TORCHAIR_PREFIX, _download_wheel

#: every test here builds compiled engines or graphs (make test-fast leaves them out)
pytestmark = pytest.mark.slow

TABLE = Path(__file__).resolve().parents[1] / "docs" / "ge-op-audit.md"
TEXTS = ["def fibonacci(n):\n", "class Stack:\n"]
#: tokens per request: the prompt's, then two steps (enough to run every step graph once after warm-up)
MAX_TOKENS = 3
#: the MoE shape audited: DeepSeek-V3's in miniature (dense layer 0, grouped routing, MoE MTP layer), 2 layers
MOE_PRESET = "moe-e16-k4"


def _wheel() -> Path:
    """The torch_npu wheel (downloaded once, as tests/test_torchair_contract.py does, whichever test asks first)."""
    return _download_wheel()


@pytest.fixture(scope="module")
def wheel_sources():
    import yaml

    with zipfile.ZipFile(_wheel()) as zf:
        converters = {n[len(GE_CONVERTERS):]: zf.read(n).decode() for n in zf.namelist()
                      if n.startswith(GE_CONVERTERS) and n.endswith(".py")}
        # torchair's Tensor-length attention (the draft chain's exact lengths in GE mode) registers its
        # converter beside the op it defines, outside ge_converter/
        air_source = zf.read(npu_standin.AIR_ATTENTION_SOURCE).decode()
        converters[npu_standin.AIR_ATTENTION_SOURCE.removeprefix(TORCHAIR_PREFIX)] = air_source
        decl = yaml.safe_load(zf.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"))
    schemas = {}
    for section in decl.values():
        for entry in section if isinstance(section, list) else ():
            if isinstance(entry, dict) and "func" in entry:
                schemas.setdefault(entry["func"].split("(", 1)[0], entry["func"])
    return ConverterIndex.from_sources(converters), schemas, npu_standin.air_schemas(air_source)


class _Recorder:
    """The stand-in torchair: records each graph under the tag the lint saw last."""

    def __init__(self) -> None:
        self.tags: list[str] = []
        self.graphs: dict[str, set[OpUse]] = {}

    def record(self, gm: torch.fx.GraphModule) -> None:
        self.graphs.setdefault(self.tags[-1], set()).update(graph_ops(gm))

    def torchair(self) -> types.SimpleNamespace:
        backend = torchair_inference_graph(self.record)

        def cache_compile(func, *, config, dynamic):
            if not (isinstance(func, types.MethodType) and isinstance(func.__self__, torch.nn.Module)):
                raise ValueError(f"Only torch.nn.Module method can be cached now, got {func}")
            tag = f"cached:{func.__name__}"
            cached = torchair_inference_graph(lambda gm: self.graphs.setdefault(tag, set()).update(graph_ops(gm)))
            return torch.compile(func, backend=cached, fullgraph=True, dynamic=dynamic)

        config = lambda: types.SimpleNamespace(experimental_config=types.SimpleNamespace())  # noqa: E731
        return types.SimpleNamespace(CompilerConfig=config, get_npu_backend=lambda compiler_config: backend,
                                     inference=types.SimpleNamespace(cache_compile=cache_compile),
                                     patch_for_hcom=lambda: None)


def _config(k: int, fused: bool, cached: bool, prefill: tuple[int, ...]) -> EngineConfig:
    return EngineConfig(max_model_len=256, max_num_seqs=2, block_size=128, kv_layout="pair",
                        speculative=SpeculativeConfig(num_speculative_tokens=k),
                        graph=GraphModeConfig(backend="torchair", graph_batch_sizes=(2,),
                                                  prefill_query_widths=prefill, use_cached_graph=cached),
                        fused_step=fused, adaptive_k=False)


def _run(model_dir: Path, k: int, modes: list[SamplingParams], fused: bool = True, cached: bool = False,
         prefill: tuple[int, ...] = ()) -> None:
    tok = TextTokenizer(model_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    eng = load_engine(model_dir, _config(k, fused, cached, prefill), dtype="bfloat16")
    for params in modes:
        eng.generate(prompts, params, MAX_TOKENS)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    from ascend_spec_tools.tiny_models import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ge_audit_moe") / MOE_PRESET, MOE_PRESET)


@pytest.fixture(scope="module")
def audited(wheel_sources, trained_dir, moe_dir):
    index, schemas, air = wheel_sources
    rec = _Recorder()
    fake_npu = npu_standin.register(schemas, air)
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "torch_npu", fake_npu)
    mp.setattr(torchair_backend, "_import_torchair", rec.torchair)
    check = GraphLint.check
    mp.setattr(GraphLint, "check", lambda self, gm, graph: (rec.tags.append(graph), check(self, gm, graph)))
    greedy, random = SamplingParams(), SamplingParams(temperature=0.8)
    logprobs = SamplingParams(logprobs=2)
    try:
        # Prefill graphs (width 16; the prompts' draft chain at 16 and 1 + K) in two engines, dense and MoE; the
        # others prefill eagerly: the same ops, no graph to trace again.
        _run(trained_dir, 3, [greedy, random, logprobs], prefill=(16,))
        _run(trained_dir, 2, [greedy, random, logprobs], cached=True)
        _run(trained_dir, 1, [greedy])
        _run(trained_dir, 2, [greedy, random], fused=False)
        _run(moe_dir, 2, [greedy], prefill=(16,))
        # the DSA family (GLM-5 shape: a shared-top-k layer, MoE): torch_npu's lightning indexer and sparse
        # flash attention in every graph of its engine
        _run(BUNDLED_DSA_MODEL_DIR, 2, [greedy, random], prefill=(16,))
    finally:
        mp.undo()
        torch._dynamo.reset()
    return rec.graphs, audit(rec.graphs, index)


def _table(graphs: dict[str, set[OpUse]], rows) -> str:
    lines = ["| op | converter | input dtypes | declared dtypes | verdict |", "|---|---|---|---|---|"]
    lines += [f"| `{r.op}` | `{r.converter}` | {r.dtypes} | {r.declared} | {r.verdict} |" for r in rows]
    return "\n".join(lines)


def _summary(graphs: dict[str, set[OpUse]], rows) -> str:
    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    return (f"{len(rows)} rows ({len({r.op for r in rows})} ops) over {len(graphs)} graphs: "
            + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".\n\nGraphs: "
            + ", ".join(f"`{g}`" for g in sorted(graphs)) + ".")


def test_every_op_converts(audited):
    graphs, rows = audited
    assert any(g.startswith("spec_k") for g in graphs) and any(g.startswith("cached:") for g in graphs), sorted(graphs)
    assert {"npu.npu_lightning_indexer.default", "npu.npu_sparse_flash_attention.default"} <= {r.op for r in rows}
    failing = [r for r in rows if r.verdict in FAILING]
    assert not failing, "ops torchair's GE translation stops at:\n" + "\n".join(
        f"  {r.op} ({r.dtypes}): {r.verdict}, in {', '.join(r.graphs[:4])}" for r in failing)


def test_the_table_lists_what_the_graphs_hold(audited):
    graphs, rows = audited
    table = _table(graphs, rows)
    if os.environ.get("ASCEND_SPEC_WRITE_GE_AUDIT"):
        text = TABLE.read_text()
        start, end = text.index("<!-- table -->") + len("<!-- table -->"), text.index("<!-- /table -->")
        text = text[:start] + "\n" + table + "\n" + text[end:]
        start, end = text.index("<!-- summary -->") + len("<!-- summary -->"), text.index("<!-- /summary -->")
        TABLE.write_text(text[:start] + "\n" + _summary(graphs, rows) + "\n" + text[end:])
    documented = TABLE.read_text()
    documented = documented[documented.index("<!-- table -->"):documented.index("<!-- /table -->")]  # its own table
    missing = [line for line in table.splitlines()[2:] if line not in documented]
    assert not missing, "ops not in docs/ge-op-audit.md (review, then regenerate):\n" + "\n".join(missing)
