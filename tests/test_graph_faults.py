"""A bucket graph that raises mid-run: under ``graph_failure: eager`` (the users' default) it costs that step, not
the engine: the step reruns on the eager reference; under ``raise`` (the suite's default) it raises.

Harness side: the fused step graphs (``SpecStepGraphs``, the default decode path) and, on the step-by-step path,
the ``BucketedGraph`` of the target step and of ``MtpTorchairProposer``. The failing calls run the graph first (its
cache writes land) and then raise. The graphs here are the eager backend's (the fallback does not depend
on the backend; compiling would only cost CI time); the vLLM drafter's inductor graphs get the same injection in
tests/test_vllm_plugin.py (``ours_k2_fault``).
"""
import logging
import os

import pytest
import torch

from ascend_spec.config import GRAPH_FAILURE_POLICIES as config_policies
from ascend_spec.config import ConfigError, EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec_tools.fault_injection import InjectedFault, inject_graph_faults
from ascend_spec.graph.backends import get_backend
from ascend_spec.graph.backends.base import GRAPH_FAILURE_ENV, GRAPH_FAILURE_POLICIES
from ascend_spec.graph.buckets import BatchArg, BucketedGraph
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

TEXTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self", "for i in range(10):\n",
         "with open(path) as f:\n", "raise ValueError("]
GRAPH = GraphModeConfig(backend="eager", graph_batch_sizes=(2, 4, 8))


@pytest.fixture(scope="module")
def prompts(trained_dir):
    tok = TextTokenizer(trained_dir)
    return [tok.encode(t) for t in TEXTS], [10 + 4 * i for i in range(len(TEXTS))]


def _generate(trained_dir, prompts, spec, faults=None, fused=True, graph_failure="eager"):
    eng = load_engine(trained_dir, EngineConfig(max_model_len=128, max_num_seqs=8, speculative=spec, graph=GRAPH,
                                                fused_step=fused, adaptive_k=False, graph_failure=graph_failure))
    plans = {}
    for name, calls in (faults or {}).items():
        graph = eng.runner.graphs[name]
        plans[name] = (graph, inject_graph_faults(graph, calls))
    outs, stats, _ = eng.generate(prompts[0], SamplingParams(), prompts[1])
    return [o.token_ids for o in outs], stats, plans, eng


def test_the_suite_runs_strict():
    """tests/conftest.py makes strict the default of every engine and drafter the suite builds."""
    assert os.environ.get(GRAPH_FAILURE_ENV) == "raise"
    assert get_backend("eager", "cpu").graph_failure == "raise"
    assert get_backend("eager", "cpu", graph_failure="eager").graph_failure == "eager"


@pytest.mark.parametrize("fused,faults", [(True, {"fused": {2}}), (False, {"draft": {2}})], ids=["fused", "stepwise"])
def test_strict_graph_failure_raises(trained_dir, prompts, fused, faults):
    """``graph_failure: raise``: a graph that raises fails the run; nothing reruns eagerly behind a test's back."""
    spec = SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(InjectedFault, match="graph call 2"):
        _generate(trained_dir, prompts, spec, faults, fused, graph_failure="raise")


def test_graph_failure_policy_errors_name_the_key_and_values(monkeypatch):
    with pytest.raises(ConfigError, match=r"graph_failure='strict'; allowed: \['eager', 'raise'\]"):
        EngineConfig(graph_failure="strict")
    monkeypatch.setenv(GRAPH_FAILURE_ENV, "yes")
    with pytest.raises(ValueError, match=r"ASCEND_SPEC_GRAPH_FAILURE='yes'; allowed: \['eager', 'raise'\]"):
        get_backend("eager", "cpu")
    assert GRAPH_FAILURE_POLICIES == config_policies
    from ascend_spec.compat.settings import PluginSettings

    with pytest.raises(ConfigError, match=r"ascend_spec.graph_failure='off'; allowed: \['eager', 'raise'\]"):
        PluginSettings.from_additional_config({"ascend_spec": {"graph_failure": "off"}})
    assert PluginSettings.from_additional_config({"ascend_spec": {"graph_failure": "eager"}}).graph_failure == "eager"


@pytest.mark.parametrize("fused,faults", [(True, {"fused": {2, 5, 6, 9}, "prefill": {1}}),
                                          (False, {"draft": {2, 5, 6, 9}, "target": {3}})], ids=["fused", "stepwise"])
def test_failing_graphs_fall_back_to_eager_for_that_step(trained_dir, prompts, caplog, fused, faults):
    reference, _, _, _ = _generate(trained_dir, prompts, None)
    caplog.set_level(logging.DEBUG, logger="ascend_spec.graph.buckets")
    spec = SpeculativeConfig(num_speculative_tokens=2)
    got, stats, plans, eng = _generate(trained_dir, prompts, spec, faults, fused)
    assert got == reference, "a failed graph step changed the tokens"
    assert stats.graph_failures == sum(len(calls) for calls in faults.values()), stats.graph_failures
    warnings = [r.getMessage() for r in caplog.records if "failed" in r.getMessage() and r.levelno >= logging.WARNING]
    # the first failure of each key logs its traceback
    assert all(r.exc_info for r in caplog.records if "failed" in r.getMessage() and r.levelno >= logging.WARNING)
    for name, (graph, plan) in plans.items():
        assert plan.raised == sorted(plan.fail_on), (name, plan)  # every injected fault fired ...
        assert sum(graph.failures.values()) == len(plan.fail_on), (name, graph.failures)  # ... and was caught
        # one warning per graph that failed (the first time), not one per failure
        label = "fused step" if name == "fused" else f"{graph.prefix}:"
        assert sum(m.startswith(label) for m in warnings) == len(graph.failures), warnings
        if name != "prefill":  # a run's prompts prefill in one call: the next run uses it again
            assert plan.calls > max(plan.fail_on), f"{name}: the graph was not used again after its faults"
    # the engine keeps serving, through its graphs
    again, _, _ = eng.generate(prompts[0][:2], SamplingParams(), prompts[1][:2])
    assert [o.token_ids for o in again] == reference[:2]
    for name, (graph, plan) in plans.items():
        assert plan.calls > max(plan.fail_on), f"{name}: the graph was not used again after its faults"


def test_compile_policy_errors_are_not_swallowed():
    """``fail_on_recompile`` refusing a compile is a policy speaking, not a fault: it is raised, not run eagerly."""
    graph = BucketedGraph(get_backend("inductor", "cpu"), lambda x: (x * 2,), "toy", [2], [BatchArg("x", 0)])
    graph([torch.ones(2, 3)])
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match="fail_on_recompile"):
        graph([torch.ones(2, 5)])  # another shape: the policy refuses the recompile
    assert graph.num_failures == 0
