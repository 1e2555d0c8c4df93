"""vLLM's loaded ``DeepSeekMTP`` as the drafter finds it on vllm-ascend, built from our checkpoint's tensors, at any
tensor-parallel size, without a vLLM engine.

The module tree is the one ``compat.host_weights.mtp_model_on_vllm`` reads (``model.layers[str(n)]`` with
``mtp_block``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``; the MLA layer's ``fused_qkv_a_proj``, ``q_b_proj``,
``o_proj``, ``W_UK_T`` / ``W_UV``, ``rotary_emb.cos_sin_cache``; the vocab-parallel embedding and the logits
processor), so the drafter's own build code puts these layers into its graphs. Each layer computes what vLLM's
unquantised layer computes on this rank's shard, with vLLM's own ``DeviceCommunicatorBase`` collectives (what
``GroupCoordinator`` calls on a platform without custom-op collectives, vllm-ascend's) over ``process_group``:

* linear layers: ``F.linear`` on the shard (``UnquantizedLinearMethod``), ``(out, None)``; row-parallel ones
  (``o_proj``, the MLP's ``down_proj``) all-reduce;
* the embedding: vLLM's vocab mask (``get_masked_input_and_mask``), ``F.embedding``, the masked rows zeroed, an
  all-reduce; the logits: ``F.linear`` on the vocab shard, an all-gather along the vocabulary, the padding cut;
* the dense MLP: ``gate_up_proj``, vllm-ascend's ``SiluAndMul`` (``torch_npu.npu_swiglu``), ``down_proj``;
* the MoE: our MoE module on torch_npu's fused MoE ops (the op family vllm-ascend's unquantised fused MoE runs),
  every expert on every rank, then vLLM's ``DeepseekV2MoE`` all-reduce of the output.

What it does not reproduce: quantised methods' kernels (W8A8 ``npu_quant_matmul`` ...), vllm-ascend's MoE
communication variants (MC2 dispatch/combine, all-to-all) and its expert sharding.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ascend_spec.graph.config import ModelConfig
from ascend_spec.graph.model import DeepseekV3ForCausalLM


def fake_tp_group(world_size: int) -> torch.distributed.ProcessGroup:
    """The default process group as torch's fake backend (rank 0 of ``world_size``: collectives return at once,
    their outputs unwritten); a drafter graph traces real ``_c10d_functional`` ops through it."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    return torch.distributed.group.WORLD


def _communicator(group: torch.distributed.ProcessGroup | None) -> Any:
    """vLLM's ``DeviceCommunicatorBase`` on ``group`` (what vllm-ascend's ``NPUCommunicator`` inherits its
    all-reduce and all-gather from); None for one rank."""
    if group is None:
        return None
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    return DeviceCommunicatorBase(cpu_group=group, device=torch.device("cpu"), device_group=group)


class Norm(nn.Module):
    """vLLM's RMSNorm as the drafter reads it: ``weight`` and ``variance_epsilon``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.variance_epsilon = eps


class ParallelLinear(nn.Module):
    """A vLLM ``LinearBase`` with the unquantised method on this rank's ``weight`` shard; a row-parallel one
    (``comm`` given) all-reduces its output."""

    def __init__(self, weight: torch.Tensor, comm: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = F.linear(x, self.weight)
        return (self.comm.all_reduce(out) if self.comm is not None else out), None


class W8A8Linear(nn.Module):
    """A W8A8 linear as vllm-ascend's quant method runs it: int8 weights with a per-channel scale (``weight`` holds
    the int8 tensor: no float copy exists), int8 activations with a per-token dynamic scale, int32 products
    dequantised; a row-parallel one (``comm`` given) all-reduces its output."""

    def __init__(self, weight: torch.Tensor, comm: Any = None) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
        self.weight = nn.Parameter(torch.round(w / scale).to(torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.squeeze(1), requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        sx = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127
        xq = torch.round(x.float() / sx).clamp(-127, 127)
        out = (xq @ self.weight.float().t()) * sx * self.weight_scale
        out = out.to(x.dtype)
        return (self.comm.all_reduce(out) if self.comm is not None else out), None


class VocabEmbedding(nn.Module):
    """``VocabParallelEmbedding``: rows ``[start, start + shard)`` of the vocabulary on this rank."""

    def __init__(self, weight: torch.Tensor, start: int, comm: Any = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.start, self.end, self.comm = start, start + weight.shape[0], comm

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return F.embedding(input_.long(), self.weight)
        in_shard = (input_ >= self.start) & (input_ < self.end)  # get_masked_input_and_mask, no added vocab
        masked = in_shard * (input_ - self.start * in_shard)
        out = F.embedding(masked.long(), self.weight)
        out.masked_fill_(~in_shard.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)


class LMHead(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)


class LogitsProcessor(nn.Module):
    """``LogitsProcessor(head, hidden)``: this rank's logits, all-gathered along the vocabulary, padding cut."""

    def __init__(self, vocab_size: int, comm: Any = None) -> None:
        super().__init__()
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, head: LMHead, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, head.weight)
        if self.comm is not None:
            logits = self.comm.all_gather(logits, -1)
        return logits[..., : self.vocab_size]


