"""Paged latent KV caches (target layers + the draft layer), their block allocator, and blocks on demand.
Blocks are handed out as sequences grow; when the pool runs dry the engine preempts its newest request.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .graph.config import ModelConfig
from .graph.latent_cache import (DEFAULT_BLOCK_SIZE, LatentCache, block_size_of, cache_tensors,
                                 num_blocks_for)

NULL_BLOCK = 0  # never handed out: rows with slot -1 are redirected here (see graph.latent_cache.write_latent_cache)


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


class BlockManager:
    """Grows each sequence's block list on demand from one :class:`BlockAllocator`."""

    def __init__(self, allocator: BlockAllocator, max_model_len: int, block_size: int) -> None:
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.block_size = block_size

    def blocks_for(self, num_tokens: int) -> int:
        return num_blocks_for(min(num_tokens, self.max_model_len), self.block_size)

    def ensure_capacity(self, blocks: list[int], num_tokens: int) -> bool:
        """Extend ``blocks`` (in place: the sequence's own list) to hold ``num_tokens`` tokens, capped at
        ``max_model_len``; all or nothing. False when the pool lacks the blocks (nothing is taken then)."""
        missing = self.blocks_for(num_tokens) - len(blocks)
        if missing <= 0:
            return True
        if missing > self.allocator.num_free:
            return False
        blocks.extend(self.allocator.allocate(missing))
        return True

    def free(self, blocks: list[int]) -> None:
        """Return all of a finished or preempted sequence's blocks to the pool (a preempted one is recomputed)."""
        self.allocator.free(blocks)
        blocks.clear()


@dataclass
class KVCaches:
    """One latent cache per target layer, plus one for the MTP draft layer, each ``layout`` (fused
    ``[num_blocks, block_size, 576]`` or a nope/rope pair, :mod:`.graph.latent_cache`).

    Both share block ids: a request's block table addresses the target caches and the draft cache alike.
    """

    target: tuple[LatentCache, ...]
    draft: LatentCache
    allocator: BlockAllocator
    max_blocks_per_seq: int

    @property
    def block_size(self) -> int:
        return block_size_of(self.draft)

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_model_len: int, max_num_seqs: int, device: torch.device | str,
                 dtype: torch.dtype = torch.float32, num_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 layout: str = "fused") -> "KVCaches":
        """``num_blocks``: the pool, null block included; default room for ``max_num_seqs`` full-length
        sequences. It must hold one ``max_model_len`` sequence (preemption can always free enough for one)."""
        per_seq = num_blocks_for(max_model_len, block_size)
        if num_blocks is None:
            num_blocks = per_seq * max_num_seqs + 1
        elif num_blocks < per_seq + 1:
            raise ValueError(f"kv_blocks={num_blocks}: {num_blocks - 1} usable blocks of {block_size} tokens "
                             f"cannot hold one max_model_len={max_model_len} sequence; allowed: >= {per_seq + 1} "
                             "(block 0 is reserved)")

        def one() -> LatentCache:
            return cfg.layer_cache(layout, num_blocks, block_size, dtype, device)

        target = tuple(one() for _ in range(cfg.num_hidden_layers))
        draft = one()
        if torch.device(device).type == "cuda":
            # The pool lives as long as the engine: CUDA graphs must read and write it where it is. CUDA graph trees
            # copy an input that is not static into a buffer of their own, so an unmarked cache would not be the one
            # the next replay reads.
            for cache in (*target, draft):
                for t in cache_tensors(cache):
                    torch._dynamo.mark_static_address(t)
        return cls(target, draft, BlockAllocator(num_blocks), per_seq)
