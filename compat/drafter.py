"""The adapter vLLM's model runner builds as its MTP drafter.

vLLM builds ``EagleProposer(vllm_config, device, runner)`` and asserts ``isinstance(drafter,
EagleProposer)``, so the adapter subclasses the class it replaces. With ``additional_config
{"ascend_spec": {"enabled": true}}`` and method mtp/deepseek_mtp it drafts with
:class:`~ascend_spec.torchair_proposer.MtpTorchairProposer`; otherwise every call goes to vLLM's own code.

vLLM keeps what it owns: it loads its MTP model (which registers the draft attention layer, so vLLM
sizes and allocates the draft KV cache), schedules, samples the target and verifies. The adapter
  * builds our draft model on the weights vLLM loaded (``host_weights``: no file read, no copy, any TP size)
    and compiles the draft graph per batch bucket (``torchair_graph_config``) when vLLM sets up attention,
    against a cache of the real shape;
  * drafts into vLLM's draft-layer cache through a layout view (``kv_layout``), with vLLM's block table
    and slot mapping (the draft layer shares the target's KV cache group);
  * translates ``propose``'s flat inputs (``[T]`` tokens, ``[T, D]`` hidden states, ``query_start_loc``)
    into ``DraftInputs [B, Q]``: a reshape when every request verifies ``1 + K`` tokens (no host syncs;
    the compiled bucket graph), else a ragged-to-padded repack on device, at least ``1 + K`` wide (a graph too,
    up to the widest ``prefill_query_widths``: the query pads to a graph's width; vLLM's unpadded decode batch,
    its rejected tokens compacted away, replays the decode width);
  * computes the next tokens itself (``prepare_next_token_ids_padded``) with the backup token at
    ``num_tokens_no_spec - 1``, and builds fresh tensors: vLLM's metadata and host buffers are only read.
Whatever it cannot draft (dynamic K, probabilistic draft sampling) goes to vLLM's ``propose``, which
writes the same cache in the same layout. Each rank logs one line at start and, with ``stats_dir``, keeps
``drafter-rank{R}.json`` up to date (:class:`StatsFile`).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import logging
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascend_spec import spec_decode
from ascend_spec.config import SpeculativeConfig
from ascend_spec.graph.backends import Backend, get_backend
from ascend_spec.graph.backends.aot_graphs import GraphStore, aot_available, module_refs
from ascend_spec.graph.backends.compile_cache import open_default_cache
from ascend_spec.graph.external import opaque_indices
from ascend_spec.graph.latent_cache import (LatentCache, allocate_latent_cache, block_size_of, cache_tensors,
                                            describe, same_shape)
from ascend_spec.graphs import graph_cache_key
from ascend_spec.inputs import pad_ragged, table_width
from ascend_spec.proposer import DraftInputs
from ascend_spec.torchair_proposer import MtpTorchairProposer

from .host_weights import config_from_vllm, mtp_model_on_vllm, owned_tensor_bytes
from .kv_layout import draft_block_size, draft_cache_view, draft_layer_names
from .settings import METHODS, PluginSettings
from .shims import (
    CompatError,
    attn_fields,
    backup_next_token_ids,
    bind_runner,
    call_with_supported,
    detected_drift,
    discard_mask,
    dp_coordinate,
    host_seq_lens_upper_bound,
    installed_vllm_version,
    moe_forward_context,
    probe_proposer_api,
    probe_runner,
    raise_if_missing,
    refuse_cpu_dp_moe,
)

# Under "vllm." so that vLLM's own log handler (INFO, in every worker) prints our lines.
logger = logging.getLogger("vllm.ascend_spec.drafter")  # manifest: ignore (our logger name)

#: every adapter built in this process (the harness and benchmark read their stats)
LIVE: list[weakref.ref] = []


@dataclass
class DrafterStats:
    """Per-drafter counters: where the drafts came from and how long ``propose`` took."""

    drafter: str = "vllm"  # "ascend_spec" or "vllm"
    propose_calls: int = 0
    propose_seconds: float = 0.0
    decode_calls: int = 0  # calls where every request verified 1 + K tokens (the steady state)
    decode_seconds: float = 0.0
    graph_calls: int = 0  # ours, through a compiled graph (decode, and prefill chunks up to the widest graph width)
    eager_calls: int = 0  # ours, run eagerly (wider prefill chunks, batches above the buckets)
    fallback_calls: int = 0  # delegated to vLLM's propose although enabled
    fallbacks_by_reason: dict[str, int] = field(default_factory=dict)
    decode_eager_calls: int = 0  # steady-state decode batches above the largest bucket (run eagerly)
    own_dummy_runs: int = 0  # the runner's dummy steps (captures, idle data-parallel steps) run as inert drafts here
    dummy_calls: int = 0  # the runner's dummy steps, whichever drafter ran them
    dummy_seconds: float = 0.0
    graph_failures: int = 0  # compiled bucket graphs that raised; each of those steps reran eagerly
    graph_failure_policy: str = ""  # "eager" (rerun and count) or "raise"
    graph_host_ops: int = 0  # ops needing the host that the graph lint found in the compiled draft graphs
    rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    dp_syncs: int = 0  # data-parallel all-reduces of the ranks' token counts (vLLM's drafter's, one per pass)
    warmup_seconds: float = 0.0
    graphs_loaded: int = 0  # draft graphs loaded whole from our compile cache at warm-up (CPU), without tracing
    graphs_saved: int = 0  # ... and compiled, then saved there
    buckets: list[int] = field(default_factory=list)
    backend: str = ""
    weights_owned_bytes: int = 0  # tensors the drafter holds that are not vLLM's (RoPE tables at most)
    quantization: str = ""  # vLLM's quant method for the checkpoint ("": none); our draft runs vLLM's layers
    vocab_parallel_greedy: bool = False  # TP > 1: each draft token and its embedding in one all-gather
    mla_absorb: str = ""  # how the absorbed W_UK / W_UV products run: views of vLLM's matrices, or its kernels
    # async-scheduling conditions (collect_stats only)
    steps_optimistic_ahead: int = 0  # steps where host seq lens ran ahead of the exact device ones
    reqs_placeholder_at_optimistic: int = 0  # requests whose token at the optimistic length - 1 is unknown (-1)
    host_buffer_reused: int = 0  # steps whose optimistic host buffer is the same storage as the step before
    host_buffer_mutated: int = 0  # times the host buffer changed across our drafting (must stay 0)
    rows_sampled_outside: int = 0  # rows whose sample index lies before their span (discarded requests)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fit_width(block_table: torch.Tensor, width: int) -> torch.Tensor:
    """Block table as int64 ``[B, width]`` (the compiled graphs have a fixed table width)."""
    b, m = block_table.shape
    if m >= width:
        return block_table[:, :width].long()
    return torch.cat([block_table.long(), block_table.new_zeros(b, width - m, dtype=torch.long)], dim=1)


class StatsFile:
    """``{stats_dir}/drafter-rank{R}.json``: written at start, at most every few seconds while serving (a
    worker can be killed without notice) and at interpreter exit."""

    MIN_INTERVAL_S = 5.0

    def __init__(self, stats_dir: str, stats: DrafterStats) -> None:
        dp = f"dp{stats.dp_rank}-" if stats.dp_size > 1 else ""
        self.path = Path(stats_dir) / f"drafter-{dp}rank{stats.rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stats = stats
        self._last = 0.0
        atexit.register(self.write)

    def maybe_write(self) -> None:
        if time.monotonic() - self._last >= self.MIN_INTERVAL_S:
            self.write()

    def write(self) -> None:
        self._last = time.monotonic()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats.as_dict(), indent=2))
        tmp.replace(self.path)  # readers never see half a file


class AscendSpecMtpMixin:
    """The adapter's methods; :func:`build_adapter_class` puts them in front of vLLM's drafter class, which is
    known only at run time (its module moved between releases)."""

    #: vLLM's drafter class this adapter subclasses (set by :func:`build_adapter_class`)
    vllm_base: type = object
    __ascend_spec_adapter__ = True
    #: how the platform's MLA backend keeps the draft cache (graph.latent_cache): vLLM's fused 576-wide latent
    _ascend_kv_layout = "fused"

    def __init__(self, vllm_config: Any, device: Any, runner: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, device, runner, *args, **kwargs)
        bind_runner(self, runner)
        self.ascend_settings = PluginSettings.from_additional_config(vllm_config.additional_config)
        method = vllm_config.speculative_config.method
        self.ascend_enabled = self.ascend_settings.enabled and method in METHODS
        if self.ascend_settings.enabled and not self.ascend_enabled:
            logger.warning("ascend_spec drafter enabled, but speculative method %r is not one of %s: "
                           "vLLM's drafter is used", method, METHODS)
        self.ascend_stats = DrafterStats(drafter="ascend_spec" if self.ascend_enabled else "vllm")
        self._ascend_model = None
        self._ascend: MtpTorchairProposer | None = None
        self._ascend_layer = ""
        self._ascend_cache_bound = False
        self._ascend_prev_host_ptr = None
        self._ascend_stats_file: StatsFile | None = None
        self._ascend_tp = 1
        parallel = vllm_config.parallel_config
        self.ascend_stats.dp_rank, self.ascend_stats.dp_size = parallel.data_parallel_rank, parallel.data_parallel_size
        #: under data parallel, during one draft: every rank's token count per forward pass (``_dp_sync``)
        self._dp_counts: dict[int, torch.Tensor] | None = None
        if self.ascend_enabled:
            raise_if_missing(self._probe_api(), "drafter interface")
        LIVE.append(weakref.ref(self))

    def _probe_api(self) -> list:
        return probe_proposer_api(self.vllm_base)

    # -- lifecycle -------------------------------------------------------------------------
    def load_model(self, target_model: Any, *args: Any, **kwargs: Any) -> None:
        # vLLM's own load first: it registers the draft attention layer, so vLLM allocates its KV cache.
        call_with_supported(super().load_model, target_model, *args, **kwargs)
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self._ascend_tp = get_tensor_model_parallel_world_size()
        self.ascend_stats.rank = get_tensor_model_parallel_rank()
        if self.ascend_settings.stats_dir:  # also with vLLM's drafter (enabled: false), to compare the two
            self._ascend_stats_file = StatsFile(self.ascend_settings.stats_dir, self.ascend_stats)
        if not self.ascend_enabled:
            return
        raise_if_missing(probe_runner(self.runner), "model runner state")
        logger.info("ascend_spec: vLLM API shapes in use: %s", detected_drift(self.runner))
        # Our draft chain on the MTP layer vLLM just loaded (and the target's embedding and lm_head it
        # shares): no checkpoint file is read, no weight is copied, weight-holding layers run vLLM's forward.
        cfg = config_from_vllm(self.vllm_config)
        self._refuse_unpaired_dp(cfg.moe is not None)
        if cfg.moe is not None and self.device.type == "cpu":
            refuse_cpu_dp_moe(self.vllm_config)
        self.ascend_stats.quantization = self.vllm_config.model_config.quantization or ""
        moe_context = self._moe_context() if cfg.moe is not None else None
        self._ascend_model = mtp_model_on_vllm(self.model, cfg, self._ascend_tp, self.device, moe_context,
                                               opaque_moe=self.device.type != "npu")
        self.ascend_stats.weights_owned_bytes = owned_tensor_bytes(self._ascend_model, self.model)
        self.ascend_stats.vocab_parallel_greedy = self._ascend_model.greedy_head is not None
        attn = self._ascend_model.mtp_layer(0).self_attn
        self.ascend_stats.mla_absorb = attn.uk_proj.name if attn.uk_proj is not None else "W_UK_T / W_UV views"

    def initialize_attn_backend(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        call_with_supported(super().initialize_attn_backend, kv_cache_config, *args, **kwargs)
        if not self.ascend_enabled:
            return
        names = draft_layer_names(self)
        if len(names) != 1:
            raise CompatError(f"ascend_spec drafter expects one draft attention layer, vLLM built {names}")
        self._ascend_layer = names[0]
        cfg = self._ascend_model.cfg
        # The cache is bound after this call; compile against a stand-in of the same layout, block size and shape
        # (graphs take the cache as an input, so the real one replaces it without a recompile).
        stand_in = allocate_latent_cache(self._ascend_kv_layout, kv_cache_config.num_blocks, draft_block_size(self),
                                         cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                         self.vllm_config.model_config.dtype, self.device)
        self._mark_static_on_cuda(stand_in)
        self._build_ascend(stand_in)

    def _build_ascend(self, cache: LatentCache) -> None:
        s = self.ascend_settings
        g = s.graph
        backend = get_backend(g.effective_backend, self.device, mode=g.mode,
                              frozen_parameter=g.enable_frozen_parameter, view_optimize=g.enable_view_optimize,
                              tiling_schedule_optimize=g.tiling_schedule_optimize,
                              use_cached_graph=g.use_cached_graph, distributed=self._ascend_tp > 1,
                              graph_failure=s.graph_failure)
        k = self.num_speculative_tokens
        sizes = s.batch_sizes(self.vllm_config.scheduler_config.max_num_seqs, k, token_multiple=self._ascend_tp)
        backend.store = self._graph_store(backend, sizes)
        spec = SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=self.num_speculative_tokens)
        self._ascend = MtpTorchairProposer(self._ascend_model, spec, self.max_model_len, cache,
                                           backend=backend, batch_sizes=sizes, prefill_widths=g.prefill_query_widths)
        self._ascend_cache_bound = False
        self.ascend_stats.buckets = list(sizes)
        self.ascend_stats.backend = backend.name
        self.ascend_stats.graph_failure_policy = backend.graph_failure
        st = self.ascend_stats
        # vLLM-CPU's oneDNN handles (CPUDNNLGEMMHandler) that vLLM dropped while loading (the MTP layer's own
        # lm_head, replaced by the target's) sit in reference cycles; the cyclic GC could run their __del__
        # (which reads a tensor with .item()) in the middle of our FakeTensor tracing, where it fails
        # ("Exception ignored ... convert all Tensors to FakeTensors") and leaks the handle. Free them before
        # any tracing (warm-up, or the first draft without it): now, or where graphs are saved whole, before the
        # first trace, which a warm start never makes (a full collection is a few tenths of a second of it).
        if backend.store is None:
            gc.collect()
        else:
            backend.store.before_compile = functools.cache(gc.collect)  # once: vLLM's load left them once
        if s.warmup:
            t0 = time.perf_counter()
            with torch.inference_mode(), self._warmup_context(max(sizes) * (1 + k)):
                self._ascend.warmup(progress=False)
            st.warmup_seconds = time.perf_counter() - t0
        if backend.store is not None:
            st.graphs_loaded, st.graphs_saved = backend.store.loaded, backend.store.compiled
        st.graph_host_ops = len(backend.lint.findings)
        logger.info("ascend_spec drafter rank %d/%d: backend %s, graph buckets %s (× %d tokens), warm-up %.1f s, "
                    "weights shared with vLLM (%s; drafter owns %.1f MiB of tensors)", st.rank, self._ascend_tp,
                    backend.name, sizes, 1 + k, st.warmup_seconds, st.quantization or "unquantised",
                    st.weights_owned_bytes / 2**20)
        if self._ascend_stats_file is not None:
            self._ascend_stats_file.write()

    def _graph_store(self, backend: Backend, sizes: list[int]) -> GraphStore | None:
        """On CPU, the draft graphs saved whole in our compile cache (``graph.backends.aot_graphs``), as our engine
        saves its own: a warm start loads them without tracing. Keyed by everything the traced code depends on
        here besides our sources: vLLM's version, its attention backend and quantisation, TP rank, block size and
        layout; and the numbers of the opaque externals (vLLM's MoE) the graph calls, which count the engines this
        process built before. The graphs close over vLLM's modules, passed by reference, never pickled."""
        if backend.name != "inductor" or self.device.type != "cpu" or not aot_available():
            return None
        cache = open_default_cache(inductor=False)  # vLLM points inductor's cache itself
        if cache is None:
            return None
        model_cfg = self.vllm_config.model_config
        attn = self._ascend_model.mtp_layer(0).self_attn
        key = graph_cache_key("vllm_drafter", self._ascend_model, backend, self.device, model_cfg.dtype,
                              vllm=installed_vllm_version(), quantization=model_cfg.quantization or "",
                              absorb=attn.uk_proj.name if attn.uk_proj is not None else "views",
                              tp=[self.ascend_stats.rank, self._ascend_tp], block_size=draft_block_size(self),
                              kv_layout=self._ascend_kv_layout, max_model_len=self.max_model_len,
                              batch_sizes=list(sizes), opaque_externals=opaque_indices(self._ascend_model))
        return GraphStore(cache, key, external=module_refs(self._ascend_model))

    def _bind_cache(self) -> None:
        cfg = self._ascend_model.cfg
        cache = draft_cache_view(self.vllm_config, self._ascend_layer, (cfg.kv_lora_rank, cfg.qk_rope_head_dim),
                                 draft_block_size(self))
        if not same_shape(cache, self._ascend.draft_cache):
            logger.warning("ascend_spec: draft KV cache %s differs from the compiled shape %s; recompiling",
                           describe(cache), describe(self._ascend.draft_cache))
        self._mark_static_on_cuda(cache)
        self._ascend.draft_cache = cache
        self._ascend_cache_bound = True

    def _mark_static_on_cuda(self, cache: LatentCache) -> None:
        """vLLM's KV pool lives as long as the engine: CUDA graphs must write it where it is, not into a copy of
        their own (unmarked, the engine's own pool lost its writes under CUDA graphs). The stand-in warm-up compiles
        against is marked too, so the compiled graphs take a static cache; binding the real one re-records a CUDA
        graph at most, it compiles nothing."""
        if torch.device(self.device).type == "cuda":
            for t in cache_tensors(cache):
                torch._dynamo.mark_static_address(t)

    def dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        """The runner's dummy steps: the profile run (before the KV pool is sized, so before ours is built) and
        vLLM's CUDA-graph captures of its drafter (every rank captures alike) stay vLLM's drafter's. Once ours is
        built every other dummy step (an idle data-parallel rank's lockstep steps, vllm-ascend's captures) is an
        inert draft through our graphs, with the same data-parallel all-reduces a real draft makes."""
        t0 = time.perf_counter()
        try:
            if not self.ascend_enabled or self._ascend is None or kwargs.get("is_graph_capturing"):
                return call_with_supported(super().dummy_run, num_tokens, *args, **kwargs)
            q = 1 + self._ascend.num_speculative_tokens
            rows = max(1, min(int(kwargs.get("num_reqs") or num_tokens // q), self._ascend.graph.max_size))
            tokens = self._ascend.graph.tokens_for(rows, q)
            with torch.inference_mode(), self._dp_sync(rows, q), self._warmup_context(tokens):
                self._ascend.dummy_run(rows)
            self.ascend_stats.own_dummy_runs += 1
            return None
        finally:
            self.ascend_stats.dummy_calls += 1
            self.ascend_stats.dummy_seconds += time.perf_counter() - t0

    # -- data parallel ----------------------------------------------------------------------
    def _refuse_unpaired_dp(self, moe: bool) -> None:
        """Under data parallel a MoE layer's every call is a collective of all ranks: a rank handing one step to
        vLLM's drafter (which interleaves its all-reduces with its MoE calls) while another drafts with ours would
        pair different collectives. Probabilistic draft sampling hands steps over by batch, so it is refused."""
        method = getattr(self.speculative_config, "draft_sample_method", "greedy")
        dp = self.ascend_stats.dp_size
        if moe and dp > 1 and method != "greedy":
            raise CompatError(f"ascend_spec drafter: speculative_config.draft_sample_method={method!r} with a MoE "
                              f"MTP layer and data_parallel_size={dp} would pair different collectives across "
                              "ranks; allowed: draft_sample_method 'greedy', or ascend_spec.enabled: false")

    @contextlib.contextmanager
    def _dp_sync(self, batch: int, query: int) -> Any:
        """Around one draft of ``batch`` requests × ``query`` tokens: the data-parallel all-reduces vLLM's drafter
        makes (one for the first pass, one for steps 2..K), with the tokens each of our passes runs; the counts
        are what the MoE's forward context reads. Nothing without data parallel."""
        if self.ascend_stats.dp_size == 1:
            yield
            return
        first, chained = self._ascend.forward_tokens(batch, query)
        counts = {first: dp_coordinate(self.vllm_config, first)}
        if self._ascend.num_speculative_tokens > 1:
            counts[chained] = dp_coordinate(self.vllm_config, chained)
        self.ascend_stats.dp_syncs += len(counts)
        self._dp_counts = counts
        try:
            yield
        finally:
            self._dp_counts = None

    def _dp_counts_for(self, num_tokens: int) -> torch.Tensor | None:
        """Every rank's count for a MoE call of ``num_tokens`` inside a draft; None outside one (warm-up, which
        every rank runs alike, lets vLLM's context coordinate each call)."""
        if self._dp_counts is None:
            return None
        if num_tokens not in self._dp_counts:
            raise CompatError(f"ascend_spec drafter: a MoE call of {num_tokens} tokens inside a draft whose "
                              f"data-parallel passes run {sorted(self._dp_counts)} tokens")
        return self._dp_counts[num_tokens]

    # -- bookkeeping -----------------------------------------------------------------------
    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, requests: Any,
                                      gpu_input_batch: Any, discard_request_mask: Any = None,
                                      *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.ascend_enabled:
            return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                         discard_request_mask, *args, **kwargs)
        num_reqs = sampled_token_ids.shape[0]
        num_discarded = args[0] if args else kwargs.get("num_discarded_requests")
        if discard_request_mask is None:  # vllm-ascend's name for the index buffer
            discard_request_mask = kwargs.get("discard_request_indices")
        mask = discard_mask(discard_request_mask, num_reqs, num_discarded, device=sampled_token_ids.device)
        backup = backup_next_token_ids(requests, gpu_input_batch, num_reqs).to(sampled_token_ids.device)
        if self.ascend_settings.collect_stats:
            self._record_optimistic(requests, gpu_input_batch, num_reqs)
        next_ids, count = spec_decode.prepare_next_token_ids_padded(
            sampled_token_ids, mask, backup, self._ascend_model.cfg.vocab_size)
        return next_ids.to(torch.int32), count

    def _record_optimistic(self, requests: Any, input_batch: Any, num_reqs: int) -> None:
        upper = host_seq_lens_upper_bound(self.runner, num_reqs)
        for i in range(num_reqs):
            if requests[input_batch.req_ids[i]].get_token_id(int(upper[i]) - 1) == -1:
                self.ascend_stats.reqs_placeholder_at_optimistic += 1

    # -- drafting --------------------------------------------------------------------------
    def propose(self, num_speculative_tokens: int | None = None, target_token_ids: Any = None,
                target_positions: Any = None, target_hidden_states: Any = None, next_token_ids: Any = None,
                token_indices_to_sample: Any = None, common_attn_metadata: Any = None,
                sampling_metadata: Any = None, **kwargs: Any) -> torch.Tensor:
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        theirs = super().propose
        # Forward what the runner passed, unchanged: runner and base class come from the same release.
        return self._draft_or_delegate(
            k, target_token_ids, target_positions, target_hidden_states, next_token_ids, token_indices_to_sample,
            common_attn_metadata, sampling_metadata, None,
            lambda: theirs(num_speculative_tokens=num_speculative_tokens, target_token_ids=target_token_ids,
                           target_positions=target_positions, target_hidden_states=target_hidden_states,
                           next_token_ids=next_token_ids, token_indices_to_sample=token_indices_to_sample,
                           common_attn_metadata=common_attn_metadata, sampling_metadata=sampling_metadata,
                           **kwargs))

    def _draft_or_delegate(self, k: int, target_token_ids: Any, target_positions: Any,
                           target_hidden_states: Any, next_token_ids: Any, token_indices_to_sample: Any,
                           common_attn_metadata: Any, sampling_metadata: Any, extra_reason: str | None,
                           delegate: Any) -> torch.Tensor:
        """Draft with ours, or call ``delegate()`` (the base class's own drafting) and count why."""
        t0 = time.perf_counter()
        f = attn_fields(common_attn_metadata)
        decode = f.max_query_len == 1 + k and f.num_actual_tokens == f.num_reqs * (1 + k)
        reason = self._fallback_reason(k, target_positions, sampling_metadata)
        if reason is None:
            reason = extra_reason
        if reason is None:
            width = max(f.max_query_len, 1 + k)
            with self._dp_sync(f.num_reqs, width), self._draft_context(f, k):
                out = self._propose_ascend(k, target_token_ids, target_positions, target_hidden_states,
                                           next_token_ids, token_indices_to_sample, f, decode)
        else:
            if self.ascend_enabled:
                st = self.ascend_stats
                st.fallback_calls += 1
                st.fallbacks_by_reason[reason] = st.fallbacks_by_reason.get(reason, 0) + 1
            out = delegate()
        dt = time.perf_counter() - t0
        st = self.ascend_stats
        st.propose_calls += 1
        st.propose_seconds += dt
        if decode:
            st.decode_calls += 1
            st.decode_seconds += dt
        if self._ascend_stats_file is not None:
            self._ascend_stats_file.maybe_write()
        return out

    def _moe_context(self) -> Any:
        """``context(num_tokens)`` around each call into vLLM's MoE (vllm-ascend: its own context)."""
        return moe_forward_context(self.vllm_config, across_dp=self._dp_counts_for)

    def _draft_context(self, f: Any, k: int) -> Any:
        """Context our draft runs in (vllm-ascend: its forward context; vLLM: none needed)."""
        return contextlib.nullcontext()

    def _warmup_context(self, num_tokens: int) -> Any:
        """Context the warm-up compiles in (vllm-ascend: its forward context, which its traced MoE reads)."""
        return contextlib.nullcontext()

    def _fallback_reason(self, k: int, target_positions: Any, sampling_metadata: Any) -> str | None:
        """Why vLLM's own propose must run this call, or None when ours drafts it."""
        if not self.ascend_enabled:
            return "disabled"
        if self._ascend is None:
            return "not_built"
        if k != self._ascend.num_speculative_tokens:
            return "dynamic_k"
        if target_positions is not None and target_positions.dim() != 1:
            return "mrope"
        probabilistic = getattr(self.speculative_config, "draft_sample_method", "greedy") != "greedy"
        if probabilistic and sampling_metadata is not None and not sampling_metadata.all_greedy:
            return "probabilistic_draft"
        return None

    def _propose_ascend(self, k: int, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                        target_hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                        token_indices_to_sample: torch.Tensor | None, f: Any, decode: bool) -> torch.Tensor:
        if not self._ascend_cache_bound:
            self._bind_cache()
        b, q = f.num_reqs, 1 + k
        dev = target_hidden_states.device
        qsl = f.query_start_loc[: b + 1].long()
        tis = (qsl[1:] - 1) if token_indices_to_sample is None else token_indices_to_sample[:b].long()
        if self.ascend_settings.collect_stats:
            self._record_host_buffer(b, f)
            self.ascend_stats.rows_sampled_outside += int((tis < qsl[:-1]).sum())
        if decode:
            # Every request verifies 1 + K tokens: the flat batch is already [B, Q]; reshape, no host reads.
            n = b * q
            ids = target_token_ids[:n].view(b, q).long()
            pos = target_positions[:n].view(b, q).long()
            hidden = target_hidden_states[:n].view(b, q, -1)
            slots = f.slot_mapping[:n].view(b, q).long()
            sample_idx = (tis - qsl[:-1]).clamp(0, q - 1)
            if self._ascend.graph.bucket_for(b) is None:
                self._note_eager_decode(b)
            else:
                self.ascend_stats.graph_calls += 1
        else:
            # Prefill, mixed, or vLLM's unpadded decode (rejected tokens compacted away: spans of at most 1 + K):
            # repack ragged -> [B, W] with inert padding (slot -1, token 0) on device, W at least 1 + K so that an
            # unpadded decode batch replays the decode graph's width (no host read, no new shape).
            width = max(f.max_query_len, q)
            ids, pos, hidden, slots = pad_ragged(qsl, width, dev, [
                (target_token_ids, 0), (target_positions, 0), (target_hidden_states, 0.0), (f.slot_mapping, -1)])
            ids, pos, slots = ids.long(), pos.long(), slots.long()
            sample_idx = (tis - qsl[:-1]).clamp(0, width - 1)
            if self._ascend.graph_serves(b, width):
                self.ascend_stats.graph_calls += 1
            else:
                self.ascend_stats.eager_calls += 1
        block = block_size_of(self._ascend.draft_cache)
        full = self._ascend.table_width
        # Context is data: on backends that compile a dynamic width the table covers the live blocks only
        # (the chained drafts write up to max_seq_len + K - 1), so a step costs what the context costs.
        width = table_width(f.max_seq_len + k, full, block, self._ascend.backend.shapes.trim_context)
        # Attention that reads host KV lengths (torch_npu's) gets the runner's host ones, optimistic under async
        # scheduling as vllm-ascend's own drafter passes them (an upper bound, never a read of the device's),
        # each aligned to its row's query block: a span right-padded to the batch's width ends that much later.
        lens_host = None
        if self._ascend.model.takes_host_lengths:
            spans = (f.query_start_loc_cpu[1: b + 1] - f.query_start_loc_cpu[:b]).tolist()
            upper = host_seq_lens_upper_bound(self.runner, b).tolist()
            lens_host = tuple(u - n + ids.shape[1] for u, n in zip(upper, spans))
        inputs = DraftInputs(
            target_token_ids=ids, target_positions=pos, target_hidden_states=hidden, target_slot_mapping=slots,
            next_token_ids=next_token_ids[:b].long(), token_indices_to_sample=sample_idx,
            block_table=_fit_width(f.block_table_tensor[:b], width), seq_lens=f.seq_lens[:b].long(),
            seq_lens_host=lens_host)
        with torch.inference_mode():
            draft = self._ascend.propose(inputs)
        self.ascend_stats.graph_failures = self._ascend.graph.num_failures
        self.ascend_stats.graph_host_ops = len(self._ascend.backend.lint.findings)
        if self.ascend_settings.collect_stats:
            self._check_host_buffer_after(b)
        return draft

    def _note_eager_decode(self, b: int) -> None:
        st = self.ascend_stats
        st.decode_eager_calls += 1
        st.eager_calls += 1
        if st.decode_eager_calls == 1:
            logger.warning("ascend_spec drafter rank %d: steady-state decode batch of %d requests is above the "
                           "largest graph bucket %d and runs eagerly; add it to "
                           "torchair_graph_config.graph_batch_sizes", st.rank, b, self._ascend.graph.max_size)

    def _record_host_buffer(self, b: int, f: Any) -> None:
        buf = getattr(self.runner, "optimistic_seq_lens_cpu", None)
        upper = host_seq_lens_upper_bound(self.runner, b)
        if bool((upper > f.seq_lens[:b].to(upper.device, upper.dtype)).any()):
            self.ascend_stats.steps_optimistic_ahead += 1
        if buf is not None:
            ptr = buf.data_ptr()
            if ptr == self._ascend_prev_host_ptr:
                self.ascend_stats.host_buffer_reused += 1
            self._ascend_prev_host_ptr = ptr
        self._host_snapshot = upper

    def _check_host_buffer_after(self, b: int) -> None:
        if not torch.equal(host_seq_lens_upper_bound(self.runner, b), self._host_snapshot):
            self.ascend_stats.host_buffer_mutated += 1


def build_adapter_class(base: type, mixin: type = AscendSpecMtpMixin,
                        name: str = "AscendSpecMtpProposer") -> type:
    """``name(mixin, base)``: the adapter as a subclass of vLLM's drafter class ``base`` (``EagleProposer``), which
    vLLM's runner checks with ``isinstance``."""
    return type(name, (mixin, base), {"vllm_base": base, "__module__": mixin.__module__})


def live_stats() -> list[dict[str, Any]]:
    """Stats of every adapter still alive in this process, oldest first."""
    return [d.ascend_stats.as_dict() for d in (r() for r in LIVE) if d is not None]
