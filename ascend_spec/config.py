"""User-facing configuration: vLLM's ``speculative_config``, graph-mode settings (vllm-ascend's
``torchair_graph_config`` keys) and the engine's limits, as validated dataclasses.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .graph.backends.torchair import resolve_draft_kv_lengths
from .graph.latent_cache import DEFAULT_BLOCK_SIZE, canonical_layout

SPEC_METHODS = ("deepseek_mtp", "mtp")
GRAPH_MODES = ("max-autotune", "reduce-overhead", "npugraph_ex")
#: torchair-rehearsal: torchair's shape policy (one graph per shape, each key held to its first shapes) run eagerly
#: on any device, to see before an NPU does which graphs a deployment compiles and that none recompiles
BACKENDS = ("auto", "eager", "inductor", "torchair", "torchair-rehearsal")
#: the same as ``graph.backends.base.GRAPH_FAILURE_POLICIES`` (this module imports no torch)
GRAPH_FAILURE_POLICIES = ("eager", "raise")
#: see ``GraphModeConfig.prefill_query_widths``
DEFAULT_PREFILL_QUERY_WIDTHS = (32, 128, 512)


class ConfigError(ValueError):
    """Invalid user configuration."""


def _check_keys(section: str, given: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; allowed keys: {sorted(allowed)}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys that the MTP drafter reads."""

    method: str = "deepseek_mtp"
    num_speculative_tokens: int = 2
    disable_padded_drafter_batch: bool = False

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative_config.method={self.method!r}; allowed: {list(SPEC_METHODS)}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"speculative_config.num_speculative_tokens={self.num_speculative_tokens!r}; allowed: an int in 1..16")
        if not isinstance(self.disable_padded_drafter_batch, bool):
            raise ConfigError("speculative_config.disable_padded_drafter_batch must be true or false, "
                              f"got {self.disable_padded_drafter_batch!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        # vLLM's spec config carries more keys (model, draft_tensor_parallel_size, ...); we accept and ignore
        # those that do not change the MTP drafter and reject misspellings of ours.
        passthrough = ("model", "draft_tensor_parallel_size", "quantization", "max_model_len", "revision",
                       "code_revision", "enforce_eager", "prefill_token_shift")
        _check_keys("speculative_config", d, tuple(f.name for f in fields(cls)) + passthrough)
        return cls(**{k: v for k, v in d.items() if k not in passthrough})


def default_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """nano-vllm's buckets: ``[1, 2, 4, 8] + range(16, max+1, 16)`` capped at the batch limit."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def power_of_two_batch_sizes(max_num_seqs: int) -> list[int]:
    """``graph_batch_sizes_init``: powers of two up to the batch limit (and the limit itself)."""
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return sizes + [max_num_seqs]


@dataclass(frozen=True, slots=True)
class GraphModeConfig:
    """Graph-mode settings on every backend: vllm-ascend's ``additional_config.torchair_graph_config`` keys (the
    name users type) plus our ``backend`` choice. ``mode`` is torchair's compile mode, read on torchair only."""

    enabled: bool = True
    backend: str = "auto"
    mode: str = "max-autotune"
    graph_batch_sizes: tuple[int, ...] = ()
    graph_batch_sizes_init: bool = False
    use_cached_graph: bool = False
    enable_frozen_parameter: bool = True
    enable_view_optimize: bool = True
    tiling_schedule_optimize: bool = False
    #: prompt-chunk widths (tokens per request) that prefill and mixed batches replay a graph for, besides 1 + K:
    #: where graphs replay one shape (torchair, CUDA graphs) each is one more graph per batch bucket and a query
    #: pads to the next; where the query axis is dynamic (CPU) one compile serves every width up to the largest.
    #: Wider chunks, compute-bound anyway, run eagerly; () drafts every prefill eagerly on per-shape backends.
    prefill_query_widths: tuple[int, ...] = DEFAULT_PREFILL_QUERY_WIDTHS
    #: the draft chain's steps 2..K on the NPU attention op: ``exact`` device lengths or the host's ``upper_bound``;
    #: ``auto``: exact in max-autotune (GE) mode, the bound in npugraph_ex (``graph.backends.torchair``)
    draft_kv_lengths: str = "auto"

    def __post_init__(self) -> None:
        p = "torchair_graph_config"
        if self.mode in GRAPH_MODES:
            try:
                resolve_draft_kv_lengths(self.draft_kv_lengths, self.mode)
            except ValueError as exc:
                raise ConfigError(f"{p}.{exc}") from None
        if self.backend not in BACKENDS:
            raise ConfigError(f"{p}.backend={self.backend!r}; allowed: {list(BACKENDS)}")
        if self.mode not in GRAPH_MODES:
            raise ConfigError(f"{p}.mode={self.mode!r}; allowed: {list(GRAPH_MODES)}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ConfigError(f"{p}.{f.name} must be true or false, got {getattr(self, f.name)!r}")
        bad = [s for s in self.graph_batch_sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if bad:
            raise ConfigError(f"{p}.graph_batch_sizes has invalid size(s) {bad}; allowed: positive ints")
        bad = [w for w in self.prefill_query_widths if isinstance(w, bool) or not isinstance(w, int) or w < 2]
        if bad:
            raise ConfigError(f"{p}.prefill_query_widths has invalid width(s) {bad}; allowed: ints >= 2 (tokens per "
                              "request), e.g. [32, 128, 512], or [] for eager prefill drafts")
        object.__setattr__(self, "prefill_query_widths", tuple(sorted(set(self.prefill_query_widths))))
        if self.graph_batch_sizes and self.graph_batch_sizes_init:
            raise ConfigError(f"{p}: set either graph_batch_sizes or graph_batch_sizes_init, not both")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "GraphModeConfig":
        d = dict(d or {})
        p = "torchair_graph_config"
        _check_keys(p, d, tuple(f.name for f in fields(cls)))
        enabled = d.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{p}.enabled must be true or false, got {enabled!r}")
        if not enabled:
            # As in vllm-ascend: graph options given while graph mode is off are a mistake, not a no-op.
            set_while_off = sorted(k for k in d if k not in ("enabled", "backend"))
            if set_while_off:
                raise ConfigError(f"{p}: {set_while_off} set while enabled is false; enable graph mode or remove them")
            return cls(enabled=False, backend=d.get("backend", "eager"))
        if "graph_batch_sizes" in d:
            sizes = d["graph_batch_sizes"] or ()
            if not isinstance(sizes, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int)
                                                           for x in sizes):
                raise ConfigError(f"{p}.graph_batch_sizes={sizes!r}; allowed: a list of positive ints, "
                                  "e.g. [1, 2, 4, 8]")
            d["graph_batch_sizes"] = tuple(sorted(set(sizes)))
        if "prefill_query_widths" in d:
            widths = d["prefill_query_widths"] or ()
            if not isinstance(widths, (list, tuple)):
                raise ConfigError(f"{p}.prefill_query_widths={widths!r}; allowed: a list of ints >= 2, e.g. "
                                  "[32, 128, 512], or []")
            d["prefill_query_widths"] = tuple(widths)
        return cls(**d)

    @property
    def effective_backend(self) -> str:
        return self.backend if self.enabled else "eager"

    def batch_sizes(self, max_num_seqs: int) -> list[int]:
        if self.graph_batch_sizes:
            return [s for s in self.graph_batch_sizes if s <= max_num_seqs] or [max_num_seqs]
        if self.graph_batch_sizes_init:
            return power_of_two_batch_sizes(max_num_seqs)
        return default_graph_batch_sizes(max_num_seqs)


#: EngineConfig.warm_graphs: every graph at start-up, or what the first steps run
WARM_GRAPHS = ("all", "first")
#: largest KV block size the engine takes (vllm-ascend's MLA kernel block is 128)
MAX_BLOCK_SIZE = 1024

#: ``EngineConfig.keep_learnings`` where the config leaves it None: 0 or 1 (unset: 1)
KEEP_LEARNINGS_ENV = "ASCEND_SPEC_KEEP_LEARNINGS"


def resolve_keep_learnings(setting: bool | None) -> bool:
    """``keep_learnings``: the setting when given, else ``$ASCEND_SPEC_KEEP_LEARNINGS`` (0 or 1), else True."""
    if setting is not None:
        return setting
    value = os.environ.get(KEEP_LEARNINGS_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{KEEP_LEARNINGS_ENV}={value!r}; allowed: 0, 1 or unset (1)")
    return value != "0"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Harness limits. ``speculative`` None means no speculation. ``kv_blocks``: the KV pool in blocks of
    ``block_size`` tokens (block 0 reserved); default room for ``max_num_seqs`` sequences of ``max_model_len``.
    ``block_size`` and ``kv_layout`` are the serving engine's: 16 (vLLM's CPU_MLA), 64 (FlashMLA), 128 with a
    ``pair`` layout (vllm-ascend's MLA: nope and rope caches apart)."""

    max_model_len: int = 512
    max_num_seqs: int = 16
    kv_blocks: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    #: ``single`` (one tensor a token) or ``pair``; ``fused``, its former name, is read as ``single``
    kv_layout: str = "single"
    speculative: SpeculativeConfig | None = field(default_factory=SpeculativeConfig)
    graph: GraphModeConfig = field(default_factory=GraphModeConfig)
    #: a decode step is one graph (verify + sampling + drafting) over device-side batch state; False: the
    #: step-by-step path (target graph, eager sampling, draft graph) at K_max, which batches asking for more than
    #: ``fused_step.MAX_LOGPROBS`` logprobs take too
    fused_step: bool = True
    #: choose K in 0..num_speculative_tokens per batch bucket from measured step costs and running acceptance
    #: (``ascend_spec.adaptive``); False: every step drafts num_speculative_tokens (``--fixed-k``). Needs fused_step
    adaptive_k: bool = True
    #: what warm-up compiles: ``all`` every graph a run may replay; ``first`` what the first steps run (K_max and
    #: K = 0; the lone-request graphs when the first batch is one request), the other K values on first pick.
    #: Why the CLI defaults to ``first``: docs/design.md, "Decode paths: one per purpose"
    warm_graphs: str = "all"
    #: a compiled graph that fails, or needs the host (graph lint): ``eager`` reruns the step eagerly and counts it,
    #: ``raise`` raises; None: ``$ASCEND_SPEC_GRAPH_FAILURE``, else ``eager`` (``ascend_spec.graph.backends.base``)
    graph_failure: str | None = None
    #: adaptive K starts from what earlier runs on this model and host learned (acceptance, step costs) and keeps
    #: what this one learns, in the compile cache's folder (``ascend_spec.learnings``; off with the cache); None:
    #: ``$ASCEND_SPEC_KEEP_LEARNINGS`` (0 or 1; the test suite sets 0), else True
    keep_learnings: bool | None = None

    def __post_init__(self) -> None:
        if self.keep_learnings is not None and not isinstance(self.keep_learnings, bool):
            raise ConfigError(f"keep_learnings={self.keep_learnings!r}; allowed: True, False or None "
                              f"(${KEEP_LEARNINGS_ENV}, else True)")
        for key, low in (("max_model_len", 2), ("max_num_seqs", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{key}={value!r}; allowed: an int >= {low}")
        if self.kv_blocks is not None and (isinstance(self.kv_blocks, bool) or not isinstance(self.kv_blocks, int)
                                           or self.kv_blocks < 2):
            raise ConfigError(f"kv_blocks={self.kv_blocks!r}; allowed: an int >= 2 (block 0 is reserved)")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 16 or bs % 16 or bs > MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size={bs!r}; allowed: a multiple of 16 up to {MAX_BLOCK_SIZE} "
                              "(16: vLLM CPU_MLA, 64: FlashMLA, 128: vllm-ascend MLA)")
        try:
            object.__setattr__(self, "kv_layout", canonical_layout(self.kv_layout))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.warm_graphs not in WARM_GRAPHS:
            raise ConfigError(f"warm_graphs={self.warm_graphs!r}; allowed: {list(WARM_GRAPHS)}")
        if self.graph_failure is not None and self.graph_failure not in GRAPH_FAILURE_POLICIES:
            raise ConfigError(f"graph_failure={self.graph_failure!r}; allowed: {list(GRAPH_FAILURE_POLICIES)}")
        if self.adaptive_k and not self.fused_step and self.speculative is not None:
            # the step-by-step path drafts through the proposer's one K_max graph: it cannot follow adaptive K
            raise ConfigError("adaptive_k=True needs fused_step=True: the step-by-step path (fused_step=False, "
                              "--step-by-step) drafts num_speculative_tokens every step; allowed with "
                              "fused_step=False: adaptive_k=False (--fixed-k)")


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """Read a YAML file holding ``speculative_config`` and/or ``additional_config.torchair_graph_config``."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ConfigError(f"{path}: not valid YAML{at} ({getattr(exc, 'problem', None) or exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, found {type(data).__name__}")
    _check_keys(str(path), data, ("speculative_config", "additional_config", "max_model_len", "max_num_seqs",
                                  "kv_blocks", "block_size", "kv_layout"))
    for section in ("speculative_config", "additional_config"):
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(f"{path}: {section} must be a mapping of keys, got {data[section]!r}")
    extra = data.get("additional_config") or {}
    _check_keys(f"{path}: additional_config", extra, ("torchair_graph_config",))
    graph = extra.get("torchair_graph_config") or {}
    if not isinstance(graph, dict):
        raise ConfigError(f"{path}: additional_config.torchair_graph_config must be a mapping of keys, got {graph!r}")
    return data


def __getattr__(name: str) -> Any:
    # the class's name before it was named for graph mode on every backend, not for torchair alone
    if name == "TorchairGraphConfig":
        warnings.warn("ascend_spec.config.TorchairGraphConfig is deprecated; use GraphModeConfig",
                      DeprecationWarning, stacklevel=2)
        return GraphModeConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
