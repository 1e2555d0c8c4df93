"""Every op of the graphs our drafter compiles inside vllm-ascend, against torchair's GE converters (torch_npu 2.14.0).

The drafter is built as vllm-ascend's runner builds it: the release's own drafter factory (``main``, through our
import hook; ``vllm_ascend_standin``) returns our adapter, whose ``_build_ascend`` warms every draft graph with the
real ``TorchairBackend`` over the audit's stand-in torchair (``test_ge_op_audit``: torchair's own front half, the
NPU ops with the wheel's schemas), bf16, block 128, the nope/rope pair. Our model is built by the drafter's own
``mtp_model_on_vllm`` on a stand-in of vLLM's loaded ``DeepSeekMTP`` (``vllm_mtp_standin``): vLLM's layers run
inside the graph, with vLLM's ``DeviceCommunicatorBase`` collectives over a fake process group at TP = 2. Dense
at TP 1 and 2, MoE at TP 2, the DSA family (the bundled GLM-5 miniature, on the SFA tuple) at TP 1; each graph is
tagged with its configuration. The table is the second one of
``docs/ge-op-audit.md`` (regenerate: ``ASCEND_SPEC_WRITE_GE_AUDIT=1 pytest tests/test_ge_op_audit_drafter.py``).
"""
from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch

from ascend_spec.graph.backends import torchair as torchair_backend
from ascend_spec.models import BUNDLED_DSA_MODEL_DIR
from ascend_spec.graph.backends.ge_audit import FAILING, audit
from ascend_spec.graph.backends.lint import GraphLint

from . import npu_standin
from . import vllm_ascend_standin as ascend_standin
from . import vllm_mtp_standin
from .test_ge_op_audit import MOE_PRESET, TABLE, _Recorder, _summary, _table, moe_dir, wheel_sources  # noqa: F401

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

K = 2
BLOCK = 128
NUM_BLOCKS = 4
#: (tag, checkpoint, TP size): dense on one rank and two, MoE on two (its one-rank ops are the dense graph's plus
#: the MoE ops, which the TP 2 graph holds too)
CONFIGS = (("dense-tp1", "dense", 1), ("dense-tp2", "dense", 2), ("moe-tp2", "moe", 2), ("dsa-tp1", "dsa", 1))
MARKERS = ("<!-- drafter-summary -->", "<!-- /drafter-summary -->", "<!-- drafter-table -->", "<!-- /drafter-table -->")


def _vllm_config() -> types.SimpleNamespace:
    # no schedule written (vLLM's per-batch-size K field present): a chain per K = 0..K, each audited
    spec = types.SimpleNamespace(method="mtp", num_speculative_tokens=K, draft_sample_method="greedy",
                                 use_step3p5_mtp=lambda: False, num_speculative_tokens_per_batch_size=None)
    extra = {"ascend_spec": {"enabled": True, "graph_failure": "raise"},
             "torchair_graph_config": {"backend": "torchair", "graph_batch_sizes": [2],
                                       "prefill_query_widths": [16]}}
    return types.SimpleNamespace(
        additional_config=extra, speculative_config=spec, use_v2_model_runner=False,
        model_config=types.SimpleNamespace(max_model_len=256, dtype=torch.bfloat16, quantization=None),
        scheduler_config=types.SimpleNamespace(max_num_seqs=2),
        parallel_config=types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0))


def _build_drafter(model_dir: Path, tp: int, group) -> None:
    """vllm-ascend's factory → our adapter; what ``_load_ours`` does after vLLM loaded the MTP layer (its TP size
    read from vLLM's parallel state there), then ``_build_ascend`` on a pair cache (warm-up compiles the graphs)."""
    import vllm_ascend.spec_decode as sd

    from ascend_spec.compat.host_weights import mtp_model_on_vllm
    from ascend_spec.graph.weights import load_model

    ours = load_model(model_dir, dtype="bfloat16", part="mtp")
    cfg = ours.cfg
    d = sd.get_spec_decode_method("mtp", _vllm_config(), "cpu", None)
    d._ascend_tp, d._ascend_block_size = tp, BLOCK
    d._ascend_model = mtp_model_on_vllm(vllm_mtp_standin.deepseek_mtp(ours, tp, 0, group), cfg, tp,
                                        torch.device("cpu"), d._moe_context(), opaque_moe=False)  # as on an NPU
    # vllm-ascend's lm_head and embedding are its own classes: no vocabulary-parallel greedy head, logits gathered
    assert d._ascend_model.greedy_head is None
    d._build_ascend(cfg.layer_cache("pair", NUM_BLOCKS, BLOCK, torch.bfloat16, "cpu"))  # a DSA layer's: the SFA tuple
    assert d.ascend_stats.backend == "torchair" and d.ascend_stats.buckets == [2], d.ascend_stats


