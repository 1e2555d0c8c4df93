"""``warm_graphs: first`` (``ascend-spec generate``'s default): warm-up compiles what the first steps run, K_max and
K = 0 (and the lone-request graphs only when the first batch is one request); a K between is compiled when adaptive
K first picks it, timed, and counted as planned, not as a recompile."""
from __future__ import annotations

import dataclasses

import pytest

from ascend_spec.adaptive import EXPLORE_EVERY, EXPLORE_STEPS, LEARN_DRAFTS, LEARN_STEPS, AdaptiveK, interpolated_costs
from ascend_spec.cli import build_parser, engine_config_from_args
from ascend_spec.config import ConfigError, EngineConfig, GraphModeConfig
from ascend_spec import adaptive, k_policy
from ascend_spec.engine import dynamo_compile_count, load_engine
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer
from ascend_spec.warmup import GraphWarmup

from .conftest import inductor_config

TEXTS = ["the quick brown fox jumps over", "speculative decoding drafts tokens that", "a b c d e f g h i j"]


@pytest.fixture
def own_store(tmp_path, monkeypatch):
    """A store of saved graphs of this test's own: graphs another test saved would load, not compile."""
    monkeypatch.setenv("ASCEND_SPEC_CACHE_DIR", str(tmp_path / "cache"))


def test_interpolated_k_is_never_explored_and_sits_on_the_line(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(adaptive, "FAR_EXPLORE_GAP", 1.0)  # every measured K's turn kept, however far it trails
    assert interpolated_costs({0: 1.0, 3: 2.5}, [1, 2]) == pytest.approx({1: 1.5, 2: 2.0})
    policy = AdaptiveK(2, step_seconds={8: {0: 1.0, 1: 1.45, 2: 1.9}}, pending={1})
    steps = 3 * EXPLORE_EVERY + 16
    picks = [policy.k_for(8, [0.9, 0.9]) for _ in range(steps)]
    # explorations: the measured K values only
    assert set(picks) == {0, 2} and picks.count(0) == steps // EXPLORE_EVERY * EXPLORE_STEPS
    # an interpolated K that looks best is picked (the runner then compiles and times it)
    assert AdaptiveK(2, step_seconds={8: {0: 1.0, 1: 1.45, 2: 1.9}}, pending={1}).k_for(8, [0.6, 0.5]) == 1


def test_cli_defers_engine_api_warms_everything():
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["generate"])).warm_graphs == "first"
    assert engine_config_from_args(parse(["generate", "--compile-all"])).warm_graphs == "all"
    assert EngineConfig().warm_graphs == "all"
    with pytest.raises(ConfigError, match="warm_graphs='some'; allowed: \\['all', 'first'\\]"):
        EngineConfig(warm_graphs="some")


#: seconds of a step per K that warm-up "measures" in the tests that inject them: drafting is cheap, and K = 1
#: costs more than the line through K = 0 and K = 2 puts it at (1.025), as measured K values do
INJECTED_COSTS = {0: 1.0, 1: 1.04, 2: 1.05}


