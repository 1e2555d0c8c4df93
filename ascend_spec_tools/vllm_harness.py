"""Run vLLM engine configurations in one process and report token ids, counters and timings as JSON.

    python -m ascend_spec_tools.vllm_harness CONFIGS.json --out RESULTS.json

``CONFIGS.json`` is a list of runs; each builds one offline ``LLM`` on the same checkpoint with the same
engine settings (:data:`ENGINE`), generates greedily and is torn down before the next. Keys of a run:

``name``; ``checkpoint`` (default: the process's); ``drafter``: ``none`` (no speculation) | ``vllm`` (vLLM's own deepseek_mtp) | ``ours``
(``additional_config={"ascend_spec": {...}}``; with ``vllm``, an ``ascend`` block only records stats);
``k``; ``spec`` (more ``speculative_config`` keys); ``async``: true forces async scheduling on (see
below); ``prompts``; ``max_tokens`` (int or one per prompt); ``llm`` (more ``LLM`` kwargs, e.g.
``max_num_seqs``, ``num_gpu_blocks_override``); ``graph`` (``torchair_graph_config``); ``ascend``
(more ``ascend_spec`` keys); ``repeat`` (generate calls; timings of each are reported);
``break_api`` (``"EagleProposer.<method>"``: delete that vLLM method first, to see the probe fail); ``unreach``
(``v1`` | ``v2``: undo our patch of that runner's drafter seam, to see the engine refuse to start); ``env``
(environment variables set for this run only, e.g. ``VLLM_CPU_OMP_THREADS_BIND`` for a tensor-parallel run);
``inject_bug`` (``"next_token_at_optimistic_length"``: our drafter reads its next token at the optimistic host
length, see :func:`_inject_bug`; for showing that the acceptance gate catches a broken drafter);
``async_exact_lengths``: ``all`` (default) | ``target`` (see below); ``measure_memory``: report
``live_tensor_bytes``, the unique storage bytes of every tensor alive in this process after generating;
``fail_draft_graph_calls``: make our drafter's compiled graph calls with these numbers (1-based, after warm-up)
raise once they ran (:mod:`ascend_spec_tools.fault_injection`), to see each such step rerun eagerly;
``requests``: requests as clients send them, each ``{"prompt": ..., "params": {...}}`` with vLLM
``SamplingParams`` keywords (``structured_outputs`` a dict of ``StructuredOutputsParams`` keywords), in place of
``prompts`` / ``max_tokens`` / ``logprobs``; the result's ``outputs`` holds every completion of each request (``n``),
its text, finish reason and logprobs, once per ``repeat``; ``unmend_cpu_sampler``: leave vLLM-cpu's replacement of
the rejection sampler's ``expand_kernel`` as vLLM registered it (:mod:`ascend_spec.compat.shims_sampling`), to see
what the shim mends.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which makes engine starts
cheap and lets the run read the drafter's own timers.

``--runner v1|v2`` picks vLLM's model runner for every run of the process (:func:`runner_env`): V2 runs on this
CPU with Triton's interpreter executing its kernels (``tools/triton_cpu``); the process re-executes itself with
that environment when it lacks it. Each result's ``runner`` says which runner the engine built.

Data parallel (``--dp-size N --dp-rank R --dp-port P --dp-barrier DIR``): one process per rank, as vLLM runs
offline DP, each with the engine core in a process of its own (an idle rank's core runs the lockstep dummy
steps); the run's ``rank_prompts`` lists, per rank, the indices into ``prompts`` that rank generates. Each rank
waits at a file barrier in DIR before tearing its engine down, so that no rank leaves a collective unpaired.
:func:`run_dp` launches the ranks of one run (the tests and ``tools/bench_vllm.py --dp 2`` call it).

Async scheduling on CPU: vLLM's ``CpuPlatform.check_and_update_config`` sets
``scheduler_config.async_scheduling = False`` unconditionally ("not required on CPU"). For ``async: true``
runs this harness wraps that method (in this process only, test use only) to restore the value vLLM chose
before it, which is True for MTP unless the user passed ``async_scheduling=False``. Async scheduling also
needs one CPU-only correction to be right: CPU_MLA builds a verify query (1 + K tokens) as a prefill and
takes its context length from ``seq_lens_cpu_upper_bound``, which async scheduling makes optimistic (it
counts last step's drafts as accepted), so the target and vLLM's own drafter would attend past the real
context (the outputs then differ from no speculation, with vLLM's drafter as with ours). On CPU the exact
``seq_lens`` are host memory, so the harness gives the builder those. With ``async_exact_lengths: target``
only the target's metadata is corrected and vLLM's drafter keeps the optimistic lengths (the seed bug's
condition; our drafter never reads them).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ascend_spec.models import __file__ as _models_init

# The small trained fixture: vLLM starts an engine per configuration, and a 2-layer model keeps that quick.
CHECKPOINT = str(Path(_models_init).resolve().parent / "tiny-dsv3-2l-mtp")
BUNDLED_CHECKPOINT = str(Path(_models_init).resolve().parent / "tiny-dsv3-mtp")

#: engine settings shared by every run (the same for both drafters)
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 16,
    "max_model_len": 512,
    "gpu_memory_utilization": 0.3,
    "seed": 0,
    "enforce_eager": True,
    "disable_log_stats": False,
    # fp32 on an AMX CPU needs CPU_MLA (AMX_MLA has no fp32 path), here and in speculative_config.
    "attention_backend": "CPU_MLA",
    # vLLM-cpu 0.32's C++ rotary_embedding op gives batch-dependent results for MLA's strided q_pe;
    # the op's native torch path is exact and batch-invariant (matches our reference to 1e-4 nats).
    "compilation_config": {"custom_ops": ["all", "-rotary_embedding"]},
}

PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "try:\n    import json\nexcept ImportError:\n",
]

_FORCE_ASYNC = {"on": False, "effective": None, "exact": "all", "drafting": False}


def _install_force_async() -> None:
    """Test-only: async scheduling on CPU (keep vLLM's choice; exact context lengths for CPU_MLA prefills)."""
    from vllm.platforms.cpu import CpuPlatform

    orig = CpuPlatform.check_and_update_config.__func__
    if getattr(orig, "_ascend_spec_force_async", False):  # manifest: ignore (our own marker)
        return

    def check_and_update_config(cls, vllm_config):
        keep = vllm_config.scheduler_config.async_scheduling
        orig(cls, vllm_config)
        if _FORCE_ASYNC["on"] and keep:
            vllm_config.scheduler_config.async_scheduling = True
        _FORCE_ASYNC["effective"] = bool(vllm_config.scheduler_config.async_scheduling)

    check_and_update_config._ascend_spec_force_async = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

    # CPU_MLA treats a verify query (1 + K tokens) as a prefill and takes its context length from
    # seq_lens_cpu_upper_bound, which async scheduling makes optimistic (drafts assumed accepted): the target
    # and vLLM's own drafter then attend past the real context. On CPU the exact seq_lens already live in
    # host memory, so hand the builder those (what a device build gets from its decode path).
    from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder

    build = MLACommonMetadataBuilder.build
    build_for_drafting = MLACommonMetadataBuilder.build_for_drafting

    def exact_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        st = _FORCE_ASYNC
        if st["on"] and common_attn_metadata.seq_lens.device.type == "cpu" and (
                st["exact"] == "all" or not st["drafting"]):
            common_attn_metadata = dataclasses.replace(
                common_attn_metadata, seq_lens_cpu_upper_bound=common_attn_metadata.seq_lens.clone())
        return build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)

    def drafting_build(self, *args, **kwargs):
        _FORCE_ASYNC["drafting"] = True
        try:
            return build_for_drafting(self, *args, **kwargs)
        finally:
            _FORCE_ASYNC["drafting"] = False

    MLACommonMetadataBuilder.build = exact_build
    MLACommonMetadataBuilder.build_for_drafting = drafting_build


