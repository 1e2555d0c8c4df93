"""vllm-ascend's V2 runner (compat/ascend_v2.py) against every supported release's own sources, without an NPU.

Per release: its ``init_speculator`` (run as the release wrote it, through the import hook's patch) builds our
adapter over the class it picks for DeepSeek's MTP; the adapter's methods take the arguments of that class's own
(which the V2 runner calls); a ``propose`` with vllm-ascend's signature drafts with ours on the nope/rope cache pair
at block 128 inside vllm-ascend's forward context. See vllm_ascend_standin.py for what runs as written.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import types

import numpy as np
import pytest
import torch

from ascend_spec.compat import ascend_v2
from ascend_spec.compat.shims import CompatError
from ascend_spec.graph.backends.rehearsal import RehearsalBackend

from . import vllm_ascend_standin as standin
from .test_vllm_ascend_route import release, vllm_config  # noqa: F401 - the per-release fixture

#: the class each release's init_speculator builds for mtp, and where its V2 methods are defined
MTP_CLASS = {"v0.23.0": ("AscendEagleSpeculator", "eagle"), "v0.24.0rc1": ("AscendEagleSpeculator", "eagle"),
             "v0.25.1rc1": ("AscendMTPSpeculator", "autoregressive"), "main": ("AscendMTPSpeculator", "autoregressive")}


def v2_config(enabled: bool | None = True, k: int = 2, step3p5: bool = False) -> types.SimpleNamespace:
    cfg = vllm_config(enabled, k=k, step3p5=step3p5, v2=True)
    spec = cfg.speculative_config
    for probe in ("use_dspark", "use_dflash", "use_gemma4_mtp"):
        setattr(spec, probe, lambda: False)
    spec.use_eagle = lambda: spec.method in ("eagle", "eagle3", "mtp")
    cfg.model_config.quantization = None
    return cfg


def init_speculator(tag: str):
    mod = "vllm_ascend.worker.v2.spec_decode" + (".eagle" if tag == "v0.23.0" else "")
    return importlib.import_module(mod).init_speculator


def their_method(tag: str, name: str) -> ast.FunctionDef:
    """``name`` as the release defines it on the class its MTP speculator inherits it from."""
    cls, sub = MTP_CLASS[tag]
    holder = "AscendEagleSpeculator" if sub == "eagle" else "AscendAutoRegressiveSpeculator"
    tree = ast.parse(standin.excerpt(tag, f"vllm_ascend/worker/v2/spec_decode/{sub}/speculator.py"))
    (c,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == holder]
    (f,) = [f for f in c.body if isinstance(f, ast.FunctionDef) and f.name == name]
    return f


def test_init_speculator_builds_our_adapter_over_the_releases_mtp_speculator(release):
    ours = init_speculator(release)(v2_config(True), "cpu")
    name, _ = MTP_CLASS[release]
    base = type(ours).vllm_base
    assert base.__name__ == name and isinstance(ours, base) and type(ours) is not base
    assert type(ours).__ascend_spec_adapter__ and ours.ascend_enabled and ours._ascend_kv_layout == "pair"
    import vllm_ascend.worker.v2.model_runner as v2_runner  # binds init_speculator by name

    assert v2_runner.init_speculator is init_speculator(release)
    for cfg in (v2_config(None), v2_config(False)):
        assert type(init_speculator(release)(cfg, "cpu")) is base, cfg.additional_config
    other = init_speculator(release)(v2_config(True, step3p5=True), "cpu")  # Step-3.5's MTP: theirs as it picks
    assert not getattr(type(other), "__ascend_spec_adapter__", False) and type(other).__module__.startswith("vllm_as")


def test_a_v2_speculator_class_we_do_not_adapt_is_one_error(release):
    other = type("AscendDSparkSpeculator", (), {"__module__": "vllm_ascend.worker.v2.spec_decode.dspark.speculator"})
    with pytest.raises(CompatError, match=r"AscendDSparkSpeculator.*VLLM_USE_V2_MODEL_RUNNER=0.*enabled: false"):
        ascend_v2.adapter_for(other)


def test_our_methods_take_every_call_their_speculator_takes(release):
    """The V2 runner calls the speculator as vllm-ascend's class defines it: each of that def's parameters binds
    to the same parameter of ours, positionally (propose's dummy_run is its 14th argument) and by keyword."""
    cls = type(init_speculator(release)(v2_config(True), "cpu"))
    for name in ("propose", "set_attn", "capture", "init_cudagraph_manager", "__init__"):
        try:
            fn = their_method(release, name)
        except ValueError:
            assert name in ("capture",) and release == "v0.23.0"  # inherited from vLLM's EagleSpeculator there
            continue
        theirs = [a.arg for a in fn.args.args][1:]
        sig = inspect.signature(getattr(cls, name))
        marks = [object() for _ in theirs]
        bound = sig.bind(None, *marks).arguments
        for p, m in zip(theirs, marks):
            assert bound.get(p) is m or any(m in v for v in bound.values() if isinstance(v, tuple)), \
                f"{release}: {name} positional {p!r} lands elsewhere in ours {sig}"
        kw = sig.bind(None, **dict(zip(theirs, marks))).arguments
        assert all(kw.get(p) is m or kw.get("kwargs", {}).get(p) is m for p, m in zip(theirs, marks)), (name, sig)
    assert ascend_v2.probe_ascend_v2_api(cls.vllm_base) == []


def input_batch(k: int, seq_lens: list[int]) -> types.SimpleNamespace:
    """V2's InputBatch of two requests verifying 1 + K tokens each (positions seq_len - 1 - K .. seq_len - 1)."""
    b, q = len(seq_lens), 1 + k
    pos = torch.cat([torch.arange(s - q, s) for s in seq_lens])
    return types.SimpleNamespace(
        num_reqs=b, num_scheduled_tokens=np.full(b, q), query_start_loc=torch.arange(0, b * q + 1, q),
        idx_mapping=torch.arange(b), positions=pos, input_ids=torch.arange(b * q) + 5,
        seq_lens=torch.tensor(seq_lens), seq_lens_cpu_upper_bound=torch.tensor(seq_lens))


def test_propose_drafts_with_ours_on_the_pair_cache_at_block_128(release, trained_dir, monkeypatch):
    """Through the release's init_speculator: set_attn finds the draft layer's group (block 128) and builds ours on
    a pair stand-in; propose (vllm-ascend's arguments, positionally) binds vllm-ascend's nope/rope tensors, drafts
    inside its forward context, and equals the eager proposer on the same inputs."""
    import vllm_ascend.ascend_forward_context as fc

    from ascend_spec.compat import draft_core
    from ascend_spec.config import SpeculativeConfig
    from ascend_spec.graph.weights import load_model
    from ascend_spec.proposer import MtpProposer

    backend = RehearsalBackend("raise")
    monkeypatch.setattr(draft_core, "get_backend", lambda *a, **kw: backend)
    model = load_model(trained_dir)
    cfg, k, block, nblocks = model.cfg, 2, 128, 8
    layer = f"model.layers.{cfg.num_hidden_layers}.self_attn.attn"
    d = init_speculator(release)(v2_config(True, k=k), "cpu")
    d._ascend_model, d.draft_attn_layer_names = model, {layer}
    group = types.SimpleNamespace(layer_names=[layer], kv_cache_spec=types.SimpleNamespace(block_size=block))
    kv_cfg = types.SimpleNamespace(kv_cache_groups=[group], num_blocks=nblocks)
    tables = types.SimpleNamespace(input_block_tables=[torch.tensor([[3, 0], [5, 0]], dtype=torch.int32)],
                                   slot_mappings=[torch.tensor([3] * 3 + [5] * 3) * block])
    extra = [object()] * (len(their_method(release, "set_attn").args.args) - 4)  # main: target buffers, groups
    d.set_attn("model-state", kv_cfg, tables, *extra)
    assert d._block_size == block and d._ascend.draft_cache[0].shape == (nblocks, block, cfg.kv_lora_rank)
    g = torch.Generator().manual_seed(0)
    nope = torch.randn(nblocks, block, 1, cfg.kv_lora_rank, generator=g) * 0.1
    rope = torch.randn(nblocks, block, 1, cfg.qk_rope_head_dim, generator=g) * 0.1
    d.vllm_config.compilation_config = types.SimpleNamespace(static_forward_context={
        layer: types.SimpleNamespace(kv_cache=(nope, rope))})
    batch = input_batch(k, [13, 23])
    batch.input_ids = torch.randint(1, cfg.vocab_size, (6,), generator=g)
    hidden = torch.randn(6, cfg.hidden_size, generator=g)
    slots = {layer: torch.tensor([3] * 3 + [5] * 3) * block + batch.positions}
    last = torch.tensor([[41], [42]])
    seen = []
    propose = d._ascend.propose
    d._ascend.propose = lambda inputs, return_logits=False: seen.append(inputs) or propose(inputs, return_logits)
    reference = (nope.squeeze(2).clone(), rope.squeeze(2).clone())
    fc.CALLS.clear()
    out = d.propose(batch, {}, slots, hidden, None, torch.tensor([1, 3]), torch.tensor([1, 0]), last,
                    torch.zeros(4, dtype=torch.long), torch.zeros(4), torch.zeros(4), None, False, False, None, False)
    assert d.ascend_stats.graph_calls == 1 and d.ascend_stats.fallback_calls == 0
    assert d._ascend.draft_cache[0].data_ptr() == nope.data_ptr()  # vllm-ascend's tensors, written in place
    (x,) = seen
    assert x.target_slot_mapping.tolist() == slots[layer].view(2, 3).tolist()
    assert x.token_indices_to_sample.tolist() == [1, 2] and x.next_token_ids.tolist() == [41, 42]
    assert x.seq_lens_host is None and x.seq_lens.tolist() == [13, 23]  # the reference kernel: device lengths
    (name, args), = fc.CALLS
    assert args["num_tokens"] == d._ascend.graph.tokens_for(2, 1 + k) and args["is_draft_model"] is True
    eager = MtpProposer(model, SpeculativeConfig(num_speculative_tokens=k), 64, reference)
    assert torch.equal(out, eager.propose(x))


def test_what_ours_cannot_draft_goes_to_vllm_ascends_propose_with_its_arguments(release):
    d = init_speculator(release)(v2_config(True), "cpu")
    d._ascend = object()  # built (the fallback never touches it)
    d._ascend_chains = {d._draft_k: d._ascend}
    batch = input_batch(2, [13, 23])
    mod = importlib.import_module(type(d).vllm_base.__module__ if MTP_CLASS[release][1] == "eagle" else
                                  "vllm_ascend.worker.v2.spec_decode.autoregressive.speculator")
    mod.CALLS.clear()
    across = torch.tensor([6, 6])
    d.ascend_stats.dp_size = 2
    out = d.propose(batch, {}, {}, torch.zeros(6, 4), None, *[torch.zeros(2)] * 3, torch.zeros(4), torch.zeros(4),
                    torch.zeros(4), mm_inputs=("mm", None), num_tokens_across_dp=across, dummy_run=False)
    assert out == ("vllm-ascend", "propose")
    (name, args), = [c for c in mod.CALLS if c[0] == "propose"]
    assert args["num_tokens_across_dp"] is across and args["mm_inputs"] == ("mm", None)
    # under data parallel without the runner's counts, vllm-ascend's agrees them: it drafts
    d.propose(batch, {}, {}, torch.zeros(6, 4), None, *[torch.zeros(2)] * 3, torch.zeros(4), torch.zeros(4),
              torch.zeros(4))
    assert d.ascend_stats.fallbacks_by_reason == {"multimodal": 1, "dp_unsynced": 1}
