"""The model contract: what the step functions, the fused step, the engine and ``compat/`` call on a model, whichever
family it is (docs/model-families.md explains each member)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .backends.base import Backend
    from .config import ModelConfig
    from .paging import PagedInputs

#: one layer's paged cache, whatever the family keeps there (``ModelConfig.layer_cache`` allocates it): a tensor or
#: a tuple of tensors sharing the block ids and block size (``[blocks, block, width]`` each)
LayerCache = Any


class MtpLayerLike(Protocol):
    shared_head: Any  # ``.norm``: the RMSNorm that feeds the vocabulary head and the next draft step


class MtpModel(Protocol):
    """A target model with MTP layer(s), as the graphs use it. Shapes: ``B`` rows × ``Q`` tokens, ``D`` hidden."""

    cfg: "ModelConfig"
    #: a host engine's vocabulary-parallel greedy head, or None (``graph.vocab_parallel``)
    greedy_head: nn.Module | None
    attention_kernel: str
    #: draft steps 2..K take exact device KV lengths (GE graphs) instead of the host's upper bound
    exact_draft_lengths: bool

    @property
    def takes_host_lengths(self) -> bool: ...

    def use_backend(self, backend: "Backend") -> None: ...

    def set_compile_regions(self, enabled: bool) -> None: ...

    def target_paged(self, input_ids: torch.Tensor, inp: "PagedInputs", caches: list[LayerCache]) -> torch.Tensor:
        """``[B, Q]`` ids → final-normed hidden ``[B, Q, D]``; writes each layer's cache first."""

    def target_dense(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` → float32 logits ``[..., V]``."""

    def mtp_layer(self, step: int = 0) -> MtpLayerLike: ...

    def mtp_paged(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, inp: "PagedInputs", cache: LayerCache,
                  step: int = 0, emb: torch.Tensor | None = None, carry: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step → ``(pre-norm hidden [B, Q, D], carry)``: the carry (per token ``[B, Q, ...]`` or None)
        goes to the next draft step, each row's sampled token's only (``[B, 1, ...]``)."""

    def mtp_write_cache(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, inp: "PagedInputs",
                        cache: LayerCache, step: int = 0) -> None:
        """What :meth:`mtp_paged` writes into the draft cache, and nothing else (a K = 0 step)."""

    def mtp_dense(self, next_token_ids: torch.Tensor, hidden: torch.Tensor, step: int = 0) -> torch.Tensor: ...

    def mtp_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor: ...

    def mtp_greedy(self, hidden: torch.Tensor, step: int, with_embedding: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``[B, D]`` → ``(token [B], its embedding [B, D] or None, logits [B, V] or [B, 0])``."""
