"""vLLM's batch-size -> K schedule kept current from measurements (``k_schedule: auto``), in the scheduler's process.
The scheduler reads K from ``dynamic_sd_lookup[batch]``; its own clock and the tokens it gets back feed the policy.
"""
from __future__ import annotations

import logging
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from ascend_spec.config import resolve_keep_learnings
from ascend_spec.graph.backends.compile_cache import open_default_cache
from ascend_spec.k_policy import in_step_share
from ascend_spec.k_schedule import MeasuredSchedule
from ascend_spec.learnings import LearningsStore, learnings_key

from .manifest import covers
from .settings import METHODS, PluginSettings
from .shims import installed_vllm_version

logger = logging.getLogger("vllm.ascend_spec.schedule")  # manifest: ignore (our logger name)

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
#: seconds between saves of what the schedule learned while serving (and at the scheduler's shutdown)
SAVE_EVERY_S = 60.0

#: every measured schedule installed in this process (the harness and benchmarks read them)
LIVE_SCHEDULES: list[weakref.ref] = []

#: whether the model runner in use hands each step's K to our drafter (vllm-ascend's does from a release on; the
#: platform's install sets the check). Where it does not, K stays fixed: a step must draft what was scheduled.
runner_passes_k: Callable[[], bool] = lambda: True


@covers("dynamic_k_schedule")
def has_k_schedule(spec: Any) -> bool:
    """Whether this vLLM schedules K per batch size (the config field and the scheduler's lookup come together)."""
    return hasattr(spec, "num_speculative_tokens_per_batch_size")


def user_schedule(spec: Any) -> list | None:
    """The batch-size -> K schedule the user wrote, if any."""
    return spec.num_speculative_tokens_per_batch_size or None if has_k_schedule(spec) else None


