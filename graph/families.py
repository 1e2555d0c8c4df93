"""The model families we draft, by HF ``model_type``: each a config class and a model class behind
:class:`.family.MtpModel`; a new family is a folder beside :mod:`.dsa` and one entry here."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError, ModelConfig, parse_config, read_config_json
from .dsa.config import DsaConfig
from .dsa.model import DsaForCausalLM
from .family import MtpModel
from .model import DeepseekV3ForCausalLM


@dataclass(frozen=True)
class Family:
    name: str
    config: type[ModelConfig]
    model: type[DeepseekV3ForCausalLM]


FAMILIES: tuple[Family, ...] = (
    Family("DeepSeek-V3/R1 (MLA)", ModelConfig, DeepseekV3ForCausalLM),
    Family("DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5.x)", DsaConfig, DsaForCausalLM),
)


def family_for_model_type(model_type: object) -> Family:
    for family in FAMILIES:
        if model_type in family.config.MODEL_TYPES:
            return family
    known = [t for f in FAMILIES for t in f.config.MODEL_TYPES]
    raise ConfigError(f"config.json: model_type={model_type!r} is not a family we draft; allowed: {known} "
                      f"({'; '.join(f.name for f in FAMILIES)})")


def config_from_hf(hf: dict) -> ModelConfig:
    """The config of whichever family ``hf['model_type']`` names."""
    return family_for_model_type(hf.get("model_type")).config.from_hf_dict(hf)


def config_from_dir(model_dir: str | Path) -> ModelConfig:
    """``{model_dir}/config.json`` read by its family; every way it can be wrong is one :class:`ConfigError`."""
    path, hf = read_config_json(model_dir)
    return parse_config(path, config_from_hf, hf)


def build_model(cfg: ModelConfig) -> MtpModel:
    """The family's model for ``cfg`` (parameters on the current default device)."""
    for family in FAMILIES:
        if type(cfg) is family.config:
            return family.model(cfg)
    raise ConfigError(f"no model family for config {type(cfg).__name__}")
