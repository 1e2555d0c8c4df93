"""Paged latent KV caches (target layers + the draft layer) and their block allocator."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .graph.attention import num_blocks_for
from .graph.config import KV_BLOCK_SIZE, ModelConfig

NULL_BLOCK = 0  # never handed out: rows with slot -1 are redirected here (see graph.attention.write_latent_cache)


class OutOfBlocks(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}; need >= 2 (block 0 is the reserved null block)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class KVCaches:
    """One ``[num_blocks, 16, 576]`` latent cache per target layer, plus one for the MTP draft layer.

    Both share block ids: a request's block table addresses the target caches and the draft cache alike.
    """

    target: tuple[torch.Tensor, ...]
    draft: torch.Tensor
    allocator: BlockAllocator
    max_blocks_per_seq: int

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_model_len: int, max_num_seqs: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32) -> "KVCaches":
        per_seq = num_blocks_for(max_model_len)
        num_blocks = per_seq * max_num_seqs + 1
        shape = (num_blocks, KV_BLOCK_SIZE, cfg.latent_dim)
        target = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers))
        draft = torch.zeros(shape, dtype=dtype, device=device)
        return cls(target, draft, BlockAllocator(num_blocks), per_seq)