def fixed_step_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-up's step timings return :data:`INJECTED_COSTS` (the steps still replay), and the steps the engine runs
    move no figure: the policy's choices then follow acceptance alone, however fast the host runs."""
    real = GraphWarmup.time_step

    def timed(self, bucket: int, k: int, context: int = 256, repeats: int = 5) -> float:
        real(self, bucket, k, context, repeats=1)
        return INJECTED_COSTS[k]

    monkeypatch.setattr(GraphWarmup, "time_step", timed)
    monkeypatch.setattr(AdaptiveK, "observe", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(AdaptiveK, "observe_switch", lambda self, *args, **kwargs: None)


@pytest.mark.slow
def test_first_steps_warm_then_each_deferred_k_compiles_once_when_needed(trained_dir, own_store, monkeypatch):
    """Over 90 s: its subject is when each graph compiles, so it compiles into a store of its own.
    Adaptive K_max = 2, two prompts: a one-token run compiles nothing (its tokens come from the prompt pass);
    warm-up, at the first decode step, compiles the step at K = 2 only, what runs while acceptance is
    learned (``all`` compiles six step graphs and the two prompt graphs; a run of few prompts runs them eagerly),
    and a lone request pads to two rows. Requests too short to repay a compile keep K_max. Once acceptance is
    learned and requests have enough tokens to go, the next step first compiles and times K = 0, and K = 1's
    figure is interpolated; a K asked for compiles before its step. Each is counted as a deferred compile, not a
    recompile; the tokens equal plain greedy decoding; a run after them compiles nothing.

    The step costs the policy weighs are injected (:func:`fixed_step_costs`), so which K it picks does not depend
    on how fast or loaded the host is."""
    fixed_step_costs(monkeypatch)
    eng = load_engine(trained_dir, dataclasses.replace(inductor_config(2), adaptive_k=True, warm_graphs="first"))
    runner = eng.runner
    tok = TextTokenizer(trained_dir)
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    plain = dataclasses.replace(inductor_config(0), graph=GraphModeConfig(enabled=False, backend="eager"))
    want, _, _ = load_engine(trained_dir, plain).generate(prompts, SamplingParams(), [24, 24])

    # The first tokens come from the eager prompt pass, before any decode graph compiles or loads: a one-token run
    # needs none.
    compiles = dynamo_compile_count()
    got, stats, _ = eng.generate(prompts, SamplingParams(), 1)
    assert stats.graphs_compiled == 0 and not eng.spec_graphs._graphs and dynamo_compile_count() == compiles
    assert [o.token_ids for o in got] == [o.token_ids[:1] for o in want] and stats.first_token_seconds > 0
    got, stats, _ = eng.generate(prompts, SamplingParams(), [24, 24])  # warm-up before its first decode step
    assert stats.graphs_compiled == 1 and stats.recompiles_after_warmup == 0
    assert {key.k for key in eng.spec_graphs._graphs} == {2} and not eng.step_seconds
    assert runner.rows_for(1) == 2 and not runner.warm.lone
    assert [o.token_ids for o in got] == [o.token_ids for o in want]

    for _ in range(LEARN_DRAFTS):  # acceptance learnt: both positions pay, so K = 2 beats K = 1
        runner.k_policy.record(2, 2)
    runner.k_policy.learning_steps = LEARN_STEPS
    # requests this short would not repay a compile: K_max goes on
    got, stats, _ = eng.generate(prompts, SamplingParams(), [24, 24])
    assert stats.steps_per_k == {2: stats.num_steps} and stats.deferred_compiles == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]

    monkeypatch.setattr(k_policy, "DEFERRED_MIN_TOKENS", 0)  # the bundled fixture's max_model_len is 128
    compiles = dynamo_compile_count()
    got, stats, _ = eng.generate(prompts, SamplingParams(), [24, 24])
    # on the injected costs K = 2 pays more than K = 1's interpolated figure: K = 1 stays deferred, on the line
    assert 1 not in stats.steps_per_k and set(stats.steps_per_k) <= {0, 2}
    assert {key.k for key in eng.spec_graphs._graphs} == {0, 2}
    assert runner.k_policy.costs.pending == {1}
    assert all(costs[1] == pytest.approx((costs[0] + costs[2]) / 2) for costs in eng.step_seconds.values())
    assert stats.deferred_compiles == dynamo_compile_count() - compiles > 0
    assert stats.recompiles_after_warmup == 0 and stats.deferred_compile_seconds > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]

    eng.force_k = 1
    got, stats, _ = eng.generate(prompts, SamplingParams(), [24, 24])
    assert stats.steps_per_k == {1: stats.num_steps} and not runner.k_policy.costs.pending
    assert stats.deferred_compiles > 0 and stats.recompiles_after_warmup == 0
    # timed now, K = 1's figure is its own (the injected 1.04 against K = 2's 1.05), off the line (1.025)
    assert all(costs[1] != pytest.approx((costs[0] + costs[2]) / 2) for costs in eng.step_seconds.values())
    assert all(costs[1] == pytest.approx(costs[2] * INJECTED_COSTS[1] / INJECTED_COSTS[2])
               for costs in eng.step_seconds.values())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]

    eng.force_k = None
    again, stats, _ = eng.generate(prompts, SamplingParams(), [24, 24])
    assert stats.deferred_compiles == stats.recompiles_after_warmup == 0
    assert [o.token_ids for o in again] == [o.token_ids for o in want]
