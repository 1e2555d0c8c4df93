"""Requests and their lifecycle: admission, KV blocks on demand, preemption, appending tokens, finishing.
The scheduler never touches a tensor; the runner (:mod:`.runner`) never touches a request's lifecycle.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .k_policy import DeferredGraphs, KPolicy
from .kv_cache import BlockManager
from .metrics import SpecMetrics
from .requests import Sequence, StepOutput, StepPlan, step_tokens

__all__ = ["ScheduleResult", "Scheduler", "Sequence", "StepOutput", "StepPlan"]


@dataclass
class ScheduleResult:
    """What making room for the next step changed: the requests preempted (back to the head of the queue)."""

    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_model_len: int, max_num_seqs: int, k_policy: KPolicy,
                 eos_token_id: int | None, warm: DeferredGraphs | None = None) -> None:
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.k_policy = k_policy
        #: the graphs warm-up deferred, which the K policy compiles when it first picks their K (the runner's)
        self.warm = warm
        self.k_max = k_policy.k_max
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.arrivals: dict[int, int] = {}
        #: the last turn prefilled: the running batch decodes before anything else is admitted
        self._prefilled = False

    def add(self, seqs: list[Sequence], arrivals: list[int]) -> None:
        """Queue ``seqs``; ``arrivals[i]``: the decode step at which ``seqs[i]`` arrives."""
        self.arrivals.update((s.req_id, a) for s, a in zip(seqs, arrivals))
        self.waiting.extend(sorted(seqs, key=lambda s: self.arrivals[s.req_id]))

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def step_tokens(self, seq: Sequence, k: int | None = None) -> int:
        """Cache room one step at K = ``k`` (default K_max) needs (:func:`.requests.step_tokens`)."""
        return step_tokens(seq.num_tokens, self.k_max if k is None else k)

    def schedule(self, arrived: int) -> StepPlan:
        """The next turn (``arrived``: decode steps run so far): the waiting requests that can be admitted now
        (:meth:`admissions`) prefill together, unless the last turn was a prefill; else the running batch decodes
        at the K the K policy gives, with cache room made for that K (:meth:`make_room`)."""
        if not self._prefilled:
            admitted = self.admissions(arrived)
            if admitted:
                self._prefilled = True
                return StepPlan(admitted=admitted)
        self._prefilled = False
        if not self.running:
            return StepPlan()
        step = self.k_policy.plan(self.running, self.warm)
        preempted = self.make_room(step.k).preempted
        return StepPlan(running=list(self.running), preempted=preempted, k=step.k, bucket=step.bucket,
                        fused=step.fused)

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
            if self.blocks.ensure_capacity(running[i].blocks, self.step_tokens(running[i], k)):
                i += 1
                continue
            victim = running.pop()
            self.blocks.free(victim.blocks)
            victim.draft_ids = []
            self.waiting.appendleft(victim)
            result.preempted.append(victim)
        return result

    def postprocess(self, plan: StepPlan, out: StepOutput | None, metrics: SpecMetrics | None) -> int:
        """What ``plan``'s turn gave (``runner.run``; None: nothing ran); returns the tokens appended.

        A prefill: each admitted request takes its first token, its logprob entry and the drafts for its first
        step, then runs, or, finished by that token, gives its blocks back. A decode step, for the running requests
        in order: each row's verified drafts go to the K policy (and ``metrics``), its tokens are appended up to
        its finish, its next drafts kept (step-by-step path); finished requests leave the batch."""
        if out is None:
            return 0
        if plan.admitted:
            return self._admit(plan.admitted, out)
        appended, finished = 0, []
        for i, seq in enumerate(plan.running):
            tokens = out.tokens[i]
            self.k_policy.record(out.num_draft[i], len(tokens) - 1)
            if metrics is not None:
                metrics.record(out.num_draft[i], len(tokens) - 1)
            entries = out.logprobs[i] if out.logprobs is not None else None
            for j, token in enumerate(tokens):
                appended += 1
                if entries is not None and seq.logprobs is not None:
                    seq.logprobs.append(entries[j])
                if self.append(seq, token):
                    finished.append(seq)
                    break
            if out.drafts is not None:
                seq.draft_ids = out.drafts[i]
        for seq in finished:
            self.finish(seq)
        return appended

    def _admit(self, seqs: list[Sequence], out: StepOutput) -> int:
        for i, seq in enumerate(seqs):
            if out.logprobs is not None and out.logprobs[i] is not None:
                seq.logprobs = [*(seq.logprobs or []), *out.logprobs[i]]
            seq.draft_ids = out.drafts[i] if out.drafts is not None else []
            self.append(seq, out.tokens[i][0])
            self.admitted(seq)
        return len(seqs)

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

