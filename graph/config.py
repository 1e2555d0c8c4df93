"""Model configuration read from a HF DeepSeek-V3 ``config.json``.

Only the dense-MLP DeepSeek-V3 variant is supported (every layer dense, MTP layer included), with
MLA attention and an optional ``q_lora_rank`` (``null`` means a plain ``q_proj``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("deepseek_v3",)
# vLLM's CPU MLA kernel only takes a latent of 576 = kv_lora_rank + qk_rope_head_dim and block size 16.
KV_BLOCK_SIZE = 16


class ConfigError(ValueError):
    """A checkpoint config that this project cannot run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_nextn_predict_layers: int = 1
    q_lora_rank: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    eos_token_id: int | None = None
    bos_token_id: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: normalised latent ``c_kv`` followed by the roped ``k_pe``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"config.json: model_type={model_type!r}, architectures={archs!r}; "
                f"expected model_type in {SUPPORTED_MODEL_TYPES} and architectures containing one of "
                f"{SUPPORTED_ARCHITECTURES}"
            )
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json: missing required key(s) {missing}")
        n_layers = hf["num_hidden_layers"]
        first_dense = hf.get("first_k_dense_replace", n_layers + 1)
        if hf.get("n_routed_experts") and first_dense <= n_layers:
            raise ConfigError(
                f"config.json: first_k_dense_replace={first_dense} makes layers MoE; only dense layers are "
                f"supported: set first_k_dense_replace > num_hidden_layers ({n_layers}) so the MTP layer is dense too"
            )
        if hf.get("rope_scaling"):
            raise ConfigError(f"config.json: rope_scaling={hf['rope_scaling']!r}; only null (plain RoPE) is supported")
        if hf.get("num_nextn_predict_layers", 0) < 1:
            raise ConfigError("config.json: num_nextn_predict_layers must be >= 1 for MTP speculative decoding")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=hf["num_attention_heads"],
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 1),
            q_lora_rank=hf.get("q_lora_rank"),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            eos_token_id=eos,
            bos_token_id=hf.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    def to_hf_dict(self, dtype: str = "float32") -> dict:
        """The HF ``config.json`` that both this project and vLLM's ``DeepseekV3ForCausalLM`` load."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "n_shared_experts": 1,
            "n_routed_experts": 1,
            "num_experts_per_tok": 1,
            "routed_scaling_factor": 1.0,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "moe_layer_freq": 1,
            # > num_hidden_layers: every layer, the MTP layer at index num_hidden_layers included, is dense.
            "first_k_dense_replace": self.num_hidden_layers + 1,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": dtype,
        }