class DenseMLP(nn.Module):
    """``DeepseekV2MLP``: merged gate/up (column-parallel), vllm-ascend's ``SiluAndMul``, row-parallel down."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, comm: Any = None, npu_ops: bool = True,
                 linear: type[nn.Module] = ParallelLinear) -> None:
        super().__init__()
        self.gate_up_proj = linear(gate_up)
        self.down_proj = linear(down, comm)
        self.npu_ops = npu_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)
        if self.npu_ops:
            x = torch.ops.npu.npu_swiglu(x, -1)
        else:  # vLLM's SiluAndMul on CPU
            gate, up = x.chunk(2, dim=-1)
            x = F.silu(gate) * up
        x, _ = self.down_proj(x)
        return x


class MoE(nn.Module):
    """``DeepseekV2MoE``: router, routed and shared experts (ours, on torch_npu's fused ops), then the TP reduce."""

    def __init__(self, ours: nn.Module, comm: Any = None, npu_ops: bool = True) -> None:
        super().__init__()
        ours.npu_ops = npu_ops
        self.inner, self.comm = ours, comm

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.inner(hidden_states)
        return self.comm.all_reduce(out) if self.comm is not None else out


def _rows(w: torch.Tensor, rank: int, tp: int, groups: int = 1) -> torch.Tensor:
    """Rank ``rank``'s share of dim 0, split evenly within each of ``groups`` equal parts (merged layers)."""
    return torch.cat([g.chunk(tp)[rank] for g in w.chunk(groups)])


class IndexerLayerNorm(nn.Module):
    """vLLM's ``LayerNorm(head_dim, eps=1e-6, dtype=torch.float32)``: float32 weights, computed in float32, the
    result in the input's dtype."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach().float(), requires_grad=False)
        self.bias = nn.Parameter(norm.bias.detach().float(), requires_grad=False)
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, self.eps).to(x.dtype)


def indexer(ours: nn.Module, merged: bool = True, linear: type[nn.Module] = ParallelLinear) -> nn.Module:
    """vLLM's DSA ``Indexer`` (replicated on every rank): ``wq_b`` (under the model's quant method),
    ``wk_weights_proj`` (``wk`` and ``weights_proj`` stacked, vLLM 0.32; never quantised) or the two apart
    (``merged=False``, older vLLM), ``k_norm``."""
    vidx = nn.Module()
    vidx.wq_b = linear(ours.wq_b.weight)
    if merged:
        vidx.wk_weights_proj = ParallelLinear(torch.cat([ours.wk.weight, ours.weights_proj.weight]))
    else:
        vidx.wk, vidx.weights_proj = ParallelLinear(ours.wk.weight), ParallelLinear(ours.weights_proj.weight)
    vidx.k_norm = IndexerLayerNorm(ours.k_norm)
    return vidx


def deepseek_mtp(model: DeepseekV3ForCausalLM, tp: int = 1, rank: int = 0,
                 group: torch.distributed.ProcessGroup | None = None, merged: bool = True,
                 npu_ops: bool = True, w8a8: bool = False) -> nn.Module:
    """vLLM's ``DeepSeekMTP`` on ``model``'s MTP tensors, rank ``rank`` of ``tp`` (``group``: the TP group); a DSA
    model's MTP layer with vLLM's ``Indexer`` (``merged``: its ``wk_weights_proj``). ``npu_ops=False``: the MLP and
    MoE compute on plain torch ops (no torch_npu stand-in needed). ``w8a8``: the layer's linears (attention, the
    indexer's ``wq_b``, the dense MLP) quantised as a W8A8 checkpoint loads them."""
    lin = W8A8Linear if w8a8 else ParallelLinear
    cfg: ModelConfig = model.cfg
    comm = _communicator(group) if tp > 1 else None
    ours = model.mtp_layer(0)
    attn = ours.self_attn
    heads = cfg.num_attention_heads

    vattn = nn.Module()
    if cfg.q_lora_rank:
        vattn.fused_qkv_a_proj = lin(torch.cat([attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight]))
        vattn.q_b_proj = lin(_rows(attn.q_b_proj.weight, rank, tp))
        vattn.q_a_layernorm = Norm(attn.q_a_layernorm.weight, attn.q_a_layernorm.eps)
    else:
        vattn.q_proj = ParallelLinear(_rows(attn.q_proj.weight, rank, tp))
        vattn.kv_a_proj_with_mqa = ParallelLinear(attn.kv_a_proj_with_mqa.weight)
    vattn.kv_a_layernorm = Norm(attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps)
    vattn.o_proj = lin(attn.o_proj.weight.chunk(tp, dim=1)[rank], comm)
    kv_b = attn.kv_b_proj.weight.view(heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    local = kv_b.chunk(tp)[rank]
    mla = nn.Module()  # vLLM's MLAAttention, which holds the absorbed matrices after loading
    mla.W_UK_T = local[:, : cfg.qk_nope_head_dim].contiguous()  # [H, nope, C]
    mla.W_UV = local[:, cfg.qk_nope_head_dim:].transpose(1, 2).contiguous()  # [H, C, v]
    vattn.mla_attn = mla
    vattn.rotary_emb = nn.Module()  # vLLM's RotaryEmbedding keeps cos_sin_cache as a buffer
    vattn.rotary_emb.register_buffer("cos_sin_cache", torch.cat(
        [attn.rope.cos_cached, attn.rope.sin_cached], dim=-1).to(attn.o_proj.weight.dtype), persistent=False)
    if cfg.sparse_attention() is not None:
        vattn.indexer = indexer(attn.indexer, merged, lin)

    decoder = nn.Module()
    decoder.self_attn = vattn
    decoder.input_layernorm = Norm(ours.input_layernorm.weight, ours.input_layernorm.eps)
    decoder.post_attention_layernorm = Norm(ours.post_attention_layernorm.weight, ours.post_attention_layernorm.eps)
    if cfg.is_moe_layer(cfg.num_hidden_layers):
        decoder.mlp = MoE(ours.mlp, comm, npu_ops)
    else:
        mlp = ours.mlp
        gate_up = torch.cat([_rows(mlp.gate_proj.weight, rank, tp), _rows(mlp.up_proj.weight, rank, tp)])
        decoder.mlp = DenseMLP(gate_up, mlp.down_proj.weight.chunk(tp, dim=1)[rank], comm, npu_ops, lin)

    vocab = cfg.vocab_size
    shard = -(-vocab // tp)
    embed = F.pad(model.model.embed_tokens.weight, (0, 0, 0, shard * tp - vocab))[rank * shard:(rank + 1) * shard]
    head = F.pad(model.lm_head.weight, (0, 0, 0, shard * tp - vocab))[rank * shard:(rank + 1) * shard]

    layer = nn.Module()
    layer.mtp_block = decoder
    layer.enorm = Norm(ours.enorm.weight, ours.enorm.eps)
    layer.hnorm = Norm(ours.hnorm.weight, ours.hnorm.eps)
    layer.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    layer.eh_proj.weight = nn.Parameter(ours.eh_proj.weight.detach(), requires_grad=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = Norm(ours.shared_head.norm.weight, ours.shared_head.norm.eps)
    layer.shared_head.head = LMHead(head)

    predictor = nn.Module()
    predictor.layers = nn.ModuleDict({str(cfg.num_hidden_layers): layer})
    predictor.embed_tokens = VocabEmbedding(embed, rank * shard, comm)
    predictor.logits_processor = LogitsProcessor(vocab, comm)
    mtp = nn.Module()
    mtp.model = predictor
    return mtp
