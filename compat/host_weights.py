"""Our draft chain on the weights vLLM already loaded: no second copy, any tensor-parallel size, any quant method.
:func:`mtp_model_on_vllm` builds our model on the meta device and fills its MTP path with vLLM's objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from ascend_spec.graph.config import ConfigError, ModelConfig
from ascend_spec.graph.families import build_model, family_for_model_type
from ascend_spec.graph.external import External
from ascend_spec.graph.layers import RMSNorm
from ascend_spec.graph.model import DeepseekV3ForCausalLM
from ascend_spec.graph.vocab_parallel import local_candidate, pick_candidate

from .manifest import covers
from .shims import CompatError
from .shims_parallel import vocab_parallel_slice

logger = logging.getLogger("vllm.ascend_spec.drafter")  # manifest: ignore (our logger name)


def _linear(layer: nn.Module, name: str) -> External:
    """vLLM's LinearBase layers return ``(output, bias)``; a plain module returns the output. They get
    ``[tokens, in]``, as in vLLM's models: some CPU kernels take no other shape (W8A8 int8 on AMX reads dim 0 as
    the token count)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = layer(x.reshape(-1, x.shape[-1]))
        out = out[0] if isinstance(out, tuple) else out
        return out.view(*x.shape[:-1], out.shape[-1])

    return External(forward, f"vllm {name}")


def _share_norm(ours: RMSNorm, vnorm: nn.Module) -> None:
    ours.weight = vnorm.weight  # the same Parameter: no copy
    ours.eps = float(vnorm.variance_epsilon)


def config_from_vllm(vllm_config: Any) -> ModelConfig:
    """Our config, of the draft's family, from the draft model's HF config vLLM holds (no file is read)."""
    hf = vllm_config.speculative_config.draft_model_config.hf_config.to_dict()
    # vLLM renames every DeepSeek-style draft's model_type to deepseek_mtp; to_dict() gives the config class's own
    try:
        family = family_for_model_type(hf.get("model_type"))
    except ConfigError as e:  # one we do not draft: one error naming those we do
        raise CompatError(f"ascend_spec drafter: {e}; allowed: ascend_spec enabled: false (vLLM's drafter)") from e
    config = family.config
    # vLLM renames the draft's architectures (DeepSeekMTPModel, DeepseekV32MTPModel): the family's own
    hf["architectures"] = [config.ARCHITECTURES[config.MODEL_TYPES.index(hf["model_type"])]]
    # The weights stay vLLM's, quantised or not, and run through vLLM's layers: our model needs only the shapes.
    hf.pop("quantization_config", None)
    return config.from_hf_dict(hf)


def mtp_model_on_vllm(mtp_model: nn.Module, cfg: ModelConfig, tp_size: int, device: torch.device,
                      moe_context: Callable[[int], ContextManager] | None, opaque_moe: bool = True
                      ) -> DeepseekV3ForCausalLM:
    """``mtp_model``: vLLM's DeepSeekMTP (loaded). ``moe_context(num_tokens)``: the forward context vLLM's MoE
    runs in. ``opaque_moe``: call the MoE through the opaque op (inductor) or let the compiler trace it (torchair,
    whose graph takes vllm-ascend's MoE ops)."""
    if cfg.num_nextn_predict_layers != 1:
        raise CompatError(f"ascend_spec drafter supports one MTP layer; the model has {cfg.num_nextn_predict_layers}")
    if cfg.num_attention_heads % tp_size:
        raise CompatError(f"num_attention_heads={cfg.num_attention_heads} is not divisible by "
                          f"tensor_parallel_size={tp_size}")
    local = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp_size)
    with torch.device("meta"):
        model = build_model(local)
    predictor = mtp_model.model
    mtp_layer = predictor.layers[str(cfg.num_hidden_layers)]
    decoder = mtp_layer.mtp_block
    model.model.embed_tokens = External(predictor.embed_tokens, "vllm embed_tokens (vocab-parallel)")
    head = mtp_layer.shared_head.head  # vLLM points it at the target's lm_head
    model.lm_head = External(lambda h: predictor.logits_processor(head, h), "vllm logits_processor(lm_head)")
    model.greedy_head = _greedy_head_on_vllm(predictor, head, tp_size)

    ours = model.mtp_layer(0)
    for name in ("enorm", "hnorm"):
        _share_norm(getattr(ours, name), getattr(mtp_layer, name))
    _share_norm(ours.shared_head.norm, mtp_layer.shared_head.norm)
    _share_norm(ours.input_layernorm, decoder.input_layernorm)
    _share_norm(ours.post_attention_layernorm, decoder.post_attention_layernorm)
    ours.eh_proj = mtp_layer.eh_proj  # a plain nn.Linear in vLLM: used as is
    _attention_on_vllm(ours.self_attn, decoder.self_attn, cfg, device)
    if cfg.sparse_attention() is not None:
        _indexer_on_vllm(ours.self_attn.indexer, decoder.self_attn)
    if cfg.is_moe_layer(cfg.num_hidden_layers):
        if moe_context is None:
            raise CompatError("ascend_spec drafter: the MTP layer is MoE, but no forward context for vLLM's MoE "
                              "was given")
        ours.mlp = _moe_on_vllm(decoder.mlp, moe_context, opaque_moe)
    else:
        ours.mlp = External(decoder.mlp, "vllm DeepseekV2MLP")
    _check_nothing_on_meta(model)
    return model


