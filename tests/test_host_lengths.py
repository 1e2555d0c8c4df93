"""Host KV lengths for attention that reads them (torch_npu's fused attention, ``mla_kernels.npu_mla``): every step
function passes them, the draft chain's steps 2..K an upper bound (the verify's length plus the step, as vllm-ascend's
padded drafter), and no step reads the device's. Runs the NPU kernel's composition on CPU through the op's stand-in
(``test_mla_kernels``); the op itself, in bf16 on an NPU, is unverified here."""
from __future__ import annotations

import re
import sys
import types

import pytest
import torch
from torch._dynamo.utils import counters

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.fused_step import make_spec_step
from ascend_spec.graph.backends.eager import EagerBackend
from ascend_spec.graph.backends.torchair import with_host_lengths_dynamic
from ascend_spec.graph.buckets import BatchArg, BucketedGraph
from ascend_spec.graph.mla_kernels import gather_mla, npu_mla
from ascend_spec.graph.paging import HOST_LENGTHS_ARG, HOST_LENGTHS_SOURCES
from ascend_spec.graph.steps import draft_lens_host, make_draft_step, make_prefill_step, make_target_step
from ascend_spec.sampling import GREEDY, SamplingParams
from ascend_spec.sync_counter import suspended
from ascend_spec.tokenizer import TextTokenizer

from .conftest import random_model
from .npu_standin import add_cache_write
from .support import CODE_MAX_TOKENS, CODE_TEXTS
from .test_mla_kernels import _batch, _fused_infer_attention_tnd

TEXTS, MAX_TOKENS = CODE_TEXTS, CODE_MAX_TOKENS


def test_draft_steps_bound_their_lengths_on_the_host():
    assert draft_lens_host((40, 0, 127), 1, 128) == (41, 0, 128)
    assert draft_lens_host((40, 0, 127), 2, 128) == (42, 0, 128)
    assert draft_lens_host(None, 1, 128) is None


def test_a_graph_taking_host_lengths_gets_them_padded_and_refuses_a_call_without():
    seen = []

    def fn(x, lens):
        seen.append(lens)
        return (x + 1,)

    graph = BucketedGraph(EagerBackend(), fn, "t", [2, 4], (BatchArg("x", 0),), host_lengths=True)
    graph([torch.zeros(3)], host_lengths=(5, 6, 7))
    assert seen[-1] in ((5, 6, 7), (5, 6, 7, 0))  # exact-batch backends run 3 rows, per-bucket ones 4
    with pytest.raises(ValueError, match="host_lengths=None; allowed: 3 host ints"):
        graph([torch.zeros(3)])
    plain = BucketedGraph(EagerBackend(), lambda x: (x,), "p", [2], (BatchArg("x", 0),))
    with pytest.raises(ValueError, match="allowed: None"):
        plain([torch.zeros(2)], host_lengths=(1, 2))


def test_every_step_function_takes_the_host_lengths_last_by_the_name_torchair_marks():
    import inspect

    model = random_model()
    steps = [make_target_step(model), make_prefill_step(model), make_draft_step(model, 2, 64),
             make_spec_step(model, 2, 64, GREEDY)]
    assert [list(inspect.signature(f).parameters)[-1] for f in steps] == [HOST_LENGTHS_ARG] * 4
    assert re.fullmatch(HOST_LENGTHS_SOURCES, f"L['{HOST_LENGTHS_ARG}'][3]")


def test_host_lengths_trace_as_symbols_one_graph_for_every_length():
    """What torchair's compile relies on (``with_host_lengths_dynamic``): the lengths, pad rows' 0 included, are
    graph inputs, not constants. Without it each new length compiles again."""

    def step(x, seq_lens_host):
        return x * seq_lens_host[0] + seq_lens_host[1]

    lengths = [(3, 4), (0, 6), (7, 0), (9, 12)]
    for wrap, graphs in ((with_host_lengths_dynamic, 1), (lambda f: f, len(lengths))):
        torch._dynamo.reset()
        counters.clear()
        compiled = wrap(torch.compile(step, backend="eager", dynamic=False, fullgraph=True))
        for lens in lengths:
            assert torch.equal(compiled(torch.ones(2), lens), step(torch.ones(2), lens))
        assert counters["stats"]["unique_graphs"] == graphs


@pytest.fixture
def npu_attention(monkeypatch):
    """The eager engine on the NPU kernel, through the op's stand-in; records each call's query and KV lengths."""
    calls: list[tuple[list[int], list[int]]] = []

    def op(query, key, value, **kwargs):
        calls.append((list(kwargs["actual_seq_lengths"]), list(kwargs["actual_seq_lengths_kv"])))
        with suspended():
            return _fused_infer_attention_tnd(query, key, value, **kwargs)

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = op
    monkeypatch.setitem(sys.modules, "torch_npu", add_cache_write(fake))
    monkeypatch.setattr(EagerBackend, "attention_kernel", "npu")
    return calls


