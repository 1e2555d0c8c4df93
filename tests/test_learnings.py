"""What a run learned is kept (``ascend_spec.learnings``): adaptive K's acceptance and step costs survive a restart,
a corrupt or foreign entry warns, is removed and is learned again, and another K_max or caller misses."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from ascend_spec import k_policy
from ascend_spec.adaptive import AdaptiveK
from ascend_spec.cli import main
from ascend_spec.config import KEEP_LEARNINGS_ENV, ConfigError, EngineConfig, GraphModeConfig, SpeculativeConfig
from ascend_spec.engine import Engine, load_engine
from ascend_spec.graph.backends.compile_cache import CompileCache
from ascend_spec.k_policy import KPolicy
from ascend_spec.learnings import Learnings, LearningsStore, learnings_key
from ascend_spec.sampling import SamplingParams
from ascend_spec.warmup import GraphWarmup

#: what warm-up "measures" in these tests (a lone request, K = 0..2): drafting cheap, so the fixture's drafts pay
WARM_COSTS = {0: 1.0, 1: 1.1, 2: 1.2}
#: learning ends sooner than the engine's (128 drafts over 64 steps), so a first run of a few seconds finishes it
LEARN_DRAFTS, LEARN_STEPS = 24, 16
PROMPT = [5, 9, 17, 3, 22, 8]
TOKENS = 96


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of the test's own, learnings on, learning short, and warm-up's timings :data:`WARM_COSTS`."""
    root = tmp_path / "cache"
    monkeypatch.setenv("ASCEND_SPEC_CACHE_DIR", str(root))
    monkeypatch.delenv("ASCEND_SPEC_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv(KEEP_LEARNINGS_ENV, "1")
    monkeypatch.setattr(k_policy, "LEARN_DRAFTS", LEARN_DRAFTS)
    monkeypatch.setattr(k_policy, "LEARN_STEPS", LEARN_STEPS)
    real = GraphWarmup.time_step

    def timed(self, bucket: int, k: int, context: int = 256, repeats: int = 5) -> float:
        real(self, bucket, k, context, repeats=1)
        return WARM_COSTS[k]

    monkeypatch.setattr(GraphWarmup, "time_step", timed)
    return root


def engine(trained_dir: Path, k: int = 2, **kwargs) -> Engine:
    """A lone-request engine on the eager backend (adaptive K needs warm-up's timings: ``warmup`` takes them)."""
    cfg = EngineConfig(max_model_len=128, max_num_seqs=1, speculative=SpeculativeConfig(num_speculative_tokens=k),
                       graph=GraphModeConfig(enabled=False, backend="eager", graph_batch_sizes=(1,)), **kwargs)
    eng = load_engine(trained_dir, cfg)
    eng.warmup(progress=False)
    return eng


def run(eng: Engine) -> list[int]:
    outs, _, _ = eng.generate([PROMPT], SamplingParams(), TOKENS)
    return outs[0].token_ids


def entry(eng: Engine) -> Path:
    assert eng.learnings is not None
    store, key = eng.learnings
    return store.path_for(key)


def sample() -> Learnings:
    return Learnings(k_max=2, offered=[1000, 600], accepted=[600, 420],
                     step_seconds={1: {0: 0.010, 1: 0.012, 2: 0.015}, 4: {0: 0.02, 2: 0.03}},
                     between_seconds={1: {0: 0.001, 2: 0.002}}, steps={1: {0: 40, 2: 300}}, learning_steps=64)


def key(**changes):
    args = dict(k_max=2, dtype="float32", backend="inductor", batch_sizes=(1, 4), flavour="engine")
    return learnings_key({"hidden_size": 64}, "weights-a", **{**args, **changes})


# --------------------------------------------------------------------------- the data and the store


def test_round_trip_through_the_payload_the_store_and_a_policy(tmp_path: Path) -> None:
    learned = sample()
    assert Learnings.from_json(learned.to_json()) == learned
    store = LearningsStore(CompileCache(tmp_path))
    path = store.save(key(), learned)
    assert path is not None and path.parent == tmp_path and store.load(key()) == learned
    assert LearningsStore(None).load(key()) is None and LearningsStore(None).save(key(), learned) is None

    policy = KPolicy(2, adaptive=True, batch_sizes=(1, 4))
    policy.step_seconds[1] = {0: 0.005, 1: 0.006, 2: 0.0075}  # warm-up's: half the learned figures
    policy.step_seconds[2] = {0: 0.007, 1: 0.008, 2: 0.009}  # a bucket the entry lacks: warm-up's stand
    learned.seed(policy)
    # an earlier run weighs at most 512 first-position drafts, every position scaled alike
    assert policy.acceptance.offered == [512, 307] and policy.acceptance.accepted == [307, 215]
    assert policy.acceptance.rates() == pytest.approx([0.6, 0.7], abs=0.02)
    assert policy.learning_steps == 64 and policy.step_seconds[1] == learned.step_seconds[1]
    assert policy.step_seconds[2] == {0: 0.007, 1: 0.008, 2: 0.009}
    assert policy.costs.between(1, 2) == pytest.approx(0.002, rel=0.2)
    back = Learnings.from_policy(policy)
    assert back.offered == [512, 307] and back.step_seconds[1] == learned.step_seconds[1]


def test_warm_up_fills_in_only_what_the_learned_figures_lack() -> None:
    policy = KPolicy(2, adaptive=True, batch_sizes=(4,))
    policy.step_seconds[4] = {0: 0.01, 1: 0.02, 2: 0.02}
    policy.costs.pending = {1}
    Learnings(2, [0, 0], [0, 0], {4: {0: 0.02, 2: 0.03}}).seed(policy)
    # K = 1 only warm-up priced (interpolated): on the learned scale, its figure × the median learned ÷ warm-up
    assert policy.step_seconds[4] == pytest.approx({0: 0.02, 1: 0.035, 2: 0.03})
    assert Learnings.from_policy(policy).step_seconds == {4: {0: 0.02, 2: 0.03}}  # interpolated ones are not kept


def test_a_start_resumes_the_earlier_runs_k_then_trials_another() -> None:
    """An earlier run settled on K = 1 (most of its steps); K = 2's figure came from its explorations and reads a
    little better than K = 1's. A start from those learnings runs K = 1, and K = 2 takes over only after a trial
    of its own steps (on figures alone it ran K = 2 for most of a run where K = 1 was best, 0.965x the best)."""
    from ascend_spec import adaptive

    learned = Learnings(k_max=2, offered=[1000, 600], accepted=[800, 420],
                        step_seconds={8: {0: 0.010, 1: 0.0120, 2: 0.0125}},
                        between_seconds={8: {0: 0.001, 1: 0.001, 2: 0.001}}, steps={8: {0: 4, 1: 500, 2: 12}},
                        learning_steps=64)
    policy = KPolicy(2, adaptive=True, batch_sizes=(8,))
    policy.step_seconds[8] = {0: 0.01, 1: 0.012, 2: 0.0125}
    learned.seed(policy)
    assert policy.costs.chosen == {8: 1}
    rates = policy.acceptance.rates()
    total = {k: c + policy.costs.between(8, k) for k, c in policy.step_seconds[8].items()}
    assert adaptive.choose_k(total, rates, None, 8) == 2  # on figures alone K = 2 would start
    true = {0: 0.010, 1: 0.0120, 2: 0.0165}  # K = 2's steps cost more than its explorations showed
    ks = []
    for _ in range(3 * adaptive.TRIAL_STEPS):
        ks.append(policy.costs.k_for(8, rates))
        policy.costs.observe(8, ks[-1], true[ks[-1]], switched=len(ks) > 1 and ks[-1] != ks[-2])
    assert ks[: adaptive.TRIAL_STEPS] == [2] * adaptive.TRIAL_STEPS  # a trial ...
    assert set(ks[adaptive.TRIAL_STEPS:]) == {1} and policy.costs.chosen[8] == 1  # ... lost: the incumbent runs
    # a later warm-up's seed (costs only) leaves the run's own choice alone
    policy.costs.chosen[8] = 2
    learned.seed(policy, acceptance=False)
    assert policy.costs.chosen[8] == 2


def test_an_earlier_entry_is_merged_with_its_counts_capped() -> None:
    now = Learnings(2, [100, 50], [50, 30], {1: {0: 0.01, 2: 0.02}}, {1: {2: 0.004}}, {1: {2: 100}}, 10)
    merged = now.merge(sample())
    assert merged.offered == [612, 357] and merged.accepted == [357, 245]
    assert merged.step_seconds == {1: {0: 0.01, 1: 0.012, 2: 0.02}, 4: {0: 0.02, 2: 0.03}}
    assert merged.steps == {1: {0: 40, 2: 356}} and merged.learning_steps == 64
    assert merged.between_seconds[1][2] == pytest.approx((100 * 0.004 + 256 * 0.002) / 356)


@pytest.mark.parametrize("field, value, why", [
    ("offered", [10], "offered"), ("accepted", [10, 700], "exceeds offered"),
    ("step_seconds", {1: {3: 0.01}}, "step_seconds"), ("step_seconds", {1: {0: -1.0}}, "step_seconds"),
    ("learning_steps", 1000, "learning_steps")])
def test_bad_figures_are_refused_naming_the_field(field: str, value, why: str) -> None:
    data = {**sample().__dict__, field: value}
    with pytest.raises(ValueError, match=why):
        Learnings(**data)


def test_another_k_max_flavour_host_or_model_misses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LearningsStore(CompileCache(tmp_path))
    path = store.save(key(), sample())
    others = [key(k_max=3), key(flavour="vllm-v1"), key(batch_sizes=(1, 2, 4)), key(dtype="bfloat16"),
              learnings_key({"hidden_size": 64}, "weights-b", k_max=2, dtype="float32", backend="inductor",
                            batch_sizes=(1, 4), flavour="engine")]
    assert len({k.digest for k in [key(), *others]}) == 1 + len(others)
    caplog.set_level(logging.WARNING)
    assert all(store.load(k) is None for k in others) and path.is_file() and not caplog.records
    assert key().backend_options["host"]["cores"] and key().what == "learnings.engine"
    with pytest.raises(ValueError, match="flavour='no spaces'"):
        key(flavour="no spaces")
    # an entry under another key's name (copied, renamed) is foreign: it warns and is removed
    foreign = store.path_for(key(flavour="vllm-v1"))
    foreign.write_bytes(path.read_bytes())
    assert store.load(key(flavour="vllm-v1")) is None and not foreign.exists()
    assert "foreign entry" in caplog.text and str(foreign) in caplog.text


def test_the_switch_is_checked() -> None:
    with pytest.raises(ConfigError, match="keep_learnings='yes'; allowed: True, False or None"):
        EngineConfig(keep_learnings="yes")


# --------------------------------------------------------------------------- the engine


def test_learnings_survive_a_restart(trained_dir: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second engine on the same model and host starts with the first's acceptance and step costs and runs no
    learning step: warm-up's rough figures do not replace the learned ones."""
    first = engine(trained_dir)
    assert first.k_policy.acceptance.offered == [0, 0] and first.step_seconds == {1: WARM_COSTS}
    tokens = run(first)
    assert first.k_policy.learning_steps >= LEARN_STEPS  # its run learned acceptance
    saved = LearningsStore(CompileCache(cache_dir)).load(first.learnings[1])
    assert saved is not None and saved.offered == first.k_policy.acceptance.offered
    assert saved.offered[0] >= LEARN_DRAFTS and saved.step_seconds[1] == first.step_seconds[1] != WARM_COSTS

    learning = []
    learning_k = AdaptiveK.learning_k
    monkeypatch.setattr(AdaptiveK, "learning_k",
                        lambda self, *args, **kwargs: learning.append(1) or learning_k(self, *args, **kwargs))
    second = engine(trained_dir)
    assert second.k_policy.acceptance.offered == saved.offered  # before any generate
    assert second.k_policy.learning_steps == first.k_policy.learning_steps
    assert second.step_seconds[1] == saved.step_seconds[1]  # learned, not warm-up's
    assert run(second) == tokens and not learning
    assert second.k_policy.acceptance.offered[0] > saved.offered[0]


def test_a_corrupt_entry_warns_is_removed_and_learned_again(trained_dir: Path, cache_dir: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    first = engine(trained_dir)
    run(first)
    path = entry(first)
    blob = bytearray(path.read_bytes())
    blob[-5] ^= 0xFF
    path.write_bytes(bytes(blob))
    caplog.set_level(logging.WARNING)
    second = engine(trained_dir)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "corrupt" in warnings[0], warnings
    assert not path.exists() and second.k_policy.acceptance.offered == [0, 0]  # learns afresh
    run(second)
    assert path.is_file() and LearningsStore(CompileCache(cache_dir)).load(second.learnings[1]) is not None

    path.write_bytes(path.read_bytes()[:40])  # truncated
    caplog.clear()
    engine(trained_dir)
    assert "truncated" in caplog.text and not path.exists()


def test_kept_only_where_asked_and_per_k_max(trained_dir: Path, cache_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Another K_max misses; ``keep_learnings=False``, a disabled compile cache or a forced K keep nothing."""
    first = engine(trained_dir)
    first.force_k = 1
    run(first)
    assert not entry(first).exists()  # a forced K's run is not the policy's
    first.force_k = None
    run(first)
    assert entry(first).is_file()
    other = engine(trained_dir, k=1)
    assert other.k_policy.acceptance.offered == [0] and entry(other) != entry(first)
    assert engine(trained_dir, keep_learnings=False).learnings is None
    monkeypatch.setenv("ASCEND_SPEC_DISABLE_COMPILE_CACHE", "1")
    assert engine(trained_dir).learnings is None


def test_cache_info_lists_learnings_apart_and_clear_removes_them(trained_dir: Path, cache_dir: Path, capsys) -> None:
    store = LearningsStore(CompileCache())
    path = store.save(key(), sample())
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert "learnings (adaptive K):" in out and "learnings.engine" in out and "1000 drafts" in out
    assert "buckets 1, 4" in out and "K 0-2" in out
    assert main(["cache", "info", "--json"]) == 0
    [learned] = json.loads(capsys.readouterr().out)["learnings"]
    assert (learned["what"], learned["drafts"], learned["buckets"]) == ("learnings.engine", 1000, [1, 4])
    other = CompileCache().path_for(key(flavour="vllm-v1")).with_name("graph-stand-in.bin")
    other.write_bytes(b"not a learnings entry")
    assert main(["cache", "clear", "--learnings"]) == 0
    assert f"removed {path}" in capsys.readouterr().out and not path.exists() and other.exists()
    assert main(["cache", "clear"]) == 0 and not other.exists()