def _break_api(spec: str):
    """Delete ``EagleProposer.<method>`` from the class in its MRO that defines it; returns an undo."""
    from ascend_spec.compat.shims import eagle_proposer_class

    cls_name, _, attr = spec.partition(".")
    assert cls_name == "EagleProposer", spec
    for klass in eagle_proposer_class().__mro__:
        if attr in vars(klass):
            saved = vars(klass)[attr]
            delattr(klass, attr)
            return lambda: setattr(klass, attr, saved)
    raise ValueError(f"{spec}: not found")


def _unreach(runner: str):
    """Test-only: undo our patch of ``runner``'s drafter seam, and keep the plugin from making it again, as a release
    whose seam moved would; returns an undo. The engine must then fail at start (``runner_reach.check_reached``),
    never draft with vLLM's drafter in our name."""
    import vllm.v1.worker.gpu_model_runner as gmr

    from ascend_spec.compat import plugin, runner_reach
    from ascend_spec.compat.shims_v2 import V2_RUNNER_MODULE, V2_SEAM

    if runner == "v1":
        build, current = plugin.build_adapter_class, gmr.EagleProposer
        plugin.build_adapter_class = lambda base: base
        gmr.EagleProposer = getattr(current, "vllm_base", current)  # manifest: ignore (our adapter's attribute)

        def undo_v1() -> None:
            plugin.build_adapter_class, gmr.EagleProposer = build, current

        return undo_v1
    wrap = runner_reach.patched_init_speculator
    runner_reach.patched_init_speculator = lambda original: original
    module = importlib.import_module(V2_RUNNER_MODULE)
    current = getattr(module, V2_SEAM)
    setattr(module, V2_SEAM, getattr(current, runner_reach.PATCHED, current))

    def undo_v2() -> None:
        runner_reach.patched_init_speculator = wrap
        setattr(module, V2_SEAM, current)

    return undo_v2