def _attention_on_vllm(attn: nn.Module, vattn: nn.Module, cfg: ModelConfig, device: torch.device) -> None:
    if cfg.q_lora_rank:
        attn.fused_a_proj = _linear(vattn.fused_qkv_a_proj, "fused_qkv_a_proj")
        attn.q_b_proj = _linear(vattn.q_b_proj, "q_b_proj")
        _share_norm(attn.q_a_layernorm, vattn.q_a_layernorm)
        del attn.q_a_proj, attn.kv_a_proj_with_mqa
    else:
        attn.q_proj = _linear(vattn.q_proj, "q_proj")
        attn.kv_a_proj_with_mqa = _linear(vattn.kv_a_proj_with_mqa, "kv_a_proj_with_mqa")
    _share_norm(attn.kv_a_layernorm, vattn.kv_a_layernorm)
    attn.o_proj = _linear(vattn.o_proj, "o_proj")
    del attn.kv_b_proj  # replaced by the absorbed matrices vLLM derived from it
    _absorbed_on_vllm(attn, vattn, cfg)
    # vLLM's rotary cache is [positions, rope]: cos then sin of the same frequencies ours use (YaRN included),
    # in the model's dtype as vLLM's own RoPE reads it (views: ours rotates in float32 from those values).
    rotary = vattn.rotary_emb
    cache = rotary.cos_sin_cache
    half = cfg.qk_rope_head_dim // 2
    attn.rope.cos_cached = cache[:, :half].to(device=device)
    attn.rope.sin_cached = cache[:, half:].to(device=device)


@covers("indexer_wk_weights_proj")
def _indexer_on_vllm(indexer: nn.Module, vattn: nn.Module) -> None:
    """The MTP layer's lightning indexer on vLLM's: ``wq_b``, the key and per-head weight projections (vLLM's merged
    ``wk_weights_proj``, one GEMM split as vLLM runs it; apart in releases before the merge), ``k_norm`` (vLLM's
    LayerNorm, float32 weights). Replicated on every tensor-parallel rank, as vLLM keeps them. The RoPE is the
    layer's (the same frequencies; the channel order is the family's, ``indexer_rope``)."""
    vidx = getattr(vattn, "indexer", None)
    if vidx is None:
        raise CompatError("ascend_spec drafter: the draft model is a sparse-attention family, but vLLM's draft "
                          "attention has no indexer (self_attn.indexer)")
    indexer.wq_b = _linear(vidx.wq_b, "indexer wq_b")
    merged = getattr(vidx, "wk_weights_proj", None)
    if merged is not None:
        split = [indexer.head_dim, indexer.n_heads]
        both = _linear(merged, "indexer wk_weights_proj")
        indexer.wk_and_weights = External(lambda x: both(x).split(split, dim=-1),
                                          "vllm indexer wk_weights_proj (one GEMM, split)")
        del indexer.wk, indexer.weights_proj
    else:
        indexer.wk = _linear(vidx.wk, "indexer wk")
        indexer.weights_proj = _linear(vidx.weights_proj, "indexer weights_proj")
    indexer.k_norm = External(vidx.k_norm, "vllm indexer k_norm (LayerNorm)")


