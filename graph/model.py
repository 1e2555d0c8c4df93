"""DeepSeek-V3 target model and its MTP layer(s), with HF parameter names.
Two call paths share one set of weights: ``*_paged`` (fixed shapes over a paged latent cache) and ``*_dense``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .attention import MLAttention
from .paging import PagedInputs
from .config import ModelConfig
from .latent_cache import LatentCache
from .layers import MLP, Embedding, Linear, RMSNorm, RotaryEmbedding
from .mla_kernels import HOST_LENGTH_KERNELS, KERNELS
from .moe import MoE

if TYPE_CHECKING:
    from .backends.base import Backend


def _decoder_layer_paged(layer: "DecoderLayer", x: torch.Tensor, inp: PagedInputs, cache: LatentCache) -> torch.Tensor:
    h = x + layer.self_attn.forward_paged(layer.input_layernorm(x), inp, cache)
    return h + layer.mlp(layer.post_attention_layernorm(h))


#: One compile of a layer body, replayed for every layer of the same structure and input shapes (inductor
#: compiles it once instead of once per layer: start-up is a feature). Eager, it is the plain function.
_decoder_layer_region = torch.compiler.nested_compile_region(_decoder_layer_paged)


class DecoderLayer(nn.Module):
    #: set by ``DeepseekV3ForCausalLM.set_compile_regions``
    compile_region = False

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (MoE(cfg.hidden_size, cfg.moe) if cfg.moe is not None and cfg.is_moe_layer(index)
                               else MLP(cfg.hidden_size, cfg.intermediate_size))

    def forward_paged(self, x: torch.Tensor, inp: PagedInputs, cache: LatentCache) -> torch.Tensor:
        return (_decoder_layer_region if self.compile_region else _decoder_layer_paged)(self, x, inp, cache)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn.forward_dense(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedHead(nn.Module):
    """``shared_head.norm``; the projection is the target's lm_head (``shared_head.head`` is not held)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 multi-token prediction module: predicts token t+2 from h_t and token t+1.

    ``eh_proj([enorm(embed(next_token)); hnorm(hidden)])`` → decoder layer → ``lm_head(shared_head.norm(·))``.
    The returned hidden state is pre-``shared_head.norm`` and feeds the next chained step, as in vLLM.
    """

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, index: int) -> None:
        super().__init__(cfg, rope, index)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def fuse_inputs(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # vLLM zeroes the token embedding at position 0; match it so drafts agree token for token.
        emb = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(emb), emb)
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))

    def forward_paged_mtp(self, emb: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs,
                          cache: LatentCache) -> torch.Tensor:
        return self.forward_paged(self.fuse_inputs(emb, hidden, inp.positions), inp, cache)

    def write_paged_mtp(self, emb: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs, cache: LatentCache
                        ) -> None:
        """The cache writes of :meth:`forward_paged_mtp` alone (what later drafts attend to)."""
        self.self_attn.write_paged(self.input_layernorm(self.fuse_inputs(emb, hidden, inp.positions)), inp, cache)

    def forward_dense_mtp(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        b, s = emb.shape[:2]
        positions = torch.arange(s, device=hidden.device).expand(b, s)
        return self.forward_dense(self.fuse_inputs(emb, hidden, positions))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        rope = RotaryEmbedding.from_config(cfg)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        n = cfg.num_hidden_layers
        layers: list[nn.Module] = [DecoderLayer(cfg, rope, i) for i in range(n)]
        layers += [MTPLayer(cfg, rope, n + i) for i in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekV3Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        #: a host engine's vocabulary-parallel greedy head (``compat/``), or None: ``(normed hidden [B, D],
        #: with_embedding) -> (token [B], its embedding [B, D] or None)`` in one collective (see ``.vocab_parallel``)
        self.greedy_head: nn.Module | None = None

    def set_attention_kernel(self, name: str) -> None:
        """Every layer's paged attention runs ``name`` (see :mod:`.mla_kernels`); all compute the same function."""
        if name not in KERNELS:
            raise ValueError(f"attention kernel {name!r}; allowed: {sorted(KERNELS)}")
        for layer in self.model.layers:
            layer.self_attn.kernel = KERNELS[name]
            layer.self_attn.npu_cache_write = name in HOST_LENGTH_KERNELS
        # the NPU graphs run torch_npu's ops end to end: its MoE ops too (graph.moe_npu)
        for module in self.modules():
            if isinstance(module, MoE):
                module.npu_ops = name in HOST_LENGTH_KERNELS
        self.attention_kernel = name

    attention_kernel = "gather"
    #: the draft chain's steps 2..K hand attention their exact device lengths (``PagedInputs.kv_lens_on_device``)
    #: instead of the host's upper bound: what a backend whose graphs take them says (torchair in GE mode)
    exact_draft_lengths = False

    @property
    def takes_host_lengths(self) -> bool:
        """Whether its attention reads host KV lengths (``PagedInputs.seq_lens_host``): callers pass them then."""
        return self.attention_kernel in HOST_LENGTH_KERNELS

    def use_backend(self, backend: Backend) -> None:
        """What the backend chose for this model's kernels: the paged attention kernel and weight-left products
        (see ``layers.Linear``). Every choice computes the same function."""
        self.set_attention_kernel(backend.attention_kernel)
        self.exact_draft_lengths = getattr(backend, "exact_draft_lengths", False)
        # Not on MoE models: inductor (torch 2.13, CPU) miscompiles the MTP chain's second step when the attention
        # and shared-expert products are both weight-left (wrong logits; tests/test_moe_graph.py keeps the case as
        # an expected failure, so a torch that fixes it shows).
        weight_left = getattr(backend, "weight_left_matmul", False) and self.cfg.moe is None
        for module in self.modules():
            if isinstance(module, Linear):
                module.weight_left = weight_left

    def set_compile_regions(self, enabled: bool) -> None:
        """Compile each decoder layer as a nested region shared by the layers alike (see ``_decoder_layer_region``)."""
        for layer in self.model.layers:
            layer.compile_region = enabled

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers[: self.cfg.num_hidden_layers])

    def mtp_layer(self, step: int = 0) -> MTPLayer:
        """MTP layer for draft step ``step``; with fewer MTP layers than steps, vLLM reuses them cyclically."""
        n = self.cfg.num_nextn_predict_layers
        return self.model.layers[self.cfg.num_hidden_layers + step % n]  # type: ignore[return-value]

    # -- target ---------------------------------------------------------------------------------
    def target_paged(self, input_ids: torch.Tensor, inp: PagedInputs, caches: list[LatentCache]) -> torch.Tensor:
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
    def mtp_paged(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs, cache: LatentCache,
                  step: int = 0, emb: torch.Tensor | None = None, carry: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step: ``(its hidden states [B, Q, D], its carry)``. ``emb``: the embedding of
        ``next_token_ids`` where the caller already has it (``mtp_greedy``). The carry is what a family hands
        its next draft step (per token ``[B, Q, ...]``; the chain keeps each row's sampled token's): None here."""
        if emb is None:
            emb = self.model.embed_tokens(next_token_ids)
        return self.mtp_layer(step).forward_paged_mtp(emb, hidden, inp, cache), None

    def mtp_write_cache(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs,
                        cache: LatentCache, step: int = 0) -> None:
        """The draft cache entries :meth:`mtp_paged` would write, without the rest of the layer (a K = 0 step)."""
        self.mtp_layer(step).write_paged_mtp(self.model.embed_tokens(next_token_ids), hidden, inp, cache)

    def mtp_dense(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.mtp_layer(step).forward_dense_mtp(self.model.embed_tokens(next_token_ids), hidden)

    def mtp_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.logits(self.mtp_layer(step).shared_head.norm(hidden))

    def mtp_greedy(self, hidden: torch.Tensor, step: int, with_embedding: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Greedy draft from the MTP hidden state ``[B, D]``: ``(token [B], its embedding [B, D] or None, logits
        [B, V])``. With a host's ``greedy_head`` the embedding comes with the token and no logits are gathered
        (``[B, 0]``); without one the next step embeds the token itself (``emb`` None)."""
        if self.greedy_head is None:
            logits = self.mtp_logits(hidden, step)
            return logits.argmax(dim=-1), None, logits
        token, emb = self.greedy_head(self.mtp_layer(step).shared_head.norm(hidden), with_embedding)
        return token, emb, hidden.new_empty(hidden.shape[0], 0, dtype=torch.float32)