INJECTABLE_BUGS = ("next_token_at_optimistic_length",)


#: set (by the suite's planted defect ``cpu_sampler_unmended``): every run of this process is ``unmend_cpu_sampler``
UNMEND_ENV = "ASCEND_SPEC_HARNESS_UNMEND_CPU_SAMPLER"
#: set (by the suite's planted defect ``k0_writes_late``): our drafter writes held K = 0 cache entries only when
#: their buffer fills or the batch changes, not before the next draft reads the cache
K0_WRITES_LATE_ENV = "ASCEND_SPEC_HARNESS_K0_WRITES_LATE"
K0_LEAN_WRONG_TOKEN_ENV = "ASCEND_SPEC_HARNESS_K0_LEAN_WRONG_TOKEN"


def _k0_writes_late() -> None:
    from ascend_spec.compat.draft_core import DraftCoreMixin

    DraftCoreMixin._flush_k0 = lambda self: None


def _k0_lean_wrong_token() -> None:
    import torch

    from ascend_spec.compat.drafter import AscendSpecMtpMixin

    held = AscendSpecMtpMixin._hold_lean_k0

    def hold(self, next_token_ids, *rest):
        # the defect: the step's draft cache entries held with a token other than the one sampled
        return held(self, torch.zeros_like(next_token_ids), *rest)

    AscendSpecMtpMixin._hold_lean_k0 = hold


def _client_params(kw: dict[str, Any]):
    """vLLM ``SamplingParams`` from a run's JSON keywords (``structured_outputs``: a dict of its keywords)."""
    from vllm import SamplingParams

    kw = dict(kw)
    if "structured_outputs" in kw:
        from vllm.sampling_params import StructuredOutputsParams

        kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    return SamplingParams(**kw)


