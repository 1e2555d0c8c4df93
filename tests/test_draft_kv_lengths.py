"""The draft chain's KV lengths on the NPU attention op (``torchair_graph_config.draft_kv_lengths``).

Steps 2..K of the chain know their exact lengths on the device only. In GE mode (``max-autotune``) they reach the
op as that tensor, through torchair's Tensor-length registration of it (``torch.ops.air.*``); in npugraph_ex mode
the host passes an upper bound (the verify's length plus the step), under which a draft token also attends the
stale keys of rejected positions. Runs on CPU through the op's stand-in (``npu_standin``, the wheel's schemas) and
torchair's pre-GE steps (``ge_audit``); the op itself on an NPU is unverified here.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from ascend_spec.config import ConfigError, EngineConfig, SpeculativeConfig, TorchairGraphConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.backends import torchair as torchair_backend
from ascend_spec.graph.backends.ge_audit import CONVERTS, UNDECLARED, graph_ops, torchair_inference_graph
from ascend_spec.graph.backends.torchair import resolve_draft_kv_lengths
from ascend_spec.graph.mla_kernels import gather_mla, npu_mla
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

from . import npu_standin
from .test_ge_op_audit import wheel_sources  # noqa: F401  (the fixture)
from .test_mla_kernels import _batch

pytestmark = pytest.mark.slow

AIR_OP = "air.npu_fused_infer_attention_score.default"
TEXTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self",
         "for i in range(10):\n", "    return"]
MAX_TOKENS = [30, 50, 20, 60, 40]


def test_the_setting_defaults_per_mode_and_refuses_what_a_mode_cannot_run():
    assert TorchairGraphConfig().draft_kv_lengths == "auto"
    assert resolve_draft_kv_lengths("auto", "max-autotune") == "exact"
    assert resolve_draft_kv_lengths("auto", "npugraph_ex") == "upper_bound"
    assert resolve_draft_kv_lengths("auto", "reduce-overhead") == "upper_bound"
    assert resolve_draft_kv_lengths("upper_bound", "max-autotune") == "upper_bound"
    with pytest.raises(ConfigError, match=r"torchair_graph_config\.draft_kv_lengths='device'; allowed: "
                                          r"\['auto', 'upper_bound', 'exact'\]"):
        TorchairGraphConfig.from_dict({"draft_kv_lengths": "device"})
    with pytest.raises(ConfigError, match=r"draft_kv_lengths='exact' with mode='npugraph_ex'; allowed there: "
                                          r"\['auto', 'upper_bound'\]"):
        TorchairGraphConfig.from_dict({"mode": "npugraph_ex", "draft_kv_lengths": "exact"})


def test_torchairs_tensor_length_op_takes_device_lengths_in_ge_graphs_only(wheel_sources):  # noqa: F811
    """What ``npu_mla``'s device lengths rely on in the torch_npu 2.14.0 wheel: ``torch.ops.npu``'s schema takes
    the lengths as ``SymInt[]`` only, torchair's ``air`` op of the same arguments as ``Tensor?``; its GE converter
    takes every keyword we pass and is implemented, its CPU and NPU kernels only raise (no eager run, no
    npugraph_ex capture), and npugraph_ex's replay knows the ``npu`` op only."""
    import ast
    import zipfile

    from ascend_spec.graph.mla_kernels import NPU_ATTENTION_KWARGS, NPU_ATTENTION_OP

    from .test_ge_op_audit import _wheel
    from .test_torchair_contract import ACL_GRAPH

    index, schemas, air = wheel_sources
    for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
        assert f"SymInt[]? {name}=" in schemas[NPU_ATTENTION_OP] and f"Tensor? {name}=" in air[NPU_ATTENTION_OP]
    assert index.converters[AIR_OP].implemented
    with zipfile.ZipFile(_wheel()) as zf:
        source = zf.read(npu_standin.AIR_ATTENTION_SOURCE).decode()
        acl_graph = zf.read(ACL_GRAPH).decode()
    tree = ast.parse(source)
    conv = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                and any(f"torch.ops.{AIR_OP}" in ast.unparse(d) for d in f.decorator_list))
    assert set(NPU_ATTENTION_KWARGS) <= {a.arg for a in conv.args.kwonlyargs}
    impl = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                and f.name == "npu_fused_infer_attention_score_impl")
    assert isinstance(impl.body[-1], ast.Raise) and "only support in max-autotune mode" in ast.unparse(impl)
    for key in ('"CPU"', '"PrivateUse1"'):
        assert f'torch.library.impl(lib, "npu_fused_infer_attention_score", {key})' \
               f"(npu_fused_infer_attention_score_impl)" in source, key
    assert f"torch.ops.npu.{NPU_ATTENTION_OP}.default:" in acl_graph and "torch.ops.air." not in acl_graph


@pytest.fixture(scope="module")
def standin(wheel_sources):  # noqa: F811
    """The ``torch_npu`` stand-in with torchair's ``air`` op declared; the converter index."""
    index, schemas, air = wheel_sources
    return npu_standin.register(schemas, air), index


