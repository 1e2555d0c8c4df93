"""DeepSeek-V3.2 / GLM-5.x: MLA with DeepSeek Sparse Attention and their MTP layer (a DSA layer with its own
indexer), behind DeepSeek-V3's model contract (docs/model-families.md). HF parameter names."""
from __future__ import annotations

import torch
from torch import nn

from ..attention import MLAttention
from ..latent_cache import LatentCache, latent_parts, write_latent_cache
from ..layers import MLP, Embedding, Linear, RMSNorm, RotaryEmbedding
from ..paging import PagedInputs
from ..model import DeepseekV3ForCausalLM, MTPLayer, SharedHead
from ..moe import MoE
from .config import DsaConfig
from .indexer import Indexer, selection_mask
from .sparse_kernels import SPARSE_KERNELS, SparseMLAKernel, gather_sparse_mla

#: a DSA layer's cache: ``(single, index_keys)`` or ``(nope, rope, index_keys)``
DsaCache = tuple[torch.Tensor, ...]


def split_cache(cache: DsaCache) -> tuple[LatentCache, torch.Tensor]:
    """``(the latent cache, the indexer's key cache)`` of one layer."""
    *latent, keys = cache
    return (latent[0] if len(latent) == 1 else tuple(latent)), keys  # type: ignore[return-value]


class DsaAttention(MLAttention):
    """MLA whose queries attend only their indexer's top-k tokens (or, on a ``shared`` layer, the top-k they are
    handed). Projections, absorption and the latent cache are MLA's."""

    def __init__(self, cfg: DsaConfig, rope: RotaryEmbedding, own_indexer: bool) -> None:
        super().__init__(cfg, rope)
        self.indexer: Indexer | None = Indexer(cfg, rope) if own_indexer else None

    #: the paged sparse attention kernel (see :mod:`.sparse_kernels`)
    sparse_kernel: SparseMLAKernel = staticmethod(gather_sparse_mla)  # type: ignore[assignment]

    def forward_paged_sparse(self, x: torch.Tensor, inp: PagedInputs, cache: DsaCache,
                             selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, Q, D] → (out [B, Q, D], the top-k it attended ``[B, Q, topk]``). Writes this forward's latents
        and (with its own indexer, selecting) its index keys first. ``selected``: reuse that top-k instead."""
        cfg = self.cfg
        latent, key_cache = split_cache(cache)
        q_resid, kv_a = self._a_proj(x)
        q_nope, q_pe, c_kv, k_pe = self._heads(q_resid, kv_a, inp.positions)
        self._write_latents(latent, inp, c_kv, k_pe)
        if selected is None:
            assert self.indexer is not None, "a shared DSA layer needs the top-k of a full layer"
            keys, weights = self.indexer.project(x, inp.positions)
            self._write_keys(key_cache, inp, keys)
            selected = self.indexer.select_paged(weights, q_resid, inp, key_cache)
        o_lat = self.sparse_kernel(self._absorb(q_nope), q_pe, latent_parts(latent, cfg.kv_lora_rank), inp,
                                   selected, cfg.softmax_scale)
        return self._output(o_lat), selected

    def write_paged(self, x: torch.Tensor, inp: PagedInputs, cache: DsaCache) -> None:  # type: ignore[override]
        """The cache writes alone: latents, and the index keys where this layer has an indexer."""
        latent, key_cache = split_cache(cache)
        super().write_paged(x, inp, latent)
        if self.indexer is not None:
            self._write_keys(key_cache, inp, self.indexer.keys(x, inp.positions))

    def _write_keys(self, key_cache: torch.Tensor, inp: PagedInputs, keys: torch.Tensor) -> None:
        # the key cache is one more single-tensor cache, written as the latent's is (slot -1 writes nothing)
        n = keys.shape[0] * keys.shape[1]
        flat = keys.reshape(n, -1)
        write_latent_cache(key_cache, inp.slot_mapping.reshape(-1), flat, flat[:, :0], npu=self.npu_cache_write)

    def forward_dense_sparse(self, x: torch.Tensor, selected: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal attention over whole sequences, each query restricted to its top-k (training and reference)."""
        b, s, _ = x.shape
        positions = torch.arange(s, device=x.device).expand(b, s)
        q_resid, kv_a = self._a_proj(x)
        q_nope, q_pe, c_kv, k_pe = self._heads(q_resid, kv_a, positions)
        if selected is None:
            assert self.indexer is not None, "a shared DSA layer needs the top-k of a full layer"
            selected = self.indexer.select_dense(x, q_resid)
        mask = selection_mask(selected, s) & torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return self.attend_dense(q_nope, q_pe, c_kv, k_pe, mask), selected


