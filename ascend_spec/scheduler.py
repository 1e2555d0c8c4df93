"""Requests and their lifecycle: admission, KV blocks on demand, preemption, appending tokens, finishing.

The scheduler never touches a tensor; the runner (:mod:`.runner`) never touches a request's lifecycle
(nano-vllm's split). The engine's loop is ``schedule → runner step → append``.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockManager
from .sampling import SamplingParams


@dataclass
class Sequence:
    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


#: pseudo-drafts each position's acceptance starts from
PRIOR_WEIGHT = 2
#: drafts (per position) the acceptance adaptive K weighs is an average over, an exponential window, most recent
#: first: it follows the requests running now. Over the whole run, the first requests' drafts held the figure down
#: for good (bundled model, batch 1: position 1 accepted 0.21 over the first 74 steps, 0.65 over the run; the
#: policy turned to K = 0 at 0.32 and, learning from explorations only, had reached 0.44 after 1,700 steps)
ACCEPTANCE_WINDOW = 64


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance a_j = P(draft j accepted | drafts < j accepted): counts over the run
    (``offered``, ``accepted``), and ``rates()`` over the last ``ACCEPTANCE_WINDOW`` or so drafts of each position,
    smoothed by ``PRIOR_WEIGHT`` pseudo-drafts at the rate of the position before (1/2 for the first). Deep positions
    are verified only when a K that reaches them runs; under a flat prior of 1/2 a policy running a low K would
    judge a high one by that prior and never pick it, while MTP heads' conditional acceptance holds or rises with
    depth."""

    offered: list[int]
    accepted: list[int]
    #: exponentially weighted counts: each draft of a position multiplies that position's by 1 - 1/window first
    recent_offered: list[float]
    recent_accepted: list[float]

    @classmethod
    def empty(cls, k: int) -> "AcceptanceTracker":
        return cls([0] * k, [0] * k, [0.0] * k, [0.0] * k)

    def record(self, num_draft: int, num_accepted: int) -> None:
        keep = 1 - 1 / ACCEPTANCE_WINDOW
        for j in range(num_draft):
            if j <= num_accepted:
                hit = j < num_accepted
                self.offered[j] += 1
                self.accepted[j] += hit
                self.recent_offered[j] = keep * self.recent_offered[j] + 1
                self.recent_accepted[j] = keep * self.recent_accepted[j] + hit

    def rates(self) -> list[float]:
        rates, prior = [], 0.5
        for a, o in zip(self.recent_accepted, self.recent_offered):
            prior = (a + PRIOR_WEIGHT * prior) / (o + PRIOR_WEIGHT)
            rates.append(prior)
        return rates


@dataclass
class ScheduleResult:
    """What changed while making room for the next step: requests preempted, and whether a running one grew."""

    preempted: list[Sequence] = field(default_factory=list)
    grown: bool = False


class Scheduler:
    def __init__(self, blocks: BlockManager, max_model_len: int, max_num_seqs: int, k_max: int,
                 eos_token_id: int | None) -> None:
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.k_max = k_max
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.arrivals: dict[int, int] = {}

    def add(self, seqs: list[Sequence], arrivals: list[int]) -> None:
        """Queue ``seqs``; ``arrivals[i]``: the decode step at which ``seqs[i]`` arrives."""
        self.arrivals.update((s.req_id, a) for s, a in zip(seqs, arrivals))
        self.waiting.extend(sorted(seqs, key=lambda s: self.arrivals[s.req_id]))

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def step_tokens(self, seq: Sequence, k: int | None = None) -> int:
        """Cache room one step at K = ``k`` (default K_max) needs: verify positions up to ``start + K``, chained
        draft positions up to ``start + 2K - 1`` (``start = num_tokens - 1``)."""
        k = self.k_max if k is None else k
        return seq.num_tokens - 1 + max(1 + k, 2 * k)

    def next_admission(self, arrived: int, pending: int = 0) -> Sequence | None:
        """The next waiting request to prefill, if the batch has room (``pending``: requests taken for this
        prefill, not yet running), it has arrived (``arrived``: the steps run so far; an idle engine takes the next
        arrival at once) and the pool holds its prefill and first step."""
        if not self.waiting or len(self.running) + pending >= self.max_num_seqs:
            return None
        head = self.waiting[0]
        if self.arrivals[head.req_id] > arrived and (self.running or pending):
            return None
        if not self.blocks.ensure_capacity(head.blocks, self.step_tokens(head) + 1):
            return None
        return self.waiting.popleft()

    def admissions(self, arrived: int) -> list[Sequence]:
        """Every request :meth:`next_admission` would take now, in order: they prefill together."""
        taken: list[Sequence] = []
        while (seq := self.next_admission(arrived, len(taken))) is not None:
            taken.append(seq)
        return taken

    def admitted(self, seq: Sequence) -> None:
        """``seq`` was prefilled: it runs, or (finished by its first token) gives its blocks back."""
        if seq.finish_reason:
            self.blocks.free(seq.blocks)
        else:
            self.running.append(seq)

    def make_room(self, k: int | None = None) -> ScheduleResult:
        """Blocks for every running sequence's next step at K = ``k`` (default K_max: a step at K = 0 reserves no
        draft room, so plain decoding keeps its batch where drafting would preempt); while the pool is short,
        preempt the newest request (its blocks go back; it waits at the head of the queue and is recomputed, as in
        vLLM)."""
        result = ScheduleResult()
        running, i = self.running, 0
        while i < len(running):
            held = len(running[i].blocks)
            if self.blocks.ensure_capacity(running[i].blocks, self.step_tokens(running[i], k)):
                result.grown |= len(running[i].blocks) > held
                i += 1
                continue
            victim = running.pop()
            self.blocks.free(victim.blocks)
            victim.draft_ids = []
            self.waiting.appendleft(victim)
            result.preempted.append(victim)
        return result

    def append(self, seq: Sequence, token: int) -> bool:
        """Append one generated token; returns True when the request just finished."""
        seq.output_ids.append(token)
        if self.eos_token_id is not None and token == self.eos_token_id:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "max_model_len"
        return seq.finish_reason is not None

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.blocks)


# -- the cache addresses of a request (read by the runner) -----------------------------------------
def block_row(seq: Sequence, width: int) -> list[int]:
    """The first ``width`` entries of ``seq``'s block table, padded with the null block."""
    return seq.blocks[:width] + [0] * (width - min(len(seq.blocks), width))


def slots_of(seq: Sequence, positions: list[int], max_model_len: int, block_size: int) -> list[int]:
    """Cache slots of ``positions`` in blocks of ``block_size``; -1 (write nothing) at or past ``max_model_len``."""
    return [seq.blocks[p // block_size] * block_size + p % block_size
            if p < max_model_len else -1 for p in positions]
