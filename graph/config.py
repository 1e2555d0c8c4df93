"""Model configuration read from a HF DeepSeek-V3 ``config.json``.
It covers what DeepSeek-V3/R1 checkpoints use; anything else is one :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from .latent_cache import LatentCache, allocate_latent_cache

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("deepseek_v3",)
ROPE_SCALING_TYPES = ("yarn", "deepseek_yarn")
QUANT_METHODS = ("fp8",)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A checkpoint config that this project cannot run."""


def read_config_json(model_dir: str | Path) -> tuple[Path, dict]:
    """``(path, the JSON object)`` of ``{model_dir}/config.json``, or one :class:`ConfigError`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(hf).__name__}")
    return path, hf


T = TypeVar("T")


def parse_config(path: Path, parse: Callable[[dict], T], hf: dict) -> T:
    """``parse(hf)``, a malformed value (e.g. rope_scaling given as a string) reported as one :class:`ConfigError`."""
    try:
        return parse(hf)
    except ConfigError:
        raise
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{path}: malformed value ({type(exc).__name__}: {exc})") from exc


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: ``0.1·m·ln(s) + 1`` for ``s > 1``, else 1 (vLLM's ``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """``rope_scaling`` of type ``yarn`` / ``deepseek_yarn`` (DeepSeek-V3: factor 40 over 4096 positions)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def cos_sin_scale(self) -> float:
        """cos/sin are multiplied by this (1.0 for DeepSeek-V3, where mscale == mscale_all_dim)."""
        return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_scale_factor(self) -> float:
        """The MLA softmax scale is multiplied by ``mscale(factor, mscale_all_dim)²``."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2

    @classmethod
    def from_hf(cls, rs: dict) -> "YarnScaling":
        kind = rs.get("type", rs.get("rope_type"))
        if kind not in ROPE_SCALING_TYPES:
            raise ConfigError(f"config.json: rope_scaling.type={kind!r} is not supported; "
                              f"allowed: {list(ROPE_SCALING_TYPES)} or rope_scaling null")
        for key in ("factor", "original_max_position_embeddings"):
            if key not in rs:
                raise ConfigError(f"config.json: rope_scaling ({kind}) needs {key!r}")
        if rs["factor"] < 1:
            raise ConfigError(f"config.json: rope_scaling.factor={rs['factor']}; allowed: >= 1")
        return cls(factor=float(rs["factor"]),
                   original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                   beta_fast=float(rs.get("beta_fast", 32)), beta_slow=float(rs.get("beta_slow", 1)),
                   mscale=float(rs.get("mscale", 1)), mscale_all_dim=float(rs.get("mscale_all_dim", 0)))

    def to_hf(self) -> dict:
        return {"type": "yarn", "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "mscale": self.mscale,
                "mscale_all_dim": self.mscale_all_dim}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """DeepSeekMoE (noaux_tc routing): grouped top-k over sigmoid scores, plus shared experts."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if e < 1 or not 1 <= k <= e:
            raise ConfigError(f"config.json: num_experts_per_tok={k} with n_routed_experts={e}; "
                              f"allowed: 1 <= num_experts_per_tok <= n_routed_experts")
        if self.n_group < 1 or e % self.n_group:
            raise ConfigError(f"config.json: n_routed_experts={e} is not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"config.json: topk_group={self.topk_group} > n_group={self.n_group}; "
                              f"allowed: 1 <= topk_group <= n_group")
        per_group = e // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ConfigError(f"config.json: n_group={self.n_group} leaves {per_group} expert per group; "
                              "group scores sum each group's top-2, so each group needs >= 2 experts")
        if k > self.topk_group * per_group:
            raise ConfigError(f"config.json: num_experts_per_tok={k} > topk_group × experts per group "
                              f"({self.topk_group} × {per_group})")
        if self.moe_layer_freq < 1:
            raise ConfigError(f"config.json: moe_layer_freq={self.moe_layer_freq}; allowed: >= 1")

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def is_moe_layer(self, index: int) -> bool:
        """vLLM's rule (``deepseek_v2.py``): MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th."""
        return index >= self.first_k_dense_replace and index % self.moe_layer_freq == 0


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """DeepSeek's fp8 checkpoints: e4m3 weights with one fp32 ``weight_scale_inv`` per 128×128 block."""

    method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)

    @classmethod
    def from_hf(cls, qc: dict) -> "QuantConfig":
        method = qc.get("quant_method")
        if method not in QUANT_METHODS:
            raise ConfigError(f"config.json: quantization_config.quant_method={method!r} is not supported; "
                              f"allowed: {list(QUANT_METHODS)} (DeepSeek's block fp8) or no quantization_config")
        block = qc.get("weight_block_size") or [128, 128]
        if len(block) != 2 or min(block) < 1:
            raise ConfigError(f"config.json: quantization_config.weight_block_size={block}; allowed: [rows, cols]")
        return cls(method, (int(block[0]), int(block[1])))


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
    moe: MoEConfig | None = None  # None: every layer dense
    rope_scaling: YarnScaling | None = None
    torch_dtype: str = "float32"
    quantization: QuantConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token: normalised latent ``c_kv`` followed by the roped ``k_pe``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_token_width(self) -> int:
        """Elements one token takes in one layer's cache (``layer_cache``): the latent."""
        return self.latent_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        return scale * self.rope_scaling.softmax_scale_factor if self.rope_scaling else scale

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` (MTP layers at ``num_hidden_layers + i``) runs DeepSeekMoE instead of a dense MLP."""
        return self.moe is not None and self.moe.is_moe_layer(index)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    #: the ``config.json`` this family reads: model types, and the architectures one of which it must name
    MODEL_TYPES = SUPPORTED_MODEL_TYPES
    ARCHITECTURES = SUPPORTED_ARCHITECTURES

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type not in cls.MODEL_TYPES or not any(a in cls.ARCHITECTURES for a in archs):
            raise ConfigError(
                f"config.json: model_type={model_type!r}, architectures={archs!r}; "
                f"expected model_type in {cls.MODEL_TYPES} and architectures containing one of "
                f"{cls.ARCHITECTURES}"
            )
        return cls(**cls.fields_from_hf(hf))

    @classmethod
    def fields_from_hf(cls, hf: dict) -> dict:
        """This class's fields read from an HF ``config.json`` (MLA, MoE, RoPE, dtype, quantisation): what a family
        built on DeepSeek-V3's MLA reads alike before its own keys."""
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        missing = [k for k in required if k not in hf]
        if missing:
            raise ConfigError(f"config.json: missing required key(s) {missing}")
        n_layers = hf["num_hidden_layers"]
        if hf.get("num_nextn_predict_layers", 0) < 1:
            raise ConfigError("config.json: num_nextn_predict_layers must be >= 1 for MTP speculative decoding")
        moe = _moe_from_hf(hf, n_layers + hf["num_nextn_predict_layers"])
        rope_theta, rope_scaling = _rope_from_hf(hf)
        quant = QuantConfig.from_hf(hf["quantization_config"]) if hf.get("quantization_config") else None
        torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if torch_dtype not in DTYPES:
            raise ConfigError(f"config.json: torch_dtype={torch_dtype!r}; allowed: {list(DTYPES)}")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return dict(
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
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            eos_token_id=eos,
            bos_token_id=hf.get("bos_token_id"),
            moe=moe,
            rope_scaling=rope_scaling,
            torch_dtype=torch_dtype,
            quantization=quant,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """``{model_dir}/config.json``; every way it can be wrong is one :class:`ConfigError`."""
        path, hf = read_config_json(model_dir)
        return parse_config(path, cls.from_hf_dict, hf)

    def layer_cache(self, layout: str, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device | str) -> LatentCache:
        """One layer's paged cache (target or draft): the latent ``[c_kv ; k_pe]`` per token, ``layout``
        ``single`` or ``pair`` (see :mod:`.latent_cache`)."""
        return allocate_latent_cache(layout, num_blocks, block_size, self.kv_lora_rank, self.qk_rope_head_dim, dtype,
                                     device)

    def sparse_attention(self) -> dict | None:
        """What selects the tokens each query attends to, for ``inspect``; None: every cached token (dense MLA)."""
        return None

    def to_hf_dict(self, dtype: str | None = None) -> dict:
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
            **self._moe_hf_dict(),
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
            "rope_scaling": self.rope_scaling.to_hf() if self.rope_scaling else None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": dtype or self.torch_dtype,
        }

    def _moe_hf_dict(self) -> dict:
        if self.moe is None:
            # first_k_dense_replace > every layer index (the MTP layer's included): all dense, for HF and vLLM alike.
            return {"n_shared_experts": 1, "n_routed_experts": 1, "num_experts_per_tok": 1,
                    "moe_intermediate_size": self.intermediate_size, "routed_scaling_factor": 1.0, "n_group": 1,
                    "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
                    "moe_layer_freq": 1, "first_k_dense_replace": self.num_layers_with_mtp}
        m = self.moe
        return {"n_shared_experts": m.n_shared_experts, "n_routed_experts": m.n_routed_experts,
                "num_experts_per_tok": m.num_experts_per_tok, "moe_intermediate_size": m.moe_intermediate_size,
                "routed_scaling_factor": m.routed_scaling_factor, "n_group": m.n_group, "topk_group": m.topk_group,
                "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": m.norm_topk_prob,
                "moe_layer_freq": m.moe_layer_freq, "first_k_dense_replace": m.first_k_dense_replace}


def _rope_from_hf(hf: dict) -> tuple[float, YarnScaling | None]:
    """``(rope_theta, YaRN or None)`` from ``rope_theta`` / ``rope_scaling``, or from ``rope_parameters`` (how
    transformers 5 writes them: GLM-5's and DeepSeek-V3.2's configs)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_scaling" not in hf:
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, None if kind == "default" else YarnScaling.from_hf(params)
    return hf.get("rope_theta", 10000.0), YarnScaling.from_hf(hf["rope_scaling"]) if hf.get("rope_scaling") else None


def _moe_from_hf(hf: dict, num_layers_with_mtp: int) -> MoEConfig | None:
    """The MoE block of a config, or None when no layer (MTP included) is MoE."""
    experts = hf.get("n_routed_experts")
    first_dense = hf.get("first_k_dense_replace", 0)
    if not experts or first_dense >= num_layers_with_mtp:
        return None
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, allowed) != allowed:
            raise ConfigError(f"config.json: {key}={hf[key]!r} is not supported; allowed: {allowed!r} "
                              "(DeepSeek-V3/R1 routing)")
    missing = [k for k in ("num_experts_per_tok", "moe_intermediate_size") if k not in hf]
    if missing:
        raise ConfigError(f"config.json: n_routed_experts={experts} needs {missing}")
    return MoEConfig(
        n_routed_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]), n_shared_experts=int(hf.get("n_shared_experts") or 0),
        n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)), first_k_dense_replace=int(first_dense),
        moe_layer_freq=int(hf.get("moe_layer_freq", 1)))
