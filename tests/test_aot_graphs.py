"""Graphs saved whole and loaded without tracing (graph.backends.aot_graphs): a warm start runs no Dynamo trace,
replays the same tokens, reads the weights of the model it serves, and a bad entry or a call its guards reject
compiles instead of crashing or running the wrong graph."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ascend_spec.config import GraphModeConfig
from ascend_spec.engine import Engine, dynamo_compile_count
from ascend_spec.fused_step import make_spec_step
from ascend_spec.graph.backends.aot_graphs import GraphStore, aot_available, closure_fingerprint
from ascend_spec.graph.backends.base import DynamicDims, clone_with_name
from ascend_spec.graph.backends.compile_cache import CacheKey, CompileCache
from ascend_spec.graph.backends.inductor import InductorBackend
from ascend_spec.graph.steps import make_draft_step
from ascend_spec.graph.weights import load_model
from ascend_spec.sampling import SamplingParams

from .conftest import inductor_config, random_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not aot_available(), reason="this torch has no AOT compilation"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

PROMPTS = [[5, 9, 17, 3, 22, 8], [40, 2, 11], [7, 7, 30, 1, 19]]


def _affine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w + 1


def _store(root: Path) -> GraphStore:
    key = CacheKey(what="graphs", model_config={"unit": 1}, backend="inductor")
    return GraphStore(CompileCache(root), key, external={})


def _graph(store: GraphStore):
    backend = InductorBackend(torch.device("cpu"), input_guards_only=True, graph_failure="raise")
    backend.store = store
    return backend.compile(clone_with_name(_affine, "unit_affine"), "unit_affine", DynamicDims(batch=(0,)))


def test_before_compile_runs_before_each_trace_and_never_on_a_load(tmp_path: Path) -> None:
    """The vLLM drafter frees vLLM's reference cycles there (a full collection): a warm start, which loads every
    graph, pays nothing for it; a start that traces runs it first."""
    calls: list[int] = []
    store = _store(tmp_path)
    store.before_compile = lambda: calls.append(dynamo_compile_count())
    graph = _graph(store)
    w = torch.randn(3, 4)
    compiles = dynamo_compile_count()
    graph(torch.randn(2, 3), w)
    assert calls == [compiles]  # before the trace: Dynamo had not counted it yet
    graph(torch.randn(5, 3), w)  # the same variant serves it
    assert len(calls) == 1
    fresh = _store(tmp_path)
    fresh.before_compile = lambda: calls.append(-1)
    _graph(fresh)(torch.randn(4, 3), w)
    assert (fresh.loaded, fresh.compiled, len(calls)) == (1, 0, 1)


def test_a_variant_serves_what_its_guards_accept_and_loads_in_a_new_store(tmp_path: Path, caplog) -> None:
    store = _store(tmp_path)
    graph = _graph(store)
    w = torch.randn(3, 4)
    compiles = dynamo_compile_count()
    for rows in (2, 5, 9):  # one dynamic-batch variant serves every batch of two rows or more
        x = torch.randn(rows, 3)
        torch.testing.assert_close(graph(x, w), _affine(x, w))
    assert store.compiled == 1 and dynamo_compile_count() == compiles + 1  # a variant counts once, as a compile
    # a dtype its guards reject never reaches that variant: a second one compiles ...
    xd, wd = torch.randn(4, 3, dtype=torch.float64), w.double()
    torch.testing.assert_close(graph(xd, wd), _affine(xd, wd))
    assert store.compiled == 2
    # ... unless the stance forbids compiling once a variant exists, as Dynamo's does
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match="fail_on_recompile"):
        graph(torch.randn(4, 3, 2), w)

    [entry] = CompileCache(tmp_path).entries()  # what `ascend-spec cache info` lists
    assert (entry.what, entry.variants, entry.problem) == ("graph.unit_affine", 2, None)

    fresh = _store(tmp_path)  # another process's view: both variants load, neither compiles
    before = dynamo_compile_count()
    reloaded = _graph(fresh)
    x = torch.randn(6, 3)
    torch.testing.assert_close(reloaded(x, w), _affine(x, w))
    torch.testing.assert_close(reloaded(xd, wd), _affine(xd, wd))
    assert (fresh.loaded, fresh.compiled) == (2, 0)
    assert dynamo_compile_count() == before
    # a call no stored variant accepts compiles one more, with one warning (a guard failure, not a crash)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            xh, wh = torch.randn(4, 3, dtype=torch.float16), torch.randn(3, 4, dtype=torch.float16)
            torch.testing.assert_close(reloaded(xh, wh), _affine(xh, wh))
    assert fresh.compiled == 1
    assert [r.getMessage() for r in caplog.records].count(
        "saved graph unit_affine: no stored variant accepts these arguments (a shape or dtype it was not compiled "
        "for); compiling one and adding it to the cache") == 1


def test_graph_functions_of_other_settings_never_share_a_key() -> None:
    """A K = 0 step that returns the hidden states (an engine that drafts at other K) and one that does not (no
    speculation) have the same tag and model: what they close over tells them apart, and nothing else does."""
    fp = closure_fingerprint
    step = functools.partial(make_spec_step, max_model_len=128, mode="greedy")
    a, b = random_model(), random_model(seed=1)
    assert fp(step(a, 0, keep_hidden=True)) == fp(step(b, 0, keep_hidden=True))  # stable; weights are not settings
    assert fp(step(a, 0, keep_hidden=True)) != fp(step(a, 0, keep_hidden=False))
    assert fp(step(a, 1)) != fp(step(a, 2))
    assert fp(step(a, 2, unpadded=True)) != fp(step(a, 2))


def test_max_model_len_keys_no_graph_and_the_unpadded_layout_only_the_fused_step(tmp_path, monkeypatch):
    """max_model_len is data (the ``max_len`` input): no graph closes over it where attention reads no host
    lengths, and no key holds it, so an engine at another max_model_len loads every graph another one saved. The
    fused step closes over the unpadded drafter layout: the store's key leaves that to the fingerprints, so an
    engine with the unpadded layout loads the prompt, target and draft graphs of a padded one."""
    fp, a = closure_fingerprint, random_model()
    for k in (0, 2):
        assert fp(make_spec_step(a, k, 128, "greedy")) == fp(make_spec_step(a, k, 4400, "greedy"))
    assert fp(make_draft_step(a, 2, 128)) == fp(make_draft_step(a, 2, 4400))
    monkeypatch.setenv("ASCEND_SPEC_CACHE_DIR", str(tmp_path))
    cfg = inductor_config(2)
    other = dataclasses.replace(cfg, max_model_len=256, speculative=dataclasses.replace(
        cfg.speculative, disable_padded_drafter_batch=True))
    first, second = (Engine(a, c).runner.graphs for c in (cfg, other))
    assert first.store.base_key == second.store.base_key
    assert first.cache_key("graphs") != second.cache_key("graphs")  # a whole-warm-up entry (no closures) keeps it


def test_a_graph_saved_in_one_process_loads_in_another(tmp_path: Path) -> None:
    """What a warm start is: another process loads the graph (vLLM turned its AOT start off on CPU after such a
    load crashed with torch 2.10, vllm-project/vllm#32033)."""
    graph = _graph(_store(tmp_path))
    graph(torch.ones(2, 3), torch.ones(3, 4))
    code = textwrap.dedent(f"""
        from pathlib import Path
        import torch
        from tests.test_aot_graphs import _affine, _graph, _store
        store = _store(Path({str(tmp_path)!r}))
        x, w = torch.arange(12.0).view(4, 3), torch.randn(3, 4)
        assert torch.equal(_graph(store)(x, w), _affine(x, w))
        print(store.loaded, store.compiled)
    """)
    # an empty inductor working cache too: a saved graph carries what it needs (a cleared /tmp loses nothing)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "another-inductor-dir")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                         cwd=Path(__file__).resolve().parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["1", "0"], run.stdout


def test_a_graph_another_process_is_compiling_is_waited_for_and_loaded(tmp_path: Path) -> None:
    """Data-parallel ranks (and engines side by side) on one host need the same graphs at once: while one holds the
    compile cache's lock on a graph, another that finds it missing waits, then loads what the first saved."""
    import shutil
    import threading

    w, x = torch.randn(3, 4), torch.randn(5, 3)
    first = _store(tmp_path / "first")
    compiled = _graph(first)
    compiled(x, w)
    [entry] = first.cache.entries()
    waiter = _store(tmp_path / "waiter")
    results: list[torch.Tensor] = []
    with waiter.cache.compiling(compiled.key):
        thread = threading.Thread(target=lambda: results.append(_graph(waiter)(x, w)))
        thread.start()
        thread.join(timeout=2)  # it finds no entry and waits on the lock held here
        assert thread.is_alive() and not results
        shutil.copy(entry.path, waiter.cache.root / entry.path.name)  # what the holder saves before releasing
    thread.join(timeout=300)
    torch.testing.assert_close(results[0], _affine(x, w))
    assert (waiter.loaded, waiter.compiled) == (1, 0)


@pytest.fixture(scope="module")
def warm_store(trained_dir: Path):
    """An engine's start on the suite's store (cache folder, greedy outputs, its store): it compiles what no engine
    saved before it, and loads what the other modules' engines of this config saved (test_fused_step,
    test_graph_mode), as a second start of a user's would. A first start into an empty store: test_deferred_graphs
    (an engine's, into a store of its own) and this module's store tests on small graphs."""
    root = CompileCache().root
    eng = Engine(load_model(trained_dir), inductor_config(2))
    eng.warmup(progress=False)
    outs, _, metrics = eng.generate(PROMPTS, SamplingParams(), 24)
    return root, [o.token_ids for o in outs], metrics, eng.runner.graphs.store


def _engine(root: Path, model, monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setenv("ASCEND_SPEC_CACHE_DIR", str(root))
    return Engine(model, inductor_config(2))


def test_warm_start_loads_every_graph_and_traces_none(warm_store, trained_dir, monkeypatch) -> None:
    root, tokens, metrics, first = warm_store
    assert first is not None and first.compiled + first.loaded > 0
    eng = _engine(root, load_model(trained_dir), monkeypatch)
    before = dynamo_compile_count()
    report = eng.warmup(progress=False)
    outs, warm_stats, warm_metrics = eng.generate(PROMPTS, SamplingParams(), 24)
    store = eng.runner.graphs.store
    assert (store.loaded, store.compiled) == (first.compiled + first.loaded, 0)
    assert dynamo_compile_count() == before and report.cache_hit is True
    assert [o.token_ids for o in outs] == tokens
    assert warm_metrics.num_accepted_tokens == metrics.num_accepted_tokens > 0
    assert warm_stats.recompiles_after_warmup == 0


def test_loaded_graphs_read_the_weights_of_the_model_they_serve(warm_store, trained_dir, monkeypatch) -> None:
    root, tokens, _, _ = warm_store
    model = load_model(trained_dir)
    with torch.no_grad():
        model.lm_head.weight.neg_()  # same shapes, other weights: the loaded graphs must read these
    eng = _engine(root, model, monkeypatch)
    eng.warmup(progress=False)
    assert eng.runner.graphs.store.compiled == 0
    outs, _, _ = eng.generate(PROMPTS, SamplingParams(), 24)

    # the same model on the eager reference (greedy tokens equal across backends: test_graph_mode)
    ref = Engine(model, dataclasses.replace(inductor_config(2), graph=GraphModeConfig(
        enabled=False, backend="eager", graph_batch_sizes=(1, 2, 4))))
    ref_outs, _, _ = ref.generate(PROMPTS, SamplingParams(), 24)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs] != tokens


def test_a_corrupt_graph_entry_warns_is_removed_and_compiles(warm_store, trained_dir, monkeypatch, caplog,
                                                            tmp_path) -> None:
    """On a copy of the store (the suite's is shared by both test workers), the fused step's entries corrupted:
    the one this engine reads warns once, is removed, compiled and written again; the other graphs load."""
    shared, tokens, _, first = warm_store
    root = tmp_path / "store"
    root.mkdir()
    for e in CompileCache(shared).entries():
        with contextlib.suppress(FileNotFoundError):  # replaced meanwhile by the other worker's engine
            shutil.copy(e.path, root / e.path.name)
    corrupted = [e.path for e in CompileCache(root).entries() if e.what == "graph.spec_k2_greedy"]
    for path in corrupted:
        blob = bytearray(path.read_bytes())
        blob[-100] ^= 0xFF
        path.write_bytes(bytes(blob))
    eng = _engine(root, load_model(trained_dir), monkeypatch)
    with caplog.at_level(logging.WARNING):
        eng.warmup(progress=False)
    warned = [r.getMessage() for r in caplog.records if "ignoring and removing" in r.getMessage()]
    assert len(warned) == 1 and "corrupt" in warned[0], warned
    [path] = [p for p in corrupted if str(p) in warned[0]]
    store = eng.runner.graphs.store
    assert store.compiled >= 1 and store.loaded == first.compiled + first.loaded - store.compiled
    outs, _, _ = eng.generate(PROMPTS, SamplingParams(), 24)
    assert [o.token_ids for o in outs] == tokens
    assert path.exists()  # written again by the compile