def _completions(out: Any) -> list[dict[str, Any]]:
    """Every completion of one request: token ids, text, finish reason, and each position's logprobs if asked."""
    return [{"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in c.logprobs or []]}
            for c in out.outputs]


def _unmend_cpu_sampler():
    """Test-only: our drafter leaves vLLM-cpu's rejection sampling as vLLM ships it (its ``expand_kernel``
    replacement, its top-k without drafts); returns an undo. Patched in this process only, on
    ``ascend_spec.compat.draft_core``'s module globals (and a top-k guard an earlier engine put in place, removed)."""
    import importlib

    from ascend_spec.compat import draft_core, shims_sampling

    saved = draft_core.mend_cpu_rejection_sampler, draft_core.mend_empty_top_k
    top_k = importlib.import_module(shims_sampling.TOP_K_MODULE)
    guarded = top_k.apply_top_k_only
    top_k.apply_top_k_only = getattr(guarded, "__wrapped__", guarded)
    draft_core.mend_cpu_rejection_sampler = lambda: "left as vLLM registered it (unmend_cpu_sampler)"
    draft_core.mend_empty_top_k = lambda: False

    def undo() -> None:
        draft_core.mend_cpu_rejection_sampler, draft_core.mend_empty_top_k = saved
        top_k.apply_top_k_only = guarded

    return undo


def _inject_bug(name: str):
    """Test-only: break our drafter the way the seed did (a read at the optimistic length); returns an undo.

    ``next_token_at_optimistic_length``: the fallback token is read at the runner's optimistic host sequence
    length (the seed bug's read: under async scheduling that index holds a ``-1`` draft placeholder or a
    rejected draft) and used as every request's next token. In vLLM the fallback alone only reaches
    discarded requests, whose drafts are thrown away, so the read is made to feed every request to show in
    acceptance. Patched in this process only, on ``ascend_spec.compat.drafter``'s module globals.
    """
    import types

    import torch

    from ascend_spec.compat import drafter as drafter_mod
    from ascend_spec.compat.shims import host_seq_lens_upper_bound

    if name not in INJECTABLE_BUGS:
        raise ValueError(f"inject_bug: {name!r} is not one of {INJECTABLE_BUGS}")
    saved_backup, saved_spec = drafter_mod.backup_next_token_ids, drafter_mod.spec_decode

    def optimistic_backup(requests, input_batch, num_reqs):
        runner = next(d.runner for d in (r() for r in drafter_mod.LIVE)
                      if d is not None and getattr(d.runner, "input_batch", None) is input_batch)
        upper = host_seq_lens_upper_bound(runner, num_reqs)
        ids = [requests[input_batch.req_ids[i]].get_token_id(int(upper[i]) - 1) for i in range(num_reqs)]
        return torch.tensor(ids, dtype=torch.int32).clamp(min=0)  # a -1 placeholder would crash the embedding

    def next_is_backup(sampled, discard_mask, backup, vocab_size):
        _, count = saved_spec.prepare_next_token_ids_padded(sampled, discard_mask, backup, vocab_size)
        return backup.to(sampled.dtype), count

    drafter_mod.backup_next_token_ids = optimistic_backup
    drafter_mod.spec_decode = types.SimpleNamespace(**{**vars(saved_spec),
                                                      "prepare_next_token_ids_padded": next_is_backup})

    def undo() -> None:
        drafter_mod.backup_next_token_ids, drafter_mod.spec_decode = saved_backup, saved_spec

    return undo


def live_tensor_bytes() -> int:
    """Bytes of the unique storages of all live (non-meta) tensors in this process.

    Weights that vLLM-CPU keeps only inside oneDNN GEMM handles are no Python tensors and are not counted:
    compare two engines of the same checkpoint, not this figure with the checkpoint size.
    """
    # vLLM gc.freeze()s what exists after start-up; frozen objects are invisible to gc.get_objects().
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    gc.collect()
    with warnings.catch_warnings():  # touching every tensor's storage warns for some subclasses; not ours to fix
        warnings.simplefilter("ignore")
        total = _sum_storages(gc.get_objects())
    if frozen:
        gc.freeze()
    return total


def _sum_storages(objects: list) -> int:
    import torch

    seen: set[int] = set()
    total = 0
    for obj in objects:
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # FakeTensors left by tracing, storage-less subclasses
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def _metrics(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") or m.name == "vllm:num_preemptions":
            key = m.name.split(":", 1)[1]
            out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


TRITON_CPU = Path(__file__).resolve().parents[1] / "tools" / "triton_cpu"
RUNNERS = ("v1", "v2")


def runner_env(runner: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) for vLLM's ``runner`` model runner: V1, or V2 with Triton's interpreter
    running its kernels here (the stand-in CPU backend of ``tools/triton_cpu`` on ``PYTHONPATH``)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r}; allowed: {list(RUNNERS)}")
    env = dict(os.environ if env is None else env)
    if runner == "v1":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        return env
    if not (TRITON_CPU / "sitecustomize.py").is_file():
        raise FileNotFoundError(f"runner 'v2' on CPU needs {TRITON_CPU} (a source checkout)")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(VLLM_USE_V2_MODEL_RUNNER="1", TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(TRITON_CPU), *[p for p in paths if p != str(TRITON_CPU)]]))
    return env