def test_device_lengths_hide_the_stale_keys_the_upper_bound_shows(standin, monkeypatch):
    """One draft token per request, two rejected positions' keys still in the cache past its exact length: the
    compiled graph hands the op the device lengths as a tensor (torchair's op, whose converter is implemented) and
    matches the reference kernel; the host's upper bound, two keys longer, does not."""
    fake_npu, index = standin
    monkeypatch.setitem(sys.modules, "torch_npu", fake_npu)
    q_lat, q_pe, cache, inp = _batch([40, 64, 17], 1, width=6)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    seen: list[torch.fx.GraphModule] = []

    def draft(q_lat, q_pe, kv_c, kv_pe, positions, block_table, seq_lens):
        step = inp._replace(positions=positions, block_table=block_table, seq_lens=seq_lens, seq_lens_host=None,
                            kv_lens_on_device=True)
        return npu_mla(q_lat, q_pe, (kv_c, kv_pe), step, 0.1)

    compiled = torch.compile(draft, backend=torchair_inference_graph(seen.append), fullgraph=True, dynamic=False)
    got = compiled(q_lat, q_pe, *cache, inp.positions, inp.block_table, inp.seq_lens)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    uses = {u for gm in seen for u in graph_ops(gm)}
    air = [u for u in uses if u.op == AIR_OP]
    assert air and all(index.verdict(u)[1] in (CONVERTS, UNDECLARED) for u in air), uses
    assert not any("local_scalar_dense" in u.op or u.op.startswith("npu.") for u in uses), uses

    bound = npu_mla(q_lat, q_pe, cache, inp._replace(seq_lens_host=(42, 66, 19)), 0.1)
    assert not torch.allclose(bound, ref, rtol=1e-3, atol=1e-3)


def _stand_in_torchair() -> types.SimpleNamespace:
    backend = torchair_inference_graph(lambda gm: None)
    config = lambda: types.SimpleNamespace(experimental_config=types.SimpleNamespace())  # noqa: E731
    return types.SimpleNamespace(CompilerConfig=config, get_npu_backend=lambda compiler_config: backend,
                                 patch_for_hcom=lambda: None)


def _config(backend: str, lengths: str = "auto") -> EngineConfig:
    graph = (TorchairGraphConfig(backend="torchair", graph_batch_sizes=(4,), prefill_query_widths=(),
                                 draft_kv_lengths=lengths)
             if backend == "torchair" else TorchairGraphConfig(enabled=False, backend="eager"))
    return EngineConfig(max_model_len=256, max_num_seqs=4, block_size=128, kv_layout="pair",
                        speculative=SpeculativeConfig(num_speculative_tokens=3), graph=graph, adaptive_k=False)


def run_lengths(model_dir, lengths: str, texts=TEXTS, max_tokens=MAX_TOKENS):
    """Greedy tokens and metrics of the engine on torchair (GE mode, ``draft_kv_lengths=lengths``) over the
    stand-ins, or, with ``lengths="reference"``, eagerly on the reference kernel."""
    tok = TextTokenizer(model_dir)
    prompts = [tok.encode(t) for t in texts]
    if lengths == "reference":
        out, stats, metrics = load_engine(model_dir, _config("eager")).generate(prompts, SamplingParams(), max_tokens)
        return [o.token_ids for o in out], metrics, stats
    eng = load_engine(model_dir, _config("torchair", lengths), count_host_syncs=True)
    assert eng.model.takes_host_lengths
    out, stats, metrics = eng.generate(prompts, SamplingParams(), max_tokens)
    return [o.token_ids for o in out], metrics, stats


@pytest.fixture
def ge_engine(standin, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", standin[0])
    monkeypatch.setattr(torchair_backend, "_import_torchair", _stand_in_torchair)
    yield
    torch._dynamo.reset()


def test_exact_device_lengths_draft_what_the_reference_drafts(trained_dir, ge_engine):
    """K = 3, 5 requests over 4 slots, block 128, nope/rope pair: GE mode's default (exact device lengths) gives
    the reference kernel's greedy tokens and its acceptance at every position, count for count, with 0 host
    syncs; the upper bound gives the same tokens (the target verifies with exact lengths) but not the same
    acceptance, as it attends rejected positions' keys."""
    exact_tokens, exact, stats = run_lengths(trained_dir, "auto")
    assert stats.host_syncs == 0, stats.host_sync_events[:5]
    bound_tokens, bound, _ = run_lengths(trained_dir, "upper_bound")
    torch._dynamo.reset()
    ref_tokens, ref, _ = run_lengths(trained_dir, "reference")
    assert exact_tokens == ref_tokens == bound_tokens
    assert exact.num_draft_tokens >= 100 and exact.acceptance_rate > 0.3, exact.as_dict()
    assert (exact.accepted_per_position, exact.drafted_per_position) == (
        ref.accepted_per_position, ref.drafted_per_position), (exact.as_dict(), ref.as_dict())
    assert (bound.accepted_per_position, bound.drafted_per_position) != (
        ref.accepted_per_position, ref.drafted_per_position), (bound.as_dict(), ref.as_dict())
