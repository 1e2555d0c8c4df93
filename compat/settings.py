"""How a vLLM user turns the ascend_spec drafter on: a block in ``additional_config``.

    LLM(model=...,
        speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2},
        additional_config={
            "ascend_spec": {"enabled": True},                       # the switch (this key, this block)
            "torchair_graph_config": {"backend": "auto",            # vllm-ascend's block, optional
                                      "graph_batch_sizes": [1, 2, 4, 8]},
        })

``ascend_spec`` keys: ``enabled`` (default true once the block is present), ``warmup`` (compile every
graph bucket when vLLM sets up the KV cache; default true), ``collect_stats`` (record the async
scheduling conditions seen per step; default false, costs host reads). ``torchair_graph_config`` is
validated by :meth:`TorchairGraphConfig.from_dict`; ``backend: auto`` picks torchair on an NPU and
inductor on CUDA or CPU. Without ``graph_batch_sizes`` the buckets are nano-vllm's
``[1, 2, 4, 8, 16, ...]`` up to ``min(max_num_seqs, 16)``; bigger batches run the same draft eagerly.

Pure Python: importing this module never imports vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascend_spec.config import ConfigError, TorchairGraphConfig, default_graph_batch_sizes

ADDITIONAL_CONFIG_KEY = "ascend_spec"
GRAPH_CONFIG_KEY = "torchair_graph_config"
SETTINGS_KEYS = ("enabled", "warmup", "collect_stats")
DEFAULT_MAX_GRAPH_BATCH = 16
METHODS = ("mtp", "deepseek_mtp")


@dataclass(frozen=True, slots=True)
class PluginSettings:
    enabled: bool = False
    warmup: bool = True
    collect_stats: bool = False
    graph: TorchairGraphConfig = field(default_factory=TorchairGraphConfig)

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
        for key in SETTINGS_KEYS:
            if key in block and not isinstance(block[key], bool):
                raise ConfigError(f"{where}.{key} must be true or false, got {block[key]!r}")
        return cls(enabled=block.get("enabled", True), warmup=block.get("warmup", True),
                   collect_stats=block.get("collect_stats", False),
                   graph=TorchairGraphConfig.from_dict(extra.get(GRAPH_CONFIG_KEY)))

    def batch_sizes(self, max_num_seqs: int) -> list[int]:
        g = self.graph
        if g.graph_batch_sizes or g.graph_batch_sizes_init:
            return g.batch_sizes(max_num_seqs)
        return default_graph_batch_sizes(min(max_num_seqs, DEFAULT_MAX_GRAPH_BATCH))
