"""Multi-head latent attention (MLA) over a paged latent KV cache.
The paged path uses the absorbed form; its attention proper (latent queries against cached blocks): :mod:`.mla_kernels`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .latent_cache import LatentCache, latent_parts, write_latent_cache
from .layers import Linear, RMSNorm, RotaryEmbedding
from .mla_kernels import MLAKernel, gather_mla
from .paging import PagedInputs


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = rope
        #: heads computed here: all of them, or this rank's share when the projections are tensor-parallel
        self.num_heads = h = cfg.num_attention_heads
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = Linear(cfg.hidden_size, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        #: Host-engine module seams (see graph/external.py), None for our own weights. Instance attributes: a
        #: module assigned later goes to ``_modules``, which a class attribute of the same name would shadow.
        #: A fused ``[q_a ; kv_a]`` projection (vLLM's ``fused_qkv_a_proj``), and the absorbed products as the
        #: host's attention computes them, for hosts whose ``W_UK`` / ``W_UV`` exist only in a kernel's own layout
        #: (vLLM's AMX MLA packs them): ``uk_proj(q_nope [..., H, nope]) → q_lat [..., H, C]`` and
        #: ``uv_proj(o_lat [..., H, C]) → [..., H, v]`` (None: the einsums with ``_w_uk_uv``).
        self.fused_a_proj: nn.Module | None = None
        self.uk_proj: nn.Module | None = None
        self.uv_proj: nn.Module | None = None

    #: Host-engine seam, None for our own weights: the absorbed ``(W_UK [H, nope, C], W_UV [H, v, C])``.
    absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
    #: the paged attention kernel (see :mod:`.mla_kernels`); chosen per backend by ``set_attention_kernel``
    kernel: MLAKernel = staticmethod(gather_mla)  # type: ignore[assignment]
    #: write the cache with torch_npu's scatter op (with the NPU kernel: what torchair converts)
    npu_cache_write = False

    # -- shared projections ---------------------------------------------------------------------
    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x → (q_nope [..., H, nope], roped q_pe [..., H, rope], normed c_kv [..., C], roped k_pe [..., rope])."""
        return self._heads(*self._a_proj(x), positions)

    def _a_proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x → (the query's input: the normed query latent ``q_a_layernorm(q_a_proj(x))``, or x without q_lora;
        the kv_a projection ``[..., C + rope]``)."""
        cfg = self.cfg
        if self.fused_a_proj is not None:
            q_a, kv_a = self.fused_a_proj(x).split([cfg.q_lora_rank, cfg.latent_dim], dim=-1)
        else:
            q_a = self.q_a_proj(x) if cfg.q_lora_rank else x
            kv_a = self.kv_a_proj_with_mqa(x)
        return (self.q_a_layernorm(q_a) if cfg.q_lora_rank else q_a), kv_a

    def _heads(self, q_in: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        q = self.q_b_proj(q_in) if cfg.q_lora_rank else self.q_proj(q_in)
        q = q.view(*q_in.shape[:-1], self.num_heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        return (q_nope, self.rope(q_pe, positions), *self._latents(kv_a, positions))

    def _latents(self, kv_a: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kv_a projection → (normed c_kv [..., C], roped k_pe [..., rope]): what the cache holds."""
        cfg = self.cfg
        c_kv, k_pe = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        k_pe = self.rope(k_pe.unsqueeze(-2), positions).squeeze(-2)
        return self.kv_a_layernorm(c_kv), k_pe

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.absorbed is not None:
            return self.absorbed
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]  # [H, nope, C], [H, v, C]

    # -- paged (inference) --------------------------------------------------------------------
    def forward_paged(self, x: torch.Tensor, inp: PagedInputs, cache: LatentCache) -> torch.Tensor:
        """x: [B, Q, D] → [B, Q, D]; writes this forward's latents into ``cache`` first."""
        cfg = self.cfg
        q_nope, q_pe, c_kv, k_pe = self._project(x, inp.positions)  # [B, Q, H, nope], [B, Q, H, rope], ...
        self._write_latents(cache, inp, c_kv, k_pe)
        o_lat = self.kernel(self._absorb(q_nope), q_pe, latent_parts(cache, cfg.kv_lora_rank), inp, cfg.softmax_scale)
        return self._output(o_lat)

    def _absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope [B, Q, H, nope]`` → the latent query ``[B, Q, H, C]`` (``W_UK`` absorbed)."""
        if self.uk_proj is not None:
            return self.uk_proj(q_nope)
        return torch.einsum("bqhn,hnc->bqhc", q_nope, self._w_uk_uv()[0])

    def _output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """The latent attention output ``[B, Q, H, C]`` → ``[B, Q, D]`` (``W_UV`` then ``o_proj``)."""
        if self.uv_proj is not None:
            out = self.uv_proj(o_lat)
        else:
            out = torch.einsum("bqhc,hvc->bqhv", o_lat, self._w_uk_uv()[1])
        return self.o_proj(out.reshape(*o_lat.shape[:2], -1))

    def write_paged(self, x: torch.Tensor, inp: PagedInputs, cache: LatentCache) -> None:
        """The cache writes of :meth:`forward_paged` alone (x: [B, Q, D]), for a pass whose output nobody reads:
        the kv_a projection, its norm and RoPE, no query and no attention."""
        cfg = self.cfg
        if self.fused_a_proj is not None:
            kv_a = self.fused_a_proj(x)[..., cfg.q_lora_rank:]
        else:
            kv_a = self.kv_a_proj_with_mqa(x)
        self._write_latents(cache, inp, *self._latents(kv_a, inp.positions))

    def _write_latents(self, cache: LatentCache, inp: PagedInputs, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """``c_kv [B, Q, C]`` and ``k_pe [B, Q, rope]`` into ``cache`` at ``inp.slot_mapping``."""
        n = c_kv.shape[0] * c_kv.shape[1]
        write_latent_cache(cache, inp.slot_mapping.reshape(-1), c_kv.reshape(n, -1), k_pe.reshape(n, -1),
                           npu=self.npu_cache_write)

    # -- dense (training and reference) ---------------------------------------------------------
    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention over full sequences x: [B, S, D], positions 0..S-1, no cache."""
        b, s, _ = x.shape
        positions = torch.arange(s, device=x.device).expand(b, s)
        return self.attend_dense(*self._project(x, positions))

    def attend_dense(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over whole sequences from their projections (keys expanded through ``kv_b_proj``): causal,
        or where ``mask [B, S, S]`` allows."""
        cfg = self.cfg
        b, s = c_kv.shape[:2]
        kv = self.kv_b_proj(c_kv).view(b, s, self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=None if mask is None else mask.unsqueeze(1),
                                             is_causal=mask is None, scale=cfg.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