@covers("amx_mla_absorb")
def _absorbed_on_vllm(attn: nn.Module, vattn: nn.Module, cfg: ModelConfig) -> None:
    """The absorbed products (``q_nope·W_UK``, ``o_lat·W_UV``) on the matrices vLLM's MLA layer built.

    Most backends keep ``W_UK_T`` / ``W_UV`` as plain tensors on the layer (dequantised for every quant method):
    our einsums read views of them. vLLM's AMX MLA keeps them only VNNI-packed in its impl (bf16, or fp8 with a
    per-tensor scale): the products then run vLLM's own kernels on its packed copies, as its decode does.
    """
    holder = next((m for m in vattn.modules()  # manifest: ignore (W_UK_T is registered at run time)
                   if isinstance(getattr(m, "W_UK_T", None), torch.Tensor)), None)  # manifest: ignore
    if holder is not None:
        # W_UK_T [H, nope, C] is our W_UK; W_UV [H, C, v] transposed is our W_UV [H, v, C]: views, no copies.
        attn.absorbed = (holder.W_UK_T, holder.W_UV.transpose(1, 2))
        return
    mla = next((m for m in vattn.modules()  # manifest: ignore (nn.Module API)
                if getattr(m, "impl", None) is not None), None)
    backend = type(mla.impl).__name__ if mla is not None else type(vattn).__name__
    if mla is None or not getattr(mla, "is_amx_bmm_enabled", False):
        raise CompatError(f"ascend_spec drafter: vLLM's MLA backend {backend} holds neither W_UK_T / W_UV nor "
                          "AMX-packed copies of them; run the draft layer on one that does, e.g. "
                          "speculative_config={'attention_backend': 'CPU_MLA'} on CPU")
    from vllm._custom_ops import bmm_cpu

    amx_impl, heads = mla.impl, attn.num_heads
    nope, latent, v = cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim

    def uk_proj(q_nope: torch.Tensor) -> torch.Tensor:
        # MLAAttention.forward_impl's AMX absorb: out[h] = q_nope[h] @ packed_W_UK[h]^T, heads leading.
        x = q_nope.reshape(-1, heads, nope)
        out = x.new_empty(x.shape[0], heads, latent)
        bmm_cpu(out.transpose(0, 1), x.transpose(0, 1), amx_impl._w_uk_packed, True, amx_impl._w_scale)
        return out.view(*q_nope.shape[:-1], latent)

    def uv_proj(o_lat: torch.Tensor) -> torch.Tensor:
        x = o_lat.reshape(-1, heads, latent)
        out = x.new_empty(x.shape[0], heads * v)
        mla._v_up_proj(x, out)  # vLLM's de-absorb (its packed W_UV on AMX)
        return out.view(*o_lat.shape[:-1], v)

    attn.uk_proj = External(uk_proj, f"vllm {backend} packed W_UK (bmm_cpu)")
    attn.uv_proj = External(uv_proj, f"vllm {backend} _v_up_proj (packed W_UV)")


def _greedy_head_on_vllm(predictor: nn.Module, head: nn.Module, tp_size: int) -> External | None:
    """The vocabulary-parallel greedy head (token and its embedding in one all-gather), or None at TP 1 (no
    collective to save) or where vLLM's layers do not allow it (the full-logits path then runs)."""
    if tp_size == 1:
        return None
    vocab, why = vocab_parallel_slice(predictor.logits_processor, head, predictor.embed_tokens)
    if vocab is None:
        logger.info("ascend_spec drafter: greedy drafts all-gather full logits (%s)", why)
        return None

    def greedy(normed: torch.Tensor, with_embedding: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        candidate = local_candidate(vocab.logits(normed), vocab.start, vocab.embed if with_embedding else None)
        return pick_candidate(vocab.all_gather(candidate), tp_size, normed.dtype)

    return External(greedy, "vllm vocab-parallel greedy head (one all-gather)")


def _moe_on_vllm(vmoe: nn.Module, moe_context: Callable[[int], ContextManager], opaque: bool) -> External:
    """vLLM's whole DeepseekV2MoE: its router, its FusedMoE (whatever quant method and kernel vLLM chose; no
    expert tensor is read here) and shared experts, reduced across tensor-parallel ranks as vLLM does. Opaque, it
    enters ``moe_context`` itself; traced (torchair), the caller's context is the one every call runs in."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # vLLM's MoE takes [tokens, hidden]
        with moe_context(flat.shape[0]) if opaque else contextlib.nullcontext():
            return vmoe(flat).view_as(x)

    return External(forward, f"vllm {type(vmoe).__name__}", opaque=opaque)


def _check_nothing_on_meta(model: DeepseekV3ForCausalLM) -> None:
    """Every tensor the draft chain can reach is vLLM's or built here; target layers stay on meta, unused."""
    mtp = model.mtp_layer(0)
    left = [n for n, t in [*mtp.named_parameters(), *mtp.named_buffers()] if t.device.type == "meta"]
    if left:
        raise CompatError(f"ascend_spec drafter: no vLLM tensor found for {left}")


def owned_tensor_bytes(model: DeepseekV3ForCausalLM, host: nn.Module) -> int:
    """Bytes of tensors the drafter holds that are not the host model's (graph buffers excluded)."""
    host_ptrs = {t.untyped_storage().data_ptr() for t in [*host.parameters(), *host.buffers()]}
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta":
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr not in host_ptrs and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total
