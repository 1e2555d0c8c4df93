"""DeepSeek-V3 (dense-MLP variant) target model and its MTP layer, with HF parameter names.

``state_dict()`` keys are exactly DeepSeek-V3's HF names, the MTP layer sitting at index
``num_hidden_layers``. Two call paths share one set of weights:
- ``*_paged``: fixed-shape ``[B, Q]`` batches over a paged latent cache (prefill, decode, verify, draft);
- ``*_dense``: full causal sequences without a cache (training, reference).
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import MLAttention, PagedInputs
from .config import ModelConfig
from .layers import MLP, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward_paged(self, x: torch.Tensor, inp: PagedInputs, cache: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn.forward_paged(self.input_layernorm(x), inp, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn.forward_dense(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 multi-token prediction module: predicts token t+2 from h_t and token t+1.

    ``eh_proj([enorm(embed(next_token)); hnorm(hidden)])`` → decoder layer → (``shared_head``) logits.
    The returned hidden state is pre-``shared_head.norm`` and feeds the next chained step, as in vLLM.
    """

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__(cfg, rope)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def fuse_inputs(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens(next_token_ids)
        # vLLM zeroes the token embedding at position 0; match it so drafts agree token for token.
        emb = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(emb), emb)
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))

    def forward_paged_mtp(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs,
                          cache: torch.Tensor) -> torch.Tensor:
        return self.forward_paged(self.fuse_inputs(next_token_ids, hidden, inp.positions), inp, cache)

    def forward_dense_mtp(self, next_token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        b, s = next_token_ids.shape
        positions = torch.arange(s, device=hidden.device).expand(b, s)
        return self.forward_dense(self.fuse_inputs(next_token_ids, hidden, positions))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(cfg, rope) for _ in range(cfg.num_hidden_layers)]
        layers += [MTPLayer(cfg, rope) for _ in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekV3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.cfg.num_hidden_layers])

    def mtp_layer(self, step: int = 0) -> MTPLayer:
        """MTP layer for draft step ``step``; with fewer MTP layers than steps, vLLM reuses them cyclically."""
        n = self.cfg.num_nextn_predict_layers
        return self.model.layers[self.cfg.num_hidden_layers + step % n]  # type: ignore[return-value]

    # -- target ---------------------------------------------------------------------------------
    def target_paged(self, input_ids: torch.Tensor, inp: PagedInputs, caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [B, Q] → final-normed hidden [B, Q, D] (what the MTP layer consumes)."""
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.decoder_layers, caches):
            x = layer.forward_paged(x, inp, cache)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def target_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.decoder_layers:
            x = layer.forward_dense(x)
        return self.model.norm(x)

    # -- MTP ------------------------------------------------------------------------------------
    def mtp_paged(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs, cache: torch.Tensor,
                  step: int = 0) -> torch.Tensor:
        return self.mtp_layer(step).forward_paged_mtp(next_token_ids, hidden, inp, cache)

    def mtp_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.mtp_layer(step).shared_head(hidden).float()