def _engine_runner(llm: Any) -> str:
    return "v2" if llm.llm_engine.vllm_config.use_v2_model_runner else "v1"


def run_one(cfg: dict[str, Any], checkpoint: str = CHECKPOINT, before_teardown: Any = None) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from ascend_spec.compat import drafter as drafter_mod
    from ascend_spec.compat import schedule_k

    name = cfg.get("name", "run")
    kind = cfg.get("drafter", "none")
    checkpoint = cfg.get("checkpoint", checkpoint)
    prompts = cfg.get("prompts") or PROMPTS
    kw: dict[str, Any] = {**ENGINE, **cfg.get("llm", {}), "model": checkpoint}
    if kind != "none":
        kw["speculative_config"] = {"method": "deepseek_mtp", "num_speculative_tokens": int(cfg.get("k", 2)),
                                    "attention_backend": ENGINE["attention_backend"], **cfg.get("spec", {})}
    if kind == "ours":
        # K stays fixed unless a configuration asks for the measured schedule: most subjects compare acceptance
        # counts across runs, which a schedule following the clock would move
        kw["additional_config"] = {"ascend_spec": {"enabled": True, "k_schedule": "fixed", **cfg.get("ascend", {})},
                                   "torchair_graph_config": cfg.get("graph", {})}
    elif kind == "vllm" and cfg.get("ascend"):  # vLLM's drafter, with our adapter only recording (stats_dir)
        kw["additional_config"] = {"ascend_spec": {**cfg["ascend"], "enabled": False}}
    if not cfg.get("async", False):
        kw.setdefault("async_scheduling", False)
    _FORCE_ASYNC["on"] = bool(cfg.get("async", False))
    _FORCE_ASYNC["effective"] = None
    _FORCE_ASYNC["exact"] = cfg.get("async_exact_lengths", "all")
    max_tokens = cfg.get("max_tokens", 48)
    per_prompt = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=cfg.get("logprobs"))
              for n in per_prompt]
    if cfg.get("requests"):
        prompts = [r["prompt"] for r in cfg["requests"]]
        params = [_client_params(r.get("params", {})) for r in cfg["requests"]]
    result: dict[str, Any] = {"name": name, "config": cfg}
    undo = _break_api(cfg["break_api"]) if cfg.get("break_api") else None
    undo_reach = _unreach(cfg["unreach"]) if cfg.get("unreach") else None
    saved_env = {k: os.environ.get(k) for k in cfg.get("env", {})}
    os.environ.update(cfg.get("env", {}))
    undo_bug = _inject_bug(cfg["inject_bug"]) if cfg.get("inject_bug") else None
    undo_mend = _unmend_cpu_sampler() if cfg.get("unmend_cpu_sampler") or os.environ.get(UNMEND_ENV) else None
    n_live = len(drafter_mod.LIVE)
    n_schedules = len(schedule_k.LIVE_SCHEDULES)
    llm = None
    # vLLM collects the whole heap several times while an engine starts (weight loading, memory profiling): what
    # this process already holds (imports, earlier runs' compiled graphs) is frozen out of those scans, as vLLM
    # freezes its own heap once started. No collection first: the last run ended with one, and whatever is frozen
    # is thawed and collected when this run ends.
    gc.freeze()
    t0 = time.perf_counter()
    try:
        llm = LLM(**kw)
        result["startup_seconds"] = time.perf_counter() - t0
        result["runner"] = _engine_runner(llm)
        if cfg.get("fail_draft_graph_calls"):
            from ascend_spec_tools.fault_injection import inject_graph_faults

            for d in (r() for r in drafter_mod.LIVE[n_live:]):
                if d is not None and d._ascend is not None:
                    inject_graph_faults(d._ascend.graph, cfg["fail_draft_graph_calls"])
        result["async_scheduling"] = _FORCE_ASYNC["effective"]
        gen, outs, snapshots = [], None, []
        for _ in range(int(cfg.get("repeat", 1))):
            t1 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            gen.append(time.perf_counter() - t1)
            if cfg.get("requests"):
                result.setdefault("outputs", []).append([_completions(o) for o in outs])
            live = (r() for r in drafter_mod.LIVE[n_live:])
            snapshots.append([d.ascend_stats.as_dict() for d in live if d is not None])
        n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result.update(
            tokens=[list(o.outputs[0].token_ids) for o in outs],
            prompt_token_ids=[list(o.prompt_token_ids) for o in outs],
            gen_seconds=gen, generated_tokens=n_tokens, tokens_per_s=[n_tokens / g for g in gen],
            metrics=_metrics(llm))
        if cfg.get("logprobs"):
            result["logprobs"] = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                                  for o in outs]
        if cfg.get("measure_memory"):
            result["live_tensor_bytes"] = live_tensor_bytes()
        result["drafter"] = snapshots[-1]
        result["schedule"] = schedule_k.live_schedules(schedule_k.LIVE_SCHEDULES[n_schedules:])
        result["drafter_snapshots"] = snapshots  # cumulative stats after each generate call
    except Exception as e:  # noqa: BLE001 - reported to the caller, which decides
        result["error"] = f"{type(e).__name__}: {e}"
        cause = e.__cause__ or e.__context__
        while cause is not None:
            result["error"] += f"\n[caused by] {type(cause).__name__}: {cause}"
            cause = cause.__cause__ or cause.__context__
    finally:
        for u in (undo, undo_bug, undo_reach, undo_mend):
            if u is not None:
                u()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if before_teardown is not None:
            before_teardown()
        del llm
        gc.unfreeze()  # whether or not the engine's shutdown did: nothing stays frozen past the run
        gc.collect()
    return result