@pytest.fixture(scope="module")
def drafter_audited(wheel_sources, trained_dir, moe_dir, tmp_path_factory):  # noqa: F811
    index, schemas, air = wheel_sources
    rec = _Recorder()
    mp = pytest.MonkeyPatch()
    from ascend_spec.compat import ascend, ascend_hook, schedule_k

    ascend_standin.forget()
    ascend_hook.uninstall()
    mp.syspath_prepend(str(ascend_standin.build("main", tmp_path_factory.mktemp("vllm_ascend_main"))))
    mp.setattr(schedule_k, "runner_passes_k", schedule_k.runner_passes_k)  # install sets it
    ascend.install()
    import vllm_ascend.spec_decode  # noqa: F401  (imports vLLM and transformers, which probe for torch_npu)

    mp.setitem(sys.modules, "torch_npu", npu_standin.register(schemas, air))
    mp.setattr(torchair_backend, "_import_torchair", rec.torchair)
    prefix = [""]
    check = GraphLint.check
    mp.setattr(GraphLint, "check", lambda self, gm, graph: (rec.tags.append(prefix[0] + graph),
                                                            check(self, gm, graph)))
    group = None
    try:
        for tag, ckpt, tp in CONFIGS:
            if tp > 1 and group is None:
                group = vllm_mtp_standin.fake_tp_group(tp)
            prefix[0] = f"{tag}:"
            _build_drafter({"dense": trained_dir, "moe": moe_dir, "dsa": BUNDLED_DSA_MODEL_DIR}[ckpt], tp, group)
    finally:
        if group is not None:
            torch.distributed.destroy_process_group()
        ascend_standin.forget()
        ascend_hook.uninstall()
        mp.undo()
        torch._dynamo.reset()
    return rec.graphs, audit(rec.graphs, index)


def test_every_drafter_op_converts(drafter_audited):
    graphs, rows = drafter_audited
    assert {g.split(":")[0] for g in graphs} == {tag for tag, _, _ in CONFIGS}, sorted(graphs)
    tp2 = {r.op for r in rows if any(g.startswith(("dense-tp2", "moe-tp2")) for g in r.graphs)}
    # the TP 2 graphs hold vLLM's collectives (row-parallel all-reduce, the logits' all-gather) and the MoE its ops
    assert {"_c10d_functional.all_reduce.default", "_c10d_functional.all_gather_into_tensor.default"} <= tp2, tp2
    assert any(r.op.startswith("npu.npu_moe_") for r in rows if any(g.startswith("moe") for g in r.graphs))
    failing = [r for r in rows if r.verdict in FAILING]
    assert not failing, "ops torchair's GE translation stops at, in the vLLM drafter's graphs:\n" + "\n".join(
        f"  {r.op} ({r.dtypes}): {r.verdict}, in {', '.join(r.graphs[:4])}" for r in failing)


def _replace(text: str, start: str, end: str, body: str) -> str:
    i, j = text.index(start) + len(start), text.index(end)
    return text[:i] + "\n" + body + "\n" + text[j:]


def test_the_drafter_table_lists_what_its_graphs_hold(drafter_audited):
    graphs, rows = drafter_audited
    table = _table(graphs, rows)
    if os.environ.get("ASCEND_SPEC_WRITE_GE_AUDIT"):
        text = _replace(TABLE.read_text(), MARKERS[2], MARKERS[3], table)
        TABLE.write_text(_replace(text, MARKERS[0], MARKERS[1], _summary(graphs, rows)))
    documented = TABLE.read_text()
    section = documented[documented.index(MARKERS[2]):documented.index(MARKERS[3])]
    missing = [line for line in table.splitlines()[2:] if line not in section]
    assert not missing, "drafter ops not in docs/ge-op-audit.md's second table (review, then regenerate):\n" + \
        "\n".join(missing)