def _config(fused: bool, unpadded: bool = False, max_model_len: int = 256, block_size: int = 128) -> EngineConfig:
    return EngineConfig(max_model_len=max_model_len, max_num_seqs=4, block_size=block_size, kv_layout="pair",
                        speculative=SpeculativeConfig(num_speculative_tokens=3,
                                                      disable_padded_drafter_batch=unpadded),
                        graph=GraphModeConfig(enabled=False, backend="eager", graph_batch_sizes=(1, 2, 4)),
                        fused_step=fused, adaptive_k=False)


@pytest.mark.parametrize("fused, unpadded", [(True, False), (False, False), (True, True)],
                         ids=["fused", "step_by_step", "unpadded"])
@pytest.mark.slow
def test_npu_attention_reads_no_device_length(trained_dir, npu_attention, monkeypatch, fused, unpadded):
    """vllm-ascend's layout (block 128, nope and rope apart), K = 3, 5 requests over 4 slots: prompts, verifies and
    draft chains all hand the op host lengths (0 host syncs), the greedy tokens equal the reference kernel's, and
    the drafts bounded by the verify's length keep ≥ 0.9 of the exact kernel's acceptance."""
    tok = TextTokenizer(trained_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    eng = load_engine(trained_dir, _config(fused, unpadded), count_host_syncs=True)
    assert eng.model.takes_host_lengths
    out, stats, metrics = eng.generate(prompts, SamplingParams(), MAX_TOKENS)
    assert stats.host_syncs == 0, stats.host_sync_events[:5]
    # A draft chain: its first step (a query of several tokens a request), then steps 2..K of one token, each
    # bounded by the first step's length plus the step.
    chains = 0
    for i, (q, kv) in enumerate(npu_attention[:-2]):
        if q[0] > 1 and npu_attention[i + 1][0][0] == 1:
            chains += 1
            for step in (1, 2):
                assert npu_attention[i + step][1] == [n + step if n else 0 for n in kv]
    assert chains >= 10

    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(EagerBackend, "attention_kernel", "gather")
    ref_out, _, ref_metrics = load_engine(trained_dir, _config(fused, unpadded)).generate(
        prompts, SamplingParams(), MAX_TOKENS)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref_out]
    assert metrics.num_accepted_tokens >= 0.9 * ref_metrics.num_accepted_tokens, (metrics.as_dict(), ref_metrics.as_dict())


def test_a_verify_block_reaching_past_max_model_len_keeps_its_real_tokens_exact(npu_attention):
    """max_model_len 48 in blocks of 16 (a 3-column table); a row at 46 verifies 4 tokens: positions 46, 47, then
    two past the end (clamped to 0, inert). Its host length is where the block ends (50, past the table), so the
    op's diagonal puts the two real tokens on their own keys, as the reference sees them; the clamped length (48)
    would hide two keys from each."""
    q_lat, q_pe, cache, inp = _batch([48, 30], 4, width=3)
    positions = torch.tensor([[46, 47, 0, 0], [26, 27, 28, 29]])
    inp = inp._replace(positions=positions)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    got = npu_mla(q_lat, q_pe, cache, inp._replace(seq_lens_host=(50, 30)), 0.1)
    torch.testing.assert_close(got[0, :2], ref[0, :2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    clamped = npu_mla(q_lat, q_pe, cache, inp._replace(seq_lens_host=(48, 30)), 0.1)
    assert not torch.allclose(clamped[0, :2], ref[0, :2], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "step_by_step"])
def test_npu_attention_to_the_end_of_max_model_len(trained_dir, npu_attention, monkeypatch, fused):
    """Every request runs into ``max_model_len`` (48, three blocks of 16): the last verifies' query blocks reach past
    it, and their real tokens still see exactly their own keys (the op aligns each block's diagonal to its last
    key), so the greedy tokens equal the reference kernel's to the last one."""
    tok = TextTokenizer(trained_dir)
    prompts = [tok.encode(t) for t in TEXTS[:4]]
    cfg = _config(fused, max_model_len=48, block_size=16)
    out, stats, _ = load_engine(trained_dir, cfg, count_host_syncs=True).generate(prompts, SamplingParams(), 64)
    assert stats.host_syncs == 0, stats.host_sync_events[:5]
    assert all(len(p) + len(o.token_ids) == 48 for p, o in zip(prompts, out))
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(EagerBackend, "attention_kernel", "gather")
    ref, _, _ = load_engine(trained_dir, cfg).generate(prompts, SamplingParams(), 64)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
