"""Block size and KV layout are data: the serving engines' shapes (FlashMLA's block 64, vllm-ascend's block 128 with
nope and rope caches apart) give the tokens and acceptance counts of the default (block 16, one 576-wide cache)."""
import dataclasses
import types

import pytest
import torch

from ascend_spec.config import ConfigError, EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import dynamo_compile_count, load_engine
from ascend_spec.graph.latent_cache import block_size_of, layout_of
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

from .conftest import generate_without_recompiles
from .support import CODE_MAX_TOKENS, CODE_TEXTS

TEXTS, MAX_TOKENS = CODE_TEXTS, CODE_MAX_TOKENS


@pytest.fixture(scope="module")
def prompts(trained_dir):
    tok = TextTokenizer(trained_dir)
    return [tok.encode(t) for t in TEXTS]


def _config(block_size: int, layout: str, fused: bool = True, compiled: bool = False,
            max_model_len: int = 256) -> EngineConfig:
    # compiled: lone requests pad to two rows (one-row graphs: test_fused_step's lone-request test)
    graph = (GraphModeConfig(backend="inductor", graph_batch_sizes=(2, 4)) if compiled
             else GraphModeConfig(enabled=False, backend="eager", graph_batch_sizes=(1, 2, 4)))
    return EngineConfig(max_model_len=max_model_len, max_num_seqs=4, block_size=block_size, kv_layout=layout,
                        speculative=SpeculativeConfig(num_speculative_tokens=2), graph=graph, fused_step=fused,
                        adaptive_k=False)


@pytest.fixture(scope="module")
def reference(trained_dir, prompts):
    """Block 16, single: the configuration every other test runs."""
    out, stats, metrics = load_engine(trained_dir, _config(16, "single")).generate(prompts, SamplingParams(),
                                                                                   MAX_TOKENS)
    return [o.token_ids for o in out], metrics.as_dict()


@pytest.mark.parametrize("block_size, layout, fused", [(16, "pair", True), (64, "single", True), (128, "pair", True),
                                                       (32, "pair", False), (128, "single", False)])
def test_block_size_and_layout_keep_tokens_and_acceptance(trained_dir, prompts, reference, block_size, layout,
                                                          fused):
    """5 requests over 4 slots (the batch changes composition; blocks grow and are freed and reused), the fused
    one-graph step and the step-by-step path (the proposer drafts on its own): same greedy tokens, same drafts
    accepted, no host sync."""
    eng = load_engine(trained_dir, _config(block_size, layout, fused), count_host_syncs=True)
    assert layout_of(eng.caches.draft) == layout and block_size_of(eng.caches.draft) == block_size
    out, stats, metrics = eng.generate(prompts, SamplingParams(), MAX_TOKENS)
    assert [o.token_ids for o in out] == reference[0]
    assert metrics.as_dict() == reference[1]
    assert stats.host_syncs == 0, stats.host_sync_events[:5]


@pytest.mark.slow
def test_compiled_pair_cache_of_block_64_replays_warm_graphs(trained_dir, prompts, reference):
    """Inductor at block 64 with the nope/rope pair: the reference tokens and counts, no compile after warm-up
    (the table widths warm-up replayed are those the run passes), no host sync."""
    eng = load_engine(trained_dir, _config(64, "pair", compiled=True), count_host_syncs=True)
    eng.warmup(progress=False)
    before = dynamo_compile_count()
    stats, _ = generate_without_recompiles(eng, prompts, MAX_TOKENS)
    assert dynamo_compile_count() == before
    assert stats.host_syncs == 0, stats.host_sync_events[:5]
    out, _, metrics = eng.generate(prompts, SamplingParams(), MAX_TOKENS)
    assert [o.token_ids for o in out] == reference[0]
    assert metrics.as_dict() == reference[1]


@pytest.mark.slow
def test_torchair_shapes_at_vllm_ascends_layout_compile_nothing_after_warm_up(trained_dir, prompts, reference):
    """torchair's shape policy (rehearsed: one graph per bucket, each held to its first shapes) at vllm-ascend's
    block 128 with the nope/rope pair: warm-up makes every key the run replays, at the run's shapes; the reference
    tokens and counts."""
    cfg = dataclasses.replace(_config(128, "pair"), graph=GraphModeConfig(backend="torchair-rehearsal",
                                                                              graph_batch_sizes=(1, 2, 4)))
    eng = load_engine(trained_dir, cfg, count_host_syncs=True)
    eng.warmup(progress=False)
    warmed = dict(eng.backend.recorded)
    out, stats, metrics = eng.generate(prompts, SamplingParams(), MAX_TOKENS)
    assert eng.backend.recorded == warmed and sum(eng.backend.replays.values()) > len(warmed)
    assert [o.token_ids for o in out] == reference[0] and metrics.as_dict() == reference[1]
    assert stats.graph_failures == 0 and stats.host_syncs == 0, stats.host_sync_events[:5]


def test_cuda_marks_every_cache_tensor_static(monkeypatch):
    """A pair cache is two tensors: the vLLM drafter marks both (and a fused cache's one) as static addresses for
    CUDA graphs, the stand-in warm-up compiles against as the bound cache; nothing on CPU. Checked without a GPU:
    the marking is recorded."""
    from ascend_spec.compat.drafter import AscendSpecMtpMixin
    from ascend_spec.graph.latent_cache import allocate_latent_cache

    marked = []
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t: marked.append(t))
    pair = allocate_latent_cache("pair", 4, 128, 512, 64, torch.float32, "cpu")
    fused = allocate_latent_cache("fused", 4, 64, 512, 64, torch.float32, "cpu")
    for device, cache, want in (("cuda", pair, pair), ("cuda", fused, (fused,)), ("cpu", pair, ())):
        marked.clear()
        AscendSpecMtpMixin._mark_static_on_cuda(types.SimpleNamespace(device=device), cache)
        assert len(marked) == len(want) and all(a is b for a, b in zip(marked, want)), (device, marked)


def test_former_layout_name_still_reads():
    assert EngineConfig(kv_layout="fused").kv_layout == "single"


@pytest.mark.parametrize("key, value, allowed", [("block_size", 24, "multiple of 16"),
                                                 ("block_size", 0, "multiple of 16"),
                                                 ("kv_layout", "split", "['single', 'pair']")])
def test_bad_block_size_or_layout_is_one_clear_error(key, value, allowed):
    with pytest.raises(ConfigError, match=rf"{key}={value!r}; allowed: .*{allowed}".replace("[", r"\[")
                       .replace("]", r"\]")):
        dataclasses.replace(EngineConfig(), **{key: value})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size, layout", [(64, "single"), (128, "pair")])
def test_cuda_graphs_at_serving_block_sizes(trained_dir, prompts, block_size, layout):
    """CUDA graphs (FlashMLA's block 64; vllm-ascend's block 128 pair) give the tokens and counts the eager engine
    gives on the GPU at block 16, with every cache tensor at a static address (unmarked, replays write copies)."""
    ref, _, ref_m = load_engine(trained_dir, _config(16, "single"), device="cuda").generate(
        prompts, SamplingParams(), MAX_TOKENS)
    eng = load_engine(trained_dir, _config(block_size, layout, compiled=True), device="cuda")
    assert eng.backend.reuses_outputs
    eng.warmup(progress=False)
    got, stats, m = eng.generate(prompts, SamplingParams(), MAX_TOKENS)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert m.as_dict() == ref_m.as_dict()
    assert stats.recompiles_after_warmup == 0 and stats.graph_failures == 0
