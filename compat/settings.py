"""How a vLLM user turns the ascend_spec drafter on: a block in ``additional_config``.
The ``ascend_spec`` keys and the ``torchair_graph_config`` block, validated; importing it never imports vLLM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ascend_spec.config import GRAPH_FAILURE_POLICIES, ConfigError, GraphModeConfig, default_graph_batch_sizes

ADDITIONAL_CONFIG_KEY = "ascend_spec"
GRAPH_CONFIG_KEY = "torchair_graph_config"
SETTINGS_KEYS = ("enabled", "warmup", "collect_stats", "stats_dir", "stats_interval_s", "graph_failure", "k_schedule")
#: ``k_schedule``: auto, K per batch size from measurements where the user wrote no schedule
#: (``speculative_config.num_speculative_tokens_per_batch_size``); fixed, every step drafts num_speculative_tokens
K_SCHEDULES = ("auto", "fixed")
DEFAULT_MAX_GRAPH_BATCH = 16
#: seconds between rewrites of the per-rank stats file while drafting, unless ``stats_interval_s`` says otherwise
DEFAULT_STATS_INTERVAL_S = 5.0
METHODS = ("mtp", "deepseek_mtp")


@dataclass(frozen=True, slots=True)
class PluginSettings:
    enabled: bool = False
    warmup: bool = True
    collect_stats: bool = False
    stats_dir: str | None = None
    #: seconds between rewrites of the stats file while serving (0: after every draft call)
    stats_interval_s: float = DEFAULT_STATS_INTERVAL_S
    #: None: ``$ASCEND_SPEC_GRAPH_FAILURE``, else ``eager`` (resolved where the backend is built)
    graph_failure: str | None = None
    k_schedule: str = "auto"
    graph: GraphModeConfig = field(default_factory=GraphModeConfig)

    @classmethod
    def from_additional_config(cls, extra: Any) -> "PluginSettings":
        """Settings from vLLM's ``additional_config``; disabled when the ``ascend_spec`` block is absent."""
        if not isinstance(extra, dict) or extra.get(ADDITIONAL_CONFIG_KEY) is None:
            return cls()
        block = extra[ADDITIONAL_CONFIG_KEY]
        where = f"additional_config.{ADDITIONAL_CONFIG_KEY}"
        if not isinstance(block, dict):
            raise ConfigError(f"{where} must be a mapping such as {{'enabled': true}}, got {block!r}")
        unknown = sorted(set(block) - set(SETTINGS_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed keys: {sorted(SETTINGS_KEYS)}")
        for key in ("enabled", "warmup", "collect_stats"):
            if key in block and not isinstance(block[key], bool):
                raise ConfigError(f"{where}.{key} must be true or false, got {block[key]!r}")
        stats_dir = block.get("stats_dir")
        if stats_dir is not None and (not isinstance(stats_dir, str) or not stats_dir):
            raise ConfigError(f"{where}.stats_dir must be a folder path (string), got {stats_dir!r}")
        interval = block.get("stats_interval_s", DEFAULT_STATS_INTERVAL_S)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 <= interval < math.inf:
            raise ConfigError(f"{where}.stats_interval_s must be a number of seconds >= 0, got {interval!r}")
        policy = block.get("graph_failure")
        if policy is not None and policy not in GRAPH_FAILURE_POLICIES:
            raise ConfigError(f"{where}.graph_failure={policy!r}; allowed: {list(GRAPH_FAILURE_POLICIES)}")
        schedule = block.get("k_schedule", "auto")
        if schedule not in K_SCHEDULES:
            raise ConfigError(f"{where}.k_schedule={schedule!r}; allowed: {list(K_SCHEDULES)}")
        return cls(enabled=block.get("enabled", True), warmup=block.get("warmup", True),
                   collect_stats=block.get("collect_stats", False), stats_dir=stats_dir,
                   stats_interval_s=float(interval), graph_failure=policy, k_schedule=schedule,
                   graph=GraphModeConfig.from_dict(extra.get(GRAPH_CONFIG_KEY)))

    def batch_sizes(self, max_num_seqs: int, num_speculative_tokens: int = 0, token_multiple: int = 1) -> list[int]:
        """Graph buckets in requests; see :func:`graph_size_plan` for the token-count rule."""
        g = self.graph
        explicit = bool(g.graph_batch_sizes or g.graph_batch_sizes_init)
        sizes = (g.batch_sizes(max_num_seqs) if explicit
                 else default_graph_batch_sizes(min(max_num_seqs, DEFAULT_MAX_GRAPH_BATCH)))
        return graph_size_plan(sizes, num_speculative_tokens, token_multiple, explicit)


def graph_size_plan(sizes: list[int], num_speculative_tokens: int, token_multiple: int = 1,
                    explicit: bool = True) -> list[int]:
    """Buckets whose graphs hold ``size × (1 + K)`` tokens, each a multiple of ``token_multiple``.

    ``token_multiple`` is the tensor-parallel size: vllm-ascend's graphs split a graph's tokens across the TP ranks
    (sequence parallel / flashcomm), and a token count that does not divide stopped engines at start ("Can't
    determine cudagraph shapes ... multiple of 6 ... and 4"). Sizes the user chose must meet it (one error naming
    the values); default sizes are rounded up to the next size that does.
    """
    q = 1 + num_speculative_tokens
    if token_multiple <= 1:
        return sorted(set(sizes))
    bad = [s for s in sizes if (s * q) % token_multiple]
    if bad and explicit:
        raise ConfigError(
            f"{GRAPH_CONFIG_KEY}.graph_batch_sizes {bad}: a graph holds size × (1 + num_speculative_tokens="
            f"{num_speculative_tokens}) tokens = {[s * q for s in bad]}, which must be multiples of the "
            f"tensor-parallel size {token_multiple}; allowed sizes are multiples of "
            f"{token_multiple // math.gcd(q, token_multiple)}")
    step = token_multiple // math.gcd(q, token_multiple)
    return sorted({-(-s // step) * step for s in sizes})

