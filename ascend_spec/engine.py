"""Standalone harness: continuous batching over a paged cache, with or without MTP speculation.
A turn of its loop: the scheduler plans (``schedule``), the runner runs the plan, the scheduler takes the tokens back.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import EngineConfig, resolve_keep_learnings
from .graph.backends import Backend
from .graph.backends.compile_cache import CacheKey, open_default_cache
from .graph.model import DeepseekV3ForCausalLM
from .k_policy import AcceptanceTracker, KPolicy
from .kv_cache import BlockManager, KVCaches
from .learnings import Learnings, LearningsStore, learnings_key
from .metrics import RunStats, SpecMetrics
from .runner import ModelRunner
from .warmup import WarmupReport, dynamo_compile_count
from .sampling import GREEDY, RANDOM, SamplingParams, make_generator
from .scheduler import Scheduler, Sequence

__all__ = ["AcceptanceTracker", "Engine", "RequestOutput", "RunStats", "dynamo_compile_count", "load_engine"]

log = logging.getLogger(__name__)

#: ``learnings_key``'s flavour of this engine's entries (vLLM's drafter keeps its own)
LEARNINGS_FLAVOUR = "engine"


@dataclass(frozen=True)
class RequestOutput:
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    #: one {token_id: logprob} per generated token (top-N plus the sampled token) when asked for
    logprobs: list[dict[int, float]] | None = None


class Engine:
    def __init__(self, model: DeepseekV3ForCausalLM, cfg: EngineConfig, device: torch.device | str = "cpu",
                 count_host_syncs: bool = False) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = model.lm_head.weight.dtype
        mcfg = model.cfg
        if cfg.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's max_position_embeddings "
                             f"({mcfg.max_position_embeddings})")
        self.spec = cfg.speculative
        self.k_max = self.spec.num_speculative_tokens if self.spec else 0
        self.caches = KVCaches.allocate(mcfg, cfg.max_model_len, cfg.max_num_seqs, self.device,
                                        dtype=self.dtype, num_blocks=cfg.kv_blocks, block_size=cfg.block_size,
                                        layout=cfg.kv_layout)
        self.blocks = BlockManager(self.caches.allocator, cfg.max_model_len, cfg.block_size)
        self.k_policy = KPolicy(self.k_max, cfg.adaptive_k, tuple(cfg.graph.batch_sizes(cfg.max_num_seqs)),
                                cfg.fused_step)
        self.runner = ModelRunner(model, cfg, self.device, self.caches, self.k_policy, count_host_syncs)
        self.eos_token_id = mcfg.eos_token_id
        self._warm_modes: set[tuple[str, bool]] = set()
        self._compiles_at_warmup = 0
        self._pending_report: WarmupReport | None = None
        #: where adaptive K's learnings are kept (None: not kept), what was loaded (its step costs join warm-up's),
        #: and whether the policy's counts already hold the saved entry's (seeded from it, or saved once)
        self.learnings: tuple[LearningsStore, CacheKey] | None = None
        self._learned: Learnings | None = None
        self._learned_included = False
        self._open_learnings()

    # -- what the runner holds, for callers and tests --------------------------------------------------
    @property
    def backend(self) -> Backend:
        return self.runner.backend

    @property
    def backend_name(self) -> str:
        return self.runner.backend.name

    @property
    def proposer(self):  # noqa: ANN201 - MtpTorchairProposer | None
        return self.runner.proposer

    @property
    def spec_graphs(self):  # noqa: ANN201
        return self.runner.spec_graphs

    @property
    def target_graph(self):  # noqa: ANN201
        return self.runner.target_graph

    @property
    def step_seconds(self) -> dict[int, dict[int, float]]:
        return self.runner.step_seconds

    @property
    def force_k(self) -> int | None:
        return self.k_policy.force_k

    @force_k.setter
    def force_k(self, k: int | None) -> None:
        self.k_policy.force_k = k

    # -- warm-up ----------------------------------------------------------------------------------
    def warmup(self, progress: bool = True, modes: tuple[str, ...] = (GREEDY,), logprobs: bool = False,
               lone: bool = False, batched: bool = True, prompts: int | None = None) -> WarmupReport:
        """Compile the graphs a run with these sampling ``modes`` (and ``logprobs``) replays (see
        :meth:`GraphWarmup.run`; ``lone``: its first batch is one request, ``batched``: batches of several
        come, ``prompts``: how many); ``generate`` warms what its requests need on its own."""
        new = tuple(m for m in modes if (m, logprobs) not in self._warm_modes)
        report = WarmupReport()
        warm = self.runner.warm
        rows = lone and not warm.lone or batched and not warm.batched
        if new or rows or warm.prompts_unwarmed(prompts):
            held = self._held_costs()
            report = warm.run(progress=progress, modes=new or modes, logprobs=logprobs, lone=lone,
                              batched=batched, prompts=prompts)
            if held is not None:  # warm-up's rough figures fill in only what the run's (or an earlier's) lack
                held.seed(self.k_policy, acceptance=False)
            self._warm_modes.update((m, logprobs) for m in (new or modes))
            self._compiles_at_warmup = dynamo_compile_count()
            self._pending_report = report
        return report

    def time_step(self, bucket: int, k: int, context: int = 256, repeats: int = 5) -> float:
        return self.runner.warm.time_step(bucket, k, context, repeats)

    def warmup_for(self, params: list[SamplingParams], progress: bool = False, first_batch: int | None = None,
                   max_batch: int | None = None, prompts: int | None = None) -> WarmupReport:
        """Warm the graphs these requests will replay (nothing for what is already warm): greedy always (a batch
        turns greedy when its random requests finish), random sampling and logprobs graphs when asked for; the
        lone-request graphs when the first batch (``first_batch`` requests) is one, batch graphs unless no batch
        holds more than one (``max_batch``), the prompt graphs for a run of many ``prompts`` (see
        ``EngineConfig.warm_graphs``)."""
        if self.backend_name == "eager":
            return WarmupReport()
        modes = (GREEDY, RANDOM) if any(not p.is_greedy for p in params) else (GREEDY,)
        rows = {"lone": first_batch == 1, "batched": max_batch is None or max_batch > 1, "prompts": prompts}
        report = self.warmup(progress=progress, modes=modes, logprobs=False, **rows)
        if any(p.logprobs is not None for p in params):
            more = self.warmup(progress=progress, modes=modes, logprobs=True, **rows)
            report = WarmupReport(report.graphs_compiled + more.graphs_compiled,
                                  report.compile_seconds + more.compile_seconds,
                                  {**report.seconds_by_graph, **more.seconds_by_graph})
            self._pending_report = report
        return report

    # -- generation loop ------------------------------------------------------------------------
    def _check_requests(self, prompts: list[list[int]], params: SamplingParams | dict | list[SamplingParams | dict],
                        max_tokens: int | list[int], arrivals: list[int] | None
                        ) -> tuple[list[SamplingParams], list[int], list[int]]:
        if isinstance(params, (SamplingParams, dict)):
            params = [params] * len(prompts)
        params = [SamplingParams.from_dict(p) if isinstance(p, dict) else p for p in params]
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        if len(max_tokens) != len(prompts) or any(m < 1 for m in max_tokens):
            raise ValueError(f"max_tokens={max_tokens}; allowed: an int >= 1, or one per prompt")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if len(p) >= self.cfg.max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; max_model_len={self.cfg.max_model_len} "
                                 "leaves no room to generate")
            bad = [t for t in p if not 0 <= t < self.model.cfg.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, {self.model.cfg.vocab_size})")
        arrivals = [0] * len(prompts) if arrivals is None else list(arrivals)
        if len(arrivals) != len(prompts) or any(a < 0 for a in arrivals):
            raise ValueError(f"arrivals: got {len(arrivals)} for {len(prompts)} prompts; allowed: one step >= 0 each")
        return list(params), list(max_tokens), arrivals

    def generate(self, prompts: list[list[int]], params: SamplingParams | dict | list[SamplingParams | dict],
                 max_tokens: int | list[int], seed: int | None = None, arrivals: list[int] | None = None,
                 max_num_seqs: int | None = None, progress: bool = False
                 ) -> tuple[list[RequestOutput], RunStats, SpecMetrics | None]:
        """``params``: one request's settings for all, or one per prompt; a dict holds a client's keywords
        (:meth:`SamplingParams.from_dict`). ``arrivals``: the decode step at which each request arrives (default:
        all at step 0); an idle engine takes the next arrival at once. ``max_num_seqs``: at most this many requests
        run at once in this call (1 .. the engine's ``max_num_seqs``, its default); the others wait and join as
        requests finish.
        ``progress``: a bar on stderr while graphs compile or load."""
        params, max_tokens, arrivals = self._check_requests(prompts, params, max_tokens, arrivals)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed={seed!r}; allowed: None or an integer >= 0 (the run's random generator)")
        limit = self.cfg.max_num_seqs if max_num_seqs is None else max_num_seqs
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= self.cfg.max_num_seqs:
            raise ValueError(f"max_num_seqs={max_num_seqs!r}; allowed: an int in 1..{self.cfg.max_num_seqs} "
                             "(the engine's max_num_seqs)")
        start = time.perf_counter()
        first = [a for a in arrivals if a == min(arrivals)]
        hints = {"first_batch": min(limit, len(first)), "max_batch": min(limit, len(prompts)),
                 "prompts": len(prompts), "progress": progress}
        stats = RunStats(backend=self.backend_name)
        # ``warm_graphs: first`` with eager prompts: the first tokens come before the decode graphs load or
        # compile (a one-token request needs none); any other run warms before its first prefill.
        warm_later = self.cfg.warm_graphs == "first" and not self.runner.warm.prompts_unwarmed(len(prompts))
        if not warm_later:
            self._warm(params, hints, stats)
        generator = make_generator(seed, self.device)
        seqs = [Sequence(i, list(p), sp, mt) for i, (p, sp, mt) in enumerate(zip(prompts, params, max_tokens))]
        sched = Scheduler(self.blocks, self.cfg.max_model_len, limit, self.k_policy, self.eos_token_id,
                          warm=self.runner.warm)
        sched.add(seqs, arrivals)
        metrics = SpecMetrics(self.k_max) if self.k_max else None
        compiles_before = dynamo_compile_count()
        deferred_before = (self.runner.warm.deferred_compiles, self.runner.warm.deferred_seconds)
        failures_before = self.runner.graphs.num_failures()
        loop_start = time.perf_counter()
        while not sched.done:
            if warm_later and sched.running:
                loop_start += self._warm(params, hints, stats)  # warm-up is not decoding time
                warm_later = False
            plan = sched.schedule(stats.num_steps)
            t0 = time.perf_counter()
            out = self.runner.run(plan, generator, stats)
            if plan.admitted:
                stats.prefill_seconds += time.perf_counter() - t0
                if not stats.generated_tokens:
                    stats.first_token_seconds = time.perf_counter() - start
            elif plan.running:
                stats.num_steps += 1
                stats.request_steps += len(plan.running)
            stats.preemptions += len(plan.preempted)
            stats.generated_tokens += sched.postprocess(plan, out, metrics)
        stats.decode_seconds = time.perf_counter() - loop_start
        stats.k_by_bucket = self.runner.end_run()
        stats.graph_failures = self.runner.graphs.num_failures() - failures_before
        stats.graph_host_ops = len(self.backend.lint.findings)
        stats.deferred_compiles = self.runner.warm.deferred_compiles - deferred_before[0]
        stats.deferred_compile_seconds = self.runner.warm.deferred_seconds - deferred_before[1]
        if self._warm_modes:  # the graphs warm-up deferred to their first use are planned compiles, not recompiles
            stats.recompiles_after_warmup = (dynamo_compile_count() - max(compiles_before, self._compiles_at_warmup)
                                             - stats.deferred_compiles)
        outputs = [RequestOutput(s.prompt_ids, s.output_ids, s.finish_reason or "length", s.logprobs) for s in seqs]
        self.save_learnings()
        return outputs, stats, metrics

    # -- learnings: what adaptive K learned, kept across runs (``ascend_spec.learnings``) ----------------------
    def _open_learnings(self) -> None:
        """Seed the K policy's acceptance from this model's and host's saved learnings (their step costs join
        warm-up's when it has timed the steps). Adaptive K with the compile cache on."""
        if not (self.k_policy.adaptive and resolve_keep_learnings(self.cfg.keep_learnings)):
            return
        cache = self.runner.graphs.compile_cache or open_default_cache(inductor=False)
        if cache is None:
            return
        key = learnings_key(self.model.cfg.to_hf_dict(), self.model, k_max=self.k_max, dtype=self.dtype,
                            backend=self.backend_name, batch_sizes=self.k_policy.batch_sizes,
                            flavour=LEARNINGS_FLAVOUR, device=self.device)
        self.learnings = store, key = LearningsStore(cache), key
        self._learned = store.load(key)
        if self._learned is not None:
            self._learned.seed(self.k_policy)
            self._learned_included = True

    def _held_costs(self) -> Learnings | None:
        """The step costs a warm-up must not replace: the run's own once it has some, else the loaded ones."""
        if self.learnings is None:
            return None
        return Learnings.from_policy(self.k_policy) if self.k_policy.step_seconds else self._learned

    def save_learnings(self) -> Path | None:
        """Save what adaptive K has learned (``generate`` does at its end); None when nothing is kept: learnings
        off, nothing learned, or a forced K (its runs are not the policy's)."""
        if self.learnings is None or self.k_policy.force_k is not None:
            return None
        store, key = self.learnings
        learned = Learnings.from_policy(self.k_policy)
        if not learned.learned_anything():
            return None
        if not self._learned_included:  # an entry saved since this engine started (another process): combine
            earlier = store.load(key)
            learned = learned.merge(earlier) if earlier is not None else learned
        try:
            path = store.save(key, learned)
        except OSError as exc:  # a full disk must not fail a run that has produced its tokens
            log.warning("learnings: could not save %s (%s); the next run learns afresh", key.what, exc)
            return None
        self._learned_included = True
        return path

    def _warm(self, params: list[SamplingParams], hints: dict, stats: RunStats) -> float:
        """Warm what this run's requests replay (``warmup_for``) into ``stats``; returns the seconds it took."""
        t0 = time.perf_counter()
        self.warmup_for(params, **hints)
        if self._pending_report is not None:
            stats.graphs_compiled = self._pending_report.graphs_compiled
            stats.compile_seconds = self._pending_report.compile_seconds
            self._pending_report = None
        return time.perf_counter() - t0


def load_engine(model_dir: str | Path, cfg: EngineConfig, device: str = "cpu", count_host_syncs: bool = False,
                dtype: str | torch.dtype | None = None) -> Engine:
    """``dtype``: float32 | bfloat16 | float16; default the checkpoint's ``torch_dtype``."""
    from .graph.weights import load_model

    return Engine(load_model(model_dir, device=device, dtype=dtype), cfg, device=device,
                  count_host_syncs=count_host_syncs)
