"""The DSA family's configuration: DeepSeek-V3's MLA, MoE and RoPE fields plus the lightning indexer's, read from a
DeepSeek-V3.2 (``deepseek_v32``) or GLM-5.x (``glm_moe_dsa``) ``config.json``."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ConfigError, ModelConfig
from ..latent_cache import LatentCache, allocate_latent_cache

#: per target layer: ``full`` runs its own indexer; ``shared`` reuses the top-k of the last ``full`` layer before it
INDEXER_TYPES = ("full", "shared")
#: ``index_topk_pattern``'s letters (vLLM and transformers read it alike)
PATTERN_LETTERS = {"F": "full", "S": "shared"}
#: the indexer's RoPE: DeepSeek-V3.2 rotates the two halves of its rope slice (NeoX style), GLM-5 adjacent pairs
INDEXER_ROPE = {"deepseek_v32": "half", "glm_moe_dsa": "interleaved"}
#: the indexer key's LayerNorm eps (transformers and vLLM both fix it)
INDEXER_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class IndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer: ``n_heads`` heads of ``head_dim`` (its first
    ``qk_rope_head_dim`` channels roped) score every cached token; each query attends only its ``topk``."""

    n_heads: int
    head_dim: int
    topk: int
    #: ``half`` (DeepSeek-V3.2) or ``interleaved`` (GLM-5)
    rope: str
    #: per target layer, ``full`` or ``shared`` (GLM-5.2's cross-layer top-k sharing); the MTP layers run their own
    layer_types: tuple[str, ...]
    #: vLLM's ``index_share_for_mtp_iteration``: draft steps 2..K reuse the top-k draft step 1 chose
    share_for_mtp: bool = False

    def __post_init__(self) -> None:
        for key, value in (("index_n_heads", self.n_heads), ("index_head_dim", self.head_dim),
                           ("index_topk", self.topk)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: {key}={value!r}; allowed: an integer >= 1")
        if self.rope not in ("half", "interleaved"):
            raise ConfigError(f"indexer rope={self.rope!r}; allowed: ['half', 'interleaved']")
        bad = [t for t in self.layer_types if t not in INDEXER_TYPES]
        if bad:
            raise ConfigError(f"config.json: indexer_types has {bad[0]!r}; allowed: {list(INDEXER_TYPES)}")
        if self.layer_types and self.layer_types[0] != "full":
            raise ConfigError("config.json: indexer_types[0]='shared'; allowed: 'full' (a shared layer reuses the "
                              "top-k of a full layer before it)")


@dataclass(frozen=True, slots=True)
class DsaConfig(ModelConfig):
    """MLA + DeepSeek Sparse Attention: DeepSeek-V3.2 and GLM-5.x (their MTP layers run a full DSA layer)."""

    MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
    ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")

    model_type: str = "glm_moe_dsa"
    indexer: IndexerConfig = field(default=None)  # type: ignore[assignment]  # required: from_hf_dict sets it

    def __post_init__(self) -> None:
        if self.indexer is None:
            raise ConfigError("DsaConfig needs an indexer (index_n_heads, index_head_dim, index_topk)")
        if not self.q_lora_rank:
            raise ConfigError("config.json: q_lora_rank is null; allowed: an integer >= 1 (the indexer's query "
                              "reads the query latent)")
        if self.indexer.head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"config.json: index_head_dim={self.indexer.head_dim} < qk_rope_head_dim="
                              f"{self.qk_rope_head_dim}; allowed: >= qk_rope_head_dim (its first channels are roped)")
        if len(self.indexer.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"config.json: indexer_types has {len(self.indexer.layer_types)} entries for "
                              f"num_hidden_layers={self.num_hidden_layers}; allowed: one per layer")

    @classmethod
    def fields_from_hf(cls, hf: dict) -> dict:
        fields = ModelConfig.fields_from_hf(hf)
        model_type = hf["model_type"]
        layer_types = _indexer_types(hf, fields["num_hidden_layers"])
        for key in ("index_n_heads", "index_head_dim", "index_topk"):
            if key not in hf:
                raise ConfigError(f"config.json: missing required key {key!r} (model_type {model_type!r})")
        _check_mlp_layer_types(hf, fields)
        fields["model_type"] = model_type
        fields["indexer"] = IndexerConfig(
            n_heads=hf["index_n_heads"], head_dim=hf["index_head_dim"], topk=hf["index_topk"],
            rope=INDEXER_ROPE[model_type], layer_types=layer_types,
            share_for_mtp=bool(hf.get("index_share_for_mtp_iteration", False)))
        return fields

    def layer_cache(self, layout: str, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device | str) -> LatentCache:
        """The latent cache (one tensor or the nope / rope pair) followed by the indexer's key cache
        ``[blocks, block, index_head_dim]``, as one flat tuple: ``(c_kv ; k_pe, index_k)`` or
        ``(nope, rope, index_k)`` (vllm-ascend's SFA tuple)."""
        latent = allocate_latent_cache(layout, num_blocks, block_size, self.kv_lora_rank, self.qk_rope_head_dim,
                                       dtype, device)
        keys = torch.zeros(num_blocks, block_size, self.indexer.head_dim, dtype=dtype, device=device)
        return (latent, keys) if isinstance(latent, torch.Tensor) else (*latent, keys)

    @property
    def cache_token_width(self) -> int:
        """The latent and the index key."""
        return self.latent_dim + self.indexer.head_dim

    def sparse_attention(self) -> dict:
        """The lightning indexer and each layer's top-k source."""
        ix = self.indexer
        return {"index_topk": ix.topk, "index_n_heads": ix.n_heads, "index_head_dim": ix.head_dim,
                "indexer_rope": ix.rope, "indexer_types": list(ix.layer_types), "share_for_mtp": ix.share_for_mtp}

    def to_hf_dict(self, dtype: str | None = None) -> dict:
        hf = ModelConfig.to_hf_dict(self, dtype)
        arch = self.ARCHITECTURES[self.MODEL_TYPES.index(self.model_type)]
        first_dense = hf["first_k_dense_replace"]
        hf.update({
            "architectures": [arch], "model_type": self.model_type,
            "index_n_heads": self.indexer.n_heads, "index_head_dim": self.indexer.head_dim,
            "index_topk": self.indexer.topk, "indexer_types": list(self.indexer.layer_types),
            "index_share_for_mtp_iteration": self.indexer.share_for_mtp,
            # transformers reads the MLP kind per target layer from this list (vLLM from first_k_dense_replace)
            "mlp_layer_types": ["sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)],
            "first_k_dense_replace": first_dense,
        })
        return hf


def _indexer_types(hf: dict, num_layers: int) -> tuple[str, ...]:
    """``indexer_types``, else ``index_topk_pattern`` (letters F / S), else ``index_topk_freq`` /
    ``index_skip_topk_offset`` (every layer full by default), as transformers and vLLM derive them."""
    if hf.get("indexer_types") is not None:
        types = hf["indexer_types"]
        if not isinstance(types, list):
            raise ConfigError(f"config.json: indexer_types={types!r}; allowed: a list of {list(INDEXER_TYPES)}")
        return tuple(types)
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        letters = list(pattern)
        bad = [c for c in letters if c not in PATTERN_LETTERS]
        if bad:
            raise ConfigError(f"config.json: index_topk_pattern has {bad[0]!r}; allowed letters: "
                              f"{list(PATTERN_LETTERS)}")
        return tuple(PATTERN_LETTERS[c] for c in letters)
    freq = hf.get("index_topk_freq", 1)
    offset = hf.get("index_skip_topk_offset", 2)
    if not isinstance(freq, int) or freq < 1:
        raise ConfigError(f"config.json: index_topk_freq={freq!r}; allowed: an integer >= 1")
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def _check_mlp_layer_types(hf: dict, fields: dict) -> None:
    """A ``mlp_layer_types`` list must say what ``first_k_dense_replace`` / ``moe_layer_freq`` say (we place MoE
    layers by those, as vLLM does); one that disagrees is refused rather than silently overridden."""
    given = hf.get("mlp_layer_types")
    if given is None:
        return
    moe = fields["moe"]
    expected = ["sparse" if moe is not None and moe.is_moe_layer(i) else "dense"
                for i in range(fields["num_hidden_layers"])]
    if list(given) != expected:
        raise ConfigError(f"config.json: mlp_layer_types={list(given)} disagrees with first_k_dense_replace / "
                          f"moe_layer_freq, which place MoE layers at {expected}; allowed: that list or none")
