"""Per-request sampling parameters, sync-free batched sampling, the sampling modes graphs are keyed by, and the
top logprobs a step reports (on device, then per row on the host).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

# Temperatures below this are clamped: dividing by a denormal would overflow logits to inf and softmax to NaN.
_MIN_TEMPERATURE = 1e-5

#: the sampling modes a compiled step is keyed by: every row greedy, or some rows sampled
GREEDY, RANDOM = "greedy", "random"
#: top logprobs a logprobs graph returns per token (vLLM's default ``max_logprobs``); requests take their N of them
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings of one request. ``temperature == 0`` means greedy; ``top_k == 0`` disables top-k."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    #: per-request seeds: not served (None only); ``Engine.generate(..., seed=N)`` seeds a whole run
    seed: int | None = None
    #: vLLM's meaning: return the top-``logprobs`` log-probabilities of each generated position (plus the
    #: sampled token's), from the target's raw logits. None: none returned.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in the range (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            # a per-request seed would need per-row random streams inside the fixed-shape graphs; never dropped
            raise ValueError(f"seed={self.seed!r}: per-request seeds are not served by this engine (one generator "
                             "draws for the whole batch: generate(..., seed=N) makes a run repeat); allowed: None")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, request: dict) -> "SamplingParams":
        """A request's sampling settings as a client sends them (vLLM's keywords). The engine serves
        ``temperature``, ``top_k`` (vLLM's ``-1``: off), ``top_p`` and ``logprobs``; any other key (a per-request
        ``seed`` too) is one ``ValueError`` naming it and those, never a setting silently dropped (inside vLLM,
        vLLM's sampler serves the rest)."""
        served = [f for f in cls.__slots__ if f != "seed"]
        unknown = [k for k in request if k not in served]
        if unknown:
            raise ValueError(f"sampling parameter {unknown[0]!r} is not served by this engine; allowed: "
                             f"{', '.join(served)} (vLLM's sampler serves the others where ours drafts inside vLLM)")
        kw = dict(request)
        if kw.get("top_k") == -1:
            kw["top_k"] = 0
        return cls(**kw)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``, or ``None`` (global RNG) when ``seed`` is None.

    One generator drives a whole batch, so a seeded request is reproducible for the same batch composition.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Batched sampling parameters on device; each field has shape ``[B]``.

    The ``all_greedy``/``any_top_k``/``any_top_p`` flags are host booleans fixed at build time: they pick which
    (static) computation runs, so skipping the sort for plain batches needs no sync.
    """

    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (their probabilities are unused)
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool = False
    any_top_k: bool = True
    any_top_p: bool = True

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu") -> "SamplingTensors":
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else max(p.temperature, _MIN_TEMPERATURE) for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            any_top_k=any(p.top_k > 0 and not g for p, g in zip(params, greedy)),
            any_top_p=any(p.top_p < 1 and not g for p, g in zip(params, greedy)),
        )

    @classmethod
    def greedy_batch(cls, batch_size: int, device: torch.device | str = "cpu") -> "SamplingTensors":
        return cls.from_params([SamplingParams()] * batch_size, device)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


def _per_row(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """View a ``[B]`` (or leading-prefix shaped) parameter so it broadcasts over ``ndim``-dim logits."""
    return t.reshape(t.shape + (1,) * (ndim - t.dim()))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k / top-p set with -inf (new tensor).

    ``top_k``/``top_p`` have the shape of ``logits.shape[:-1]`` (already broadcast). Sort-based so per-row k and p
    need no host values. Ties at the k-th value are all kept (threshold semantics, as in vLLM). Top-p keeps the
    smallest set of highest tokens whose mass reaches p, measured after top-k.
    """
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
        threshold = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(-1)
        drop[..., -1] = False  # the top token always survives
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(-1, sorted_idx, sorted_logits)


def logits_to_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Float32 probabilities after temperature, top-k and top-p; ``st`` fields broadcast over leading dims.

    ``logits`` is ``[B, ..., V]`` and ``st`` fields are ``[B]`` (or any leading prefix of ``logits.shape[:-1]``).
    Greedy rows use temperature 1; their result is not meant to be used.
    """
    ndim = logits.dim()
    lead = logits.shape[:-1]
    temp = torch.where(st.greedy, torch.ones_like(st.temperature), st.temperature)
    x = logits.float() / _per_row(temp, ndim)
    top_k = _per_row(st.top_k, ndim - 1).expand(lead) if st.any_top_k else None
    top_p = _per_row(st.top_p, ndim - 1).expand(lead) if st.any_top_p else None
    if top_k is not None or top_p is not None:
        x = apply_top_k_top_p(x, top_k, top_p)
    return x.softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None,
                      noise: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one index per row by the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``: sync-free, no multinomial.

    ``probs`` need not be normalised (the race is scale-invariant per row). Returns int64 ``probs.shape[:-1]``.
    ``noise``: ``E`` drawn beforehand (a compiled graph takes its randomness as an input); else drawn here.
    """
    if noise is None:
        noise = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / noise).argmax(dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (int64, ``logits.shape[:-1]``): argmax on greedy rows, a sample from the processed probs on others."""
    greedy_ids = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_ids
    sampled = sample_from_probs(logits_to_probs(logits, st), generator)
    return torch.where(_per_row(st.greedy, logits.dim() - 1), greedy_ids, sampled)


def top_logprobs(logits: torch.Tensor, sampled: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """logits [B, Q, V], sampled [B, Q] (−1 placeholders allowed) → (top ids, top logprobs [B, Q, n],
    sampled token's logprob [B, Q]); raw log-softmax of the target's logits, as vLLM's default reports."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top_lp, top_ids = lp.topk(n, dim=-1) if n else (lp[..., :0], sampled.new_zeros(*sampled.shape, 0))
    return top_ids, top_lp, lp.gather(-1, sampled.long().clamp(min=0).unsqueeze(-1)).squeeze(-1)


def logprob_entries(top_ids: list, top_lp: list, tok_lp: float, token: int, n: int) -> dict[int, float]:
    """One token's entry: its ``n`` top logprobs and the sampled ``token``'s own."""
    entry = dict(zip(top_ids[:n], top_lp[:n]))
    entry[token] = tok_lp
    return entry


def row_logprobs(asked: list[int | None], tokens: list[list[int]], lp_h: list[list]) -> list:
    """Per row, one entry per accepted token for the rows that asked (``asked[i]``: row ``i``'s logprobs, None for
    the others, whose entry is None); ``lp_h``: the host copies of :func:`top_logprobs`' (ids, logprobs, sampled
    token's logprob)."""
    ids, lps, tok = lp_h
    return [[logprob_entries(ids[i][j], lps[i][j], tok[i][j], t, n) for j, t in enumerate(tokens[i])]
            if n is not None else None for i, n in enumerate(asked)]