def _full_layer_paged(layer: "DsaDecoderLayer", x: torch.Tensor, inp: PagedInputs, cache: DsaCache
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer with its own indexer: (out, its top-k)."""
    attn, selected = layer.self_attn.forward_paged_sparse(layer.input_layernorm(x), inp, cache)
    h = x + attn
    return h + layer.mlp(layer.post_attention_layernorm(h)), selected


def _shared_layer_paged(layer: "DsaDecoderLayer", x: torch.Tensor, inp: PagedInputs, cache: DsaCache,
                        selected: torch.Tensor) -> torch.Tensor:
    """A ``shared`` layer: attends ``selected``; returns only its output (a compile region may not hand an input
    back as an output)."""
    attn, _ = layer.self_attn.forward_paged_sparse(layer.input_layernorm(x), inp, cache, selected)
    h = x + attn
    return h + layer.mlp(layer.post_attention_layernorm(h))


#: one compile of a layer body per structure (full / shared, dense / MoE), replayed for the layers alike
_full_layer_region = torch.compiler.nested_compile_region(_full_layer_paged)
_shared_layer_region = torch.compiler.nested_compile_region(_shared_layer_paged)


class DsaDecoderLayer(nn.Module):
    compile_region = False

    def __init__(self, cfg: DsaConfig, rope: RotaryEmbedding, index: int, own_indexer: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DsaAttention(cfg, rope, own_indexer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (MoE(cfg.hidden_size, cfg.moe) if cfg.moe is not None and cfg.is_moe_layer(index)
                               else MLP(cfg.hidden_size, cfg.intermediate_size))

    def forward_paged(self, x: torch.Tensor, inp: PagedInputs, cache: DsaCache,
                      selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x → (out, the top-k this layer attended: what a following shared layer reuses)."""
        if self.self_attn.indexer is not None:
            return (_full_layer_region if self.compile_region else _full_layer_paged)(self, x, inp, cache)
        assert selected is not None, "a shared DSA layer needs the top-k of a full layer before it"
        body = _shared_layer_region if self.compile_region else _shared_layer_paged
        return body(self, x, inp, cache, selected), selected

    def forward_dense(self, x: torch.Tensor, selected: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, selected = self.self_attn.forward_dense_sparse(
            self.input_layernorm(x), None if self.self_attn.indexer is not None else selected)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), selected


class DsaMTPLayer(DsaDecoderLayer):
    """DeepSeek's MTP module around a DSA layer with its own indexer (``enorm`` / ``hnorm`` / ``eh_proj`` /
    ``shared_head`` as DeepSeek-V3's, :class:`graph.model.MTPLayer`)."""

    def __init__(self, cfg: DsaConfig, rope: RotaryEmbedding, index: int) -> None:
        super().__init__(cfg, rope, index, own_indexer=True)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    fuse_inputs = MTPLayer.fuse_inputs

    def forward_paged_mtp(self, emb: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs, cache: DsaCache,
                          selected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fuse_inputs(emb, hidden, inp.positions)
        if selected is None:
            return _full_layer_paged(self, x, inp, cache)
        return _shared_layer_paged(self, x, inp, cache, selected), selected

    def write_paged_mtp(self, emb: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs, cache: DsaCache) -> None:
        self.self_attn.write_paged(self.input_layernorm(self.fuse_inputs(emb, hidden, inp.positions)), inp, cache)

    def forward_dense_mtp(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        b, s = emb.shape[:2]
        positions = torch.arange(s, device=hidden.device).expand(b, s)
        return self.forward_dense(self.fuse_inputs(emb, hidden, positions))[0]


class DsaModel(nn.Module):
    def __init__(self, cfg: DsaConfig) -> None:
        super().__init__()
        rope = RotaryEmbedding.from_config(cfg)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        n = cfg.num_hidden_layers
        layers: list[nn.Module] = [DsaDecoderLayer(cfg, rope, i, cfg.indexer.layer_types[i] == "full")
                                   for i in range(n)]
        layers += [DsaMTPLayer(cfg, rope, n + i) for i in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DsaForCausalLM(DeepseekV3ForCausalLM):
    """The DSA family's model: DeepSeek-V3's contract (heads, MTP greedy, backends) over DSA layers."""

    def __init__(self, cfg: DsaConfig) -> None:  # noqa: super-init: the layers differ, the contract does not
        nn.Module.__init__(self)
        self.cfg = cfg
        self.model = DsaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.greedy_head = None

    def set_attention_kernel(self, name: str) -> None:
        """Sparse attention kernels: ``gather`` (the reference) or ``npu`` (torch_npu's lightning indexer and
        sparse flash attention); a backend asking another is refused by name."""
        if name not in SPARSE_KERNELS:
            raise ValueError(f"attention kernel {name!r} for the DSA family ({self.cfg.model_type}); allowed: "
                             f"{sorted(SPARSE_KERNELS)}")
        npu = name == "npu"
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.sparse_kernel = SPARSE_KERNELS[name]
            attn.npu_cache_write = npu
            if attn.indexer is not None:
                attn.indexer.on_npu = npu
        for module in self.modules():  # the NPU graphs run torch_npu's MoE ops too (graph.moe_npu)
            if isinstance(module, MoE):
                module.npu_ops = npu
        self.attention_kernel = name

    @property
    def takes_host_lengths(self) -> bool:
        """Never: torch_npu's DSA ops take their lengths as device tensors."""
        return False

    # -- target ---------------------------------------------------------------------------------
    def target_paged(self, input_ids: torch.Tensor, inp: PagedInputs, caches: list[DsaCache]) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        selected = None
        for layer, cache in zip(self.decoder_layers, caches):
            x, selected = layer.forward_paged(x, inp, cache, selected)
        return self.model.norm(x)

    def target_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        selected = None
        for layer in self.decoder_layers:
            x, selected = layer.forward_dense(x, selected)
        return self.model.norm(x)

    # -- MTP ------------------------------------------------------------------------------------
    def mtp_paged(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, inp: PagedInputs, cache: DsaCache,
                  step: int = 0, emb: torch.Tensor | None = None, carry: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The carry: this step's top-k ``[B, Q, topk]`` where ``index_share_for_mtp_iteration`` has later draft
        steps reuse it (handed back as ``carry``), else None (each step selects its own)."""
        if emb is None:
            emb = self.model.embed_tokens(next_token_ids)
        share = self.cfg.indexer.share_for_mtp
        h, selected = self.mtp_layer(step).forward_paged_mtp(emb, hidden, inp, cache, carry if share else None)
        return h, (selected if share else None)