def schedule_mode(vllm_config: Any) -> str:
    """``auto`` (ours keeps the schedule), ``user`` (the user's ``num_speculative_tokens_per_batch_size``, as
    written), ``fixed`` (K = num_speculative_tokens every step) or ``off`` (ours not enabled)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.method not in METHODS:
        return "off"
    settings = PluginSettings.from_additional_config(vllm_config.additional_config)
    if not settings.enabled:
        return "off"
    if user_schedule(spec):
        return "user"
    # Every data-parallel rank must draft the same K in a step (their MoE collectives pair): vLLM refuses a
    # per-batch-size schedule there, and so does ours.
    if settings.k_schedule == "fixed" or vllm_config.parallel_config.data_parallel_size > 1 \
            or not has_k_schedule(spec):
        return "fixed"
    return "auto" if runner_passes_k() else "fixed"


def draft_ks(vllm_config: Any, k_max: int) -> tuple[int, ...]:
    """The K values a step may ask our drafter for (each needs its draft chain's graphs)."""
    mode = schedule_mode(vllm_config)
    if mode == "auto":
        return tuple(range(k_max + 1))
    if mode == "user":
        written = user_schedule(vllm_config.speculative_config)
        return tuple(sorted({min(int(entry[2]), k_max) for entry in written} | {k_max}))
    return (k_max,)


class MeasuredLookup(list):
    """Stands in for the scheduler's dense ``dynamic_sd_lookup``: the scheduler indexes it once per step by the
    step's batch size, and the schedule answers then (a list, so vLLM's ``is None`` and length checks hold)."""

    def __init__(self, schedule: MeasuredSchedule, scheduler: Any) -> None:
        super().__init__([schedule.k_max] * (schedule.max_batch + 1))
        self.schedule = schedule
        self._scheduler = weakref.ref(scheduler)

    def __getitem__(self, batch: Any) -> Any:
        if not isinstance(batch, int):
            return super().__getitem__(batch)
        scheduler = self._scheduler()
        running = scheduler.running if scheduler is not None else []
        # vLLM's requests carry max_tokens, as ours do (manifest item Request.max_tokens)
        return self.schedule.k_for(batch, in_step_share(running) if running else 1.0)


class StepClock:
    """A step's seconds, read in the scheduler's process: from the update of the step before to this one's. A step
    scheduled well after the one before was taken back (the engine sat idle) is not timed."""

    def __init__(self) -> None:
        self._last_update: float | None = None
        self._scheduled_at: dict[int, float] = {}

    def scheduled(self, output: Any) -> None:
        self._scheduled_at[id(output)] = time.perf_counter()

    def updated(self, output: Any) -> float | None:
        now = time.perf_counter()
        at, last = self._scheduled_at.pop(id(output), None), self._last_update
        self._last_update = now
        if at is None or last is None:
            return None
        period = now - last
        return None if at - last > 0.5 * period else period


def observe_step(schedule: MeasuredSchedule, scheduler_output: Any, model_runner_output: Any,
                 seconds: float | None) -> None:
    """What one step verified and cost: acceptance per request, and the step's seconds where it was a clean decode
    step (every request verified its drafts and nothing else; none new)."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    sampled = model_runner_output.sampled_token_ids
    index = model_runner_output.req_id_to_index
    for req_id, drafts in spec.items():
        i = index.get(req_id)
        if drafts and i is not None and i < len(sampled) and len(sampled[i]):
            schedule.record(len(drafts), len(sampled[i]) - 1)
    scheduled = scheduler_output.num_scheduled_tokens
    if seconds is None or not scheduled or scheduler_output.scheduled_new_reqs:
        return
    verified = {len(spec.get(r, ())) for r in scheduled}
    if len(verified) != 1 or any(n != 1 + len(spec.get(r, ())) for r, n in scheduled.items()):
        return
    k = scheduler_output.num_spec_tokens_to_schedule
    schedule.observe(len(scheduled), k, seconds, switched=verified != {k})


class KeptLearnings:
    """A schedule's learnings in our compile cache, keyed by what makes them hold for another run of this engine:
    the model and its weights, vLLM's version and runner, compile mode, parallelism, dtype, K_max and buckets, the
    host. Loaded at the scheduler's start, saved every ``SAVE_EVERY_S`` while serving and at its shutdown."""

    def __init__(self, vllm_config: Any, schedule: MeasuredSchedule) -> None:
        self.store = LearningsStore(open_default_cache(inductor=False) if resolve_keep_learnings(None) else None)
        self.schedule = schedule
        self.key = learnings_key(engine_identity(vllm_config), model_weights(vllm_config), k_max=schedule.k_max,
                                 dtype=vllm_config.model_config.dtype, backend="vllm",
                                 batch_sizes=schedule.policy.batch_sizes,
                                 flavour="vllm-v2" if getattr(vllm_config, "use_v2_model_runner", False) else "vllm-v1")
        self._saved = time.monotonic()

    def load(self) -> bool:
        learned = self.store.load(self.key)
        if learned is not None:
            self.schedule.seed(learned)
        return learned is not None

    def maybe_save(self) -> None:
        if time.monotonic() - self._saved >= SAVE_EVERY_S:
            self.save()

    def save(self) -> None:
        self._saved = time.monotonic()
        learned = self.schedule.learnings()
        if not learned.learned_anything():
            return
        try:
            self.store.save(self.key, learned)
        except OSError as exc:  # a full disk must not stop the engine serving
            logger.warning("ascend_spec: could not save %s (%s); the next start learns afresh", self.key.what, exc)


def engine_identity(vllm_config: Any) -> dict[str, Any]:
    """What of the engine sets a step's cost, besides the host and the weights: the learnings key's model part."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return {"model": str(model.model), "max_model_len": model.max_model_len, "quantization": model.quantization or "",
            "enforce_eager": bool(model.enforce_eager), "vllm": installed_vllm_version(),
            "tp": parallel.tensor_parallel_size, "async": bool(vllm_config.scheduler_config.async_scheduling)}


def model_weights(vllm_config: Any) -> Any:
    """The checkpoint folder (its files fingerprint the weights), else the model's name and revision."""
    model = vllm_config.model_config
    folder = Path(str(model.model))
    return folder if folder.is_dir() else f"{model.model}@{model.revision or 'main'}"


def install(scheduler: Any) -> MeasuredSchedule | None:
    """Ours keeps ``scheduler``'s batch-size -> K schedule (``k_schedule: auto``); None where it does not."""
    cfg = scheduler.vllm_config
    if schedule_mode(cfg) != "auto" or not scheduler.num_spec_tokens:
        return None
    schedule = MeasuredSchedule(scheduler.num_spec_tokens, cfg.scheduler_config.max_num_seqs)
    kept = KeptLearnings(cfg, schedule)
    seeded = schedule.seeded = kept.load()
    scheduler.dynamic_sd_lookup = MeasuredLookup(schedule, scheduler)
    clock = StepClock()
    scheduler.schedule = _timed_schedule(scheduler.schedule, clock)
    scheduler.update_from_output = _observed_update(scheduler.update_from_output, clock, schedule, kept)
    scheduler.shutdown = _saving_shutdown(scheduler.shutdown, kept)
    LIVE_SCHEDULES.append(weakref.ref(schedule))
    logger.info("ascend_spec: K per batch size from measured step costs and acceptance (K in 0..%d, buckets %s; %s)",
                schedule.k_max, list(schedule.policy.batch_sizes),
                "started from what an earlier run learned" if seeded else "learning afresh")
    return schedule


def _saving_shutdown(shutdown_fn: Callable[..., Any], kept: KeptLearnings) -> Callable[..., Any]:
    def shutdown(*args: Any, **kwargs: Any) -> Any:
        kept.save()
        return shutdown_fn(*args, **kwargs)

    return shutdown


def _timed_schedule(schedule_fn: Callable[..., Any], clock: StepClock) -> Callable[..., Any]:
    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule_fn(*args, **kwargs)
        clock.scheduled(out)
        return out

    return schedule


def _observed_update(update_fn: Callable[..., Any], clock: StepClock, schedule: MeasuredSchedule,
                     kept: KeptLearnings) -> Callable[..., Any]:
    def update_from_output(scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any) -> Any:
        observe_step(schedule, scheduler_output, model_runner_output, clock.updated(scheduler_output))
        kept.maybe_save()
        return update_fn(scheduler_output, model_runner_output, *args, **kwargs)

    return update_from_output


def patch_scheduler(module: Any) -> None:
    """Wrap ``module.Scheduler.__init__`` (its async subclass inherits it) to install the measured schedule."""
    cls = module.Scheduler
    if getattr(cls.__init__, "__ascend_spec_schedule__", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        install(self)

    __init__.__ascend_spec_schedule__ = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def live_schedules(refs: list[weakref.ref] | None = None) -> list[dict[str, Any]]:
    """Each live schedule's state (of ``refs``, default all): K chosen per bucket, steps per (bucket, K), step
    costs, acceptance."""
    out = []
    for s in (r() for r in (LIVE_SCHEDULES if refs is None else refs)):
        if s is not None:
            out.append({"seeded": s.seeded, "chosen": s.chosen(), "steps": {f"{b}:{k}": n for (b, k), n in sorted(s.steps.items())},
                        "step_seconds": {b: dict(c) for b, c in s.policy.step_seconds.items()},
                        "acceptance": s.policy.acceptance.rates(), "offered": list(s.policy.acceptance.offered)})
    return out
