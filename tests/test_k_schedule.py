"""K per batch size where vLLM's scheduler asks (``ascend_spec.k_schedule``, ``compat.schedule_k``), without an
engine: the sweep that seeds each bucket's step costs, the policy that takes over, what a step's output teaches,
the step clock, and which K values a configuration lets the scheduler ask for. The engine runs are
``test_vllm_plugin.py``'s ``ours_auto*`` and ``ours_user_schedule``."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from ascend_spec.compat import schedule_k
from ascend_spec.compat.schedule_k import MeasuredLookup, StepClock, draft_ks, observe_step, schedule_mode
from ascend_spec.compat.settings import PluginSettings
from ascend_spec.config import ConfigError
from ascend_spec.k_schedule import SWEEP_STEPS, MeasuredSchedule, nominal_buckets


def run_steps(s: MeasuredSchedule, batch: int, n: int, cost: dict[int, float], accept: float = 0.0) -> list[int]:
    """``n`` scheduled steps of ``batch`` requests, each costing ``cost[k]``; every request accepts its drafts with
    probability ``accept`` (deterministic: the first ``round(accept * k)`` of them)."""
    ks, prev = [], None
    for _ in range(n):
        k = s.k_for(batch)
        s.observe(batch, k, cost[k], switched=prev is not None and prev != k)
        for _ in range(batch):
            if k:
                s.record(k, round(accept * k))
        ks.append(k)
        prev = k
    return ks


def test_nominal_buckets_cover_every_batch_size():
    assert nominal_buckets(1) == (1,)
    assert nominal_buckets(8) == (1, 2, 4, 8)
    assert nominal_buckets(12) == (1, 2, 4, 8, 12)
    s = MeasuredSchedule(2, 12)
    assert [s.bucket(b) for b in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]


def test_each_bucket_sweeps_every_k_from_k_max_down_then_its_medians_seed_the_costs():
    s = MeasuredSchedule(2, 8)
    cost = {0: 1.0, 1: 1.5, 2: 2.0}
    ks = run_steps(s, 8, 3 * (SWEEP_STEPS + 1), cost, accept=1.0)
    # K_max first; a change's first step is not counted, so each K runs SWEEP_STEPS + 1 steps (the last: SWEEP_STEPS)
    assert ks[:SWEEP_STEPS] == [2] * SWEEP_STEPS
    assert ks[SWEEP_STEPS:2 * SWEEP_STEPS + 1] == [1] * (SWEEP_STEPS + 1)
    assert s.measured(8) and s.policy.step_seconds[8] == cost
    assert not s.measured(4) and not s.measured(1), "a bucket's sweep seeds that bucket only"


def test_after_the_sweep_the_policy_picks_k_0_where_drafts_do_not_pay_and_k_max_where_they_do():
    cheap_drafts = {0: 1.0, 1: 1.05, 2: 1.1}
    pays = MeasuredSchedule(2, 4)
    ks = run_steps(pays, 4, 400, cheap_drafts, accept=1.0)
    assert ks[-50:] == [2] * 50
    costly_drafts = {0: 1.0, 1: 1.9, 2: 2.8}
    loses = MeasuredSchedule(2, 4)
    ks = run_steps(loses, 4, 400, costly_drafts, accept=0.0)
    assert ks[-200:].count(0) > 180, ks[-200:]  # K = 0, but for the policy's explorations
    assert loses.chosen()[4] == 0


def test_the_lookup_asks_the_schedule_once_per_step_and_stays_a_list():
    s = MeasuredSchedule(3, 8)
    class Scheduler:  # what the lookup reads of vLLM's: the running requests' token budgets
        running = [SimpleNamespace(max_tokens=16)] * 3

    scheduler = Scheduler()
    lookup = MeasuredLookup(s, scheduler)
    assert lookup is not None and len(lookup) == 9 and isinstance(lookup, list)
    assert lookup[3] == 3 and sum(s.steps.values()) == 1
    assert lookup[:2] == [3, 3]  # slices read the list itself


def output(spec: dict[str, list[int]], k: int, new: bool = False) -> SimpleNamespace:
    return SimpleNamespace(scheduled_spec_decode_tokens=spec, num_spec_tokens_to_schedule=k,
                           num_scheduled_tokens={r: 1 + len(d) for r, d in spec.items()},
                           scheduled_new_reqs=[object()] if new else [])


def runner_output(sampled: dict[str, list[int]]) -> SimpleNamespace:
    ids = list(sampled)
    return SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=list(sampled.values()))


def test_a_step_teaches_acceptance_per_position_and_its_cost_only_when_it_is_a_clean_decode_step():
    s = MeasuredSchedule(2, 4)
    out = output({"a": [5, 6], "b": [7, 8]}, k=2)
    observe_step(s, out, runner_output({"a": [5, 6, 9], "b": [3]}), seconds=0.5)
    assert s.policy.acceptance.offered == [2, 1] and s.policy.acceptance.accepted == [1, 1]
    assert s.sweeps[2][2] == [0.5]
    # a step with a new request (a prefill), one of unknown seconds, one whose drafts were of another K: no cost
    observe_step(s, output({"a": [5, 6]}, k=2, new=True), runner_output({"a": [1]}), seconds=9.0)
    observe_step(s, output({"a": [5, 6]}, k=2), runner_output({"a": [1]}), seconds=None)
    observe_step(s, output({"a": [5, 6]}, k=1), runner_output({"a": [1]}), seconds=9.0)
    assert s.sweeps[2] == {2: [0.5]} and s.sweeps.get(1) is None


def test_the_step_clock_times_back_to_back_steps_and_not_a_step_after_idling(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(schedule_k.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    a, b, c = object(), object(), object()
    clock.scheduled(a)
    now[0] = 1.0
    assert clock.updated(a) is None  # nothing before it
    now[0] = 1.1
    clock.scheduled(b)
    now[0] = 2.0
    assert clock.updated(b) == pytest.approx(1.0)
    now[0] = 30.0  # the engine sat idle, then a step was scheduled
    clock.scheduled(c)
    now[0] = 31.0
    assert clock.updated(c) is None


def vllm_config(schedule=None, dp: int = 1, method: str = "deepseek_mtp", **ours) -> SimpleNamespace:
    block = {"enabled": True, **ours}
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method=method, num_speculative_tokens_per_batch_size=schedule),
        additional_config={"ascend_spec": block}, parallel_config=SimpleNamespace(data_parallel_size=dp))


def test_the_k_values_a_configuration_lets_the_scheduler_ask_for():
    assert schedule_mode(vllm_config()) == "auto" and draft_ks(vllm_config(), 3) == (0, 1, 2, 3)
    written = [(1, 4, 3), (5, 16, 1), (17, 64, 0)]
    assert schedule_mode(vllm_config(written)) == "user" and draft_ks(vllm_config(written), 2) == (0, 1, 2)
    assert schedule_mode(vllm_config(k_schedule="fixed")) == "fixed" and draft_ks(vllm_config(k_schedule="fixed"), 2) == (2,)
    assert schedule_mode(vllm_config(dp=2)) == "fixed", "data-parallel ranks draft one K"
    assert schedule_mode(vllm_config(method="eagle")) == "off"


def test_a_bad_k_schedule_is_one_error_naming_the_key_and_the_allowed_values():
    with pytest.raises(ConfigError, match=r"k_schedule='sometimes'; allowed: \['auto', 'fixed'\]"):
        PluginSettings.from_additional_config({"ascend_spec": {"k_schedule": "sometimes"}})


class FakeScheduler:
    """What ``install`` reads and wraps of vLLM's scheduler; its ``schedule`` indexes the lookup as vLLM's does."""

    def __init__(self, cfg: SimpleNamespace, k_max: int, batch: int) -> None:
        self.vllm_config, self.num_spec_tokens, self.batch = cfg, k_max, batch
        self.running = [SimpleNamespace(max_tokens=64)] * batch
        self.dynamic_sd_lookup = None
        self.stopped = False
        self.previous_k = None

    def schedule(self) -> SimpleNamespace:
        k = self.dynamic_sd_lookup[self.batch]
        drafts = {f"r{i}": [1] * (self.previous_k if self.previous_k is not None else k) for i in range(self.batch)}
        self.previous_k = k
        return output(drafts, k)

    def update_from_output(self, scheduler_output, model_runner_output) -> None:
        pass

    def shutdown(self) -> None:
        self.stopped = True


def engine_config(tmp_path) -> SimpleNamespace:
    cfg = vllm_config()
    cfg.model_config = SimpleNamespace(model=str(tmp_path / "no-such-model"), revision=None, max_model_len=512,
                                       quantization=None, enforce_eager=False, dtype="float32")
    cfg.scheduler_config = SimpleNamespace(max_num_seqs=8, async_scheduling=False)
    cfg.parallel_config.tensor_parallel_size = 1
    return cfg


def serve(cfg: SimpleNamespace, steps: int, batch: int = 8) -> tuple[FakeScheduler, MeasuredSchedule]:
    scheduler = FakeScheduler(cfg, 2, batch)
    schedule = schedule_k.install(scheduler)
    for _ in range(steps):
        out = scheduler.schedule()
        time.sleep(0.002)  # the step runs: most of a step's time lies between its schedule and its update
        sampled = {r: [1] * len(d) + [2] for r, d in out.scheduled_spec_decode_tokens.items()}  # all accepted
        scheduler.update_from_output(out, runner_output(sampled))
    scheduler.shutdown()
    return scheduler, schedule


def test_what_the_schedule_learned_survives_a_restart_and_a_corrupt_entry_is_reported_and_rebuilt(
        tmp_path, monkeypatch, caplog):
    """The scheduler's shutdown keeps the schedule's learnings in the compile cache; the next engine of this model
    and host starts from them (no sweep in a measured bucket); a corrupt entry is one warning naming the file, is
    removed, and the next run learns afresh and writes it again."""
    monkeypatch.setenv("ASCEND_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ASCEND_SPEC_KEEP_LEARNINGS", "1")
    cfg = engine_config(tmp_path)
    first_scheduler, first = serve(cfg, 40)
    assert first_scheduler.stopped and not first.seeded and first.measured(8)
    entries = list((tmp_path / "cache").glob("*.bin"))
    assert len(entries) == 1
    _, second = serve(cfg, 1)
    assert second.seeded and second.measured(8) and sum(second.steps.values()) == 1
    assert second.policy.step_seconds[8].keys() == {0, 1, 2}
    assert second.policy.acceptance.offered[0] >= first.policy.acceptance.offered[0] // 2
    blob = entries[0].read_bytes()
    entries[0].write_bytes(blob[: len(blob) // 2])
    with caplog.at_level("WARNING"):
        _, third = serve(cfg, 40)
    assert not third.seeded and entries[0].name in caplog.text
    _, fourth = serve(cfg, 1)
    assert fourth.seeded, "the corrupt entry was rebuilt"


def test_nothing_is_kept_where_learnings_are_off(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ASCEND_SPEC_KEEP_LEARNINGS", "0")
    serve(engine_config(tmp_path), 40)
    assert not list((tmp_path / "cache").glob("*.bin"))