def run_all(configs: list[dict[str, Any]], checkpoint: str = CHECKPOINT) -> list[dict[str, Any]]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _install_force_async()
    return [run_one(c, checkpoint) for c in configs]


def rank_share(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """``cfg`` (a data-parallel run) as the one-engine run of rank ``rank``'s prompts (``rank_prompts[rank]``
    indexes ``prompts``) and their ``max_tokens``."""
    prompts = cfg.get("prompts") or PROMPTS
    mine = cfg["rank_prompts"][rank]
    if not mine:  # vLLM's offline DP hangs a rank given no request, whichever drafter
        raise ValueError(f"rank_prompts[{rank}] is empty; every data-parallel rank needs at least one prompt")
    per_prompt = cfg.get("max_tokens", 48)
    return {**cfg, "prompts": [prompts[i] for i in mine],
            "max_tokens": [per_prompt[i] for i in mine] if isinstance(per_prompt, list) else per_prompt}


def run_dp_rank(cfg: dict[str, Any], checkpoint: str, rank: int, size: int, port: int, barrier: Path,
                barrier_timeout: float = 600.0) -> dict[str, Any]:
    """This process as data-parallel rank ``rank`` of ``size``: its share of ``cfg``'s prompts, then the barrier."""
    os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(size),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    share = rank_share(cfg, rank)

    def wait_for_every_rank() -> None:  # an engine torn down early leaves the busy ranks' collectives unpaired
        barrier.mkdir(parents=True, exist_ok=True)
        (barrier / f"rank{rank}").write_text("done")
        deadline = time.monotonic() + barrier_timeout
        while len(list(barrier.glob("rank*"))) < size and time.monotonic() < deadline:
            time.sleep(0.2)

    result = run_one(share, checkpoint, wait_for_every_rank)
    result.update(dp_rank=rank, prompt_indices=cfg["rank_prompts"][rank])
    return result


def run_dp(cfg: dict[str, Any], checkpoint: str, out_dir: Path, size: int = 2, timeout: float = 300.0
           ) -> list[dict[str, Any]]:
    """One data-parallel engine run: ``size`` rank processes of this harness (one core each), started together
    and bounded by ``timeout`` so that a hang fails fast (every process of the run is killed: its engine cores and
    workers too). Per rank, the result of :func:`run_dp_rank`, with ``drafter`` the rank's stats file where ``cfg``
    names a ``stats_dir``. Raises ``RuntimeError`` with the ranks' log tails when a rank hangs or fails."""
    import shutil
    import signal
    import socket
    import subprocess

    out_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:  # a free port for the ranks' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (out_dir / "configs.json").write_text(json.dumps([cfg]))
    shutil.rmtree(out_dir / "barrier", ignore_errors=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(size)))}
    env.pop("VLLM_PLUGINS", None)
    procs, logs = [], []
    for rank in range(size):
        logs.append(open(out_dir / f"rank{rank}.log", "w"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ascend_spec_tools.vllm_harness", str(out_dir / "configs.json"), "--out",
             str(out_dir / f"rank{rank}.json"), "--checkpoint", str(checkpoint), "--dp-size", str(size),
             "--dp-rank", str(rank), "--dp-port", str(port), "--dp-barrier", str(out_dir / "barrier")],
            env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    hung = [r for r, p in enumerate(procs) if p.poll() is None]
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    for f in logs:
        f.close()
    tails = "\n".join(f"--- rank {r} ---\n{(out_dir / f'rank{r}.log').read_text()[-2500:]}" for r in range(size))
    if hung:
        raise RuntimeError(f"data-parallel run {cfg.get('name')}: ranks {hung} still running after {timeout:.0f} s"
                           f"\n{tails}")
    results = []
    for rank, p in enumerate(procs):
        out = out_dir / f"rank{rank}.json"
        if p.returncode != 0 or not out.is_file():
            raise RuntimeError(f"data-parallel run {cfg.get('name')}: rank {rank} failed (rc {p.returncode})\n{tails}")
        (result,) = json.loads(out.read_text())
        stats_dir = cfg.get("ascend", {}).get("stats_dir")
        if stats_dir:
            result["drafter"] = json.loads((Path(stats_dir) / f"drafter-dp{rank}-rank0.json").read_text())
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", help="JSON file holding a list of runs ('-' reads stdin)")
    ap.add_argument("--out", required=True, help="where to write the JSON list of results")
    ap.add_argument("--checkpoint", default=CHECKPOINT)
    ap.add_argument("--dp-size", type=int, default=0, help="run the one config as this data-parallel rank")
    ap.add_argument("--dp-rank", type=int, default=0)
    ap.add_argument("--dp-port", type=int, default=0)
    ap.add_argument("--dp-barrier", type=Path)
    ap.add_argument("--runner", choices=RUNNERS, help="vLLM's model runner (default: vLLM's choice)")
    args = ap.parse_args(argv)
    if args.runner:
        env = runner_env(args.runner)
        if any(os.environ.get(k) != v for k, v in env.items()):  # Triton and vLLM read these at import
            os.execve(sys.executable, [sys.executable, "-m", "ascend_spec_tools.vllm_harness",
                                       *(sys.argv[1:] if argv is None else argv)], env)
    text = sys.stdin.read() if args.configs == "-" else Path(args.configs).read_text()
    if os.environ.get(K0_WRITES_LATE_ENV):
        _k0_writes_late()
    if os.environ.get(K0_LEAN_WRONG_TOKEN_ENV):
        _k0_lean_wrong_token()
    if args.dp_size:
        (cfg,) = json.loads(text)
        _install_force_async()
        results = [run_dp_rank(cfg, args.checkpoint, args.dp_rank, args.dp_size, args.dp_port, args.dp_barrier)]
    else:
        results = run_all(json.loads(text), args.checkpoint)
    Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
