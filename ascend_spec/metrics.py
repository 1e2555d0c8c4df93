"""Speculative decoding metrics, counted on the host from each step's (already transferred) results."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0  # verify steps of one request that carried >= 1 draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens
        self.drafted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for pos in range(num_draft):
            self.drafted_per_position[pos] += 1
            if pos < num_accepted:
                self.accepted_per_position[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """vLLM's "mean acceptance length": 1 (the target's own token) + accepted drafts per verify step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_per_position": [round(x, 4) for x in self.acceptance_per_position],
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }


@dataclass
class RunStats:
    """One ``Engine.generate`` run, counted on the host."""

    backend: str
    num_steps: int = 0
    request_steps: int = 0  # Σ over steps of the batch size
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    #: host syncs counted in the host code between and around a step's graphs (what runs inside a compiled graph
    #: is the graph lint's: ``graph_host_ops``); count_host_syncs only
    host_syncs: int = 0
    host_sync_events: list[str] = field(default_factory=list)
    #: device -> host reads after each decode step's graphs, its results for bookkeeping: one per fused step (its
    #: tokens; logprobs add their three tensors), three per step-by-step step (tokens, valid counts, drafts);
    #: count_host_syncs only
    host_transfers: int = 0
    host_transfer_events: list[str] = field(default_factory=list)
    #: compiled graphs that failed during the run, each step rerun eagerly (``graph_failure: eager``)
    graph_failures: int = 0
    #: ops needing the host that the graph lint found in the graphs this engine compiled (``graph_failure: raise``
    #: refuses such graphs)
    graph_host_ops: int = 0
    #: graphs Dynamo compiled during the run after warm-up (0 when every path replays warm graphs)
    recompiles_after_warmup: int = 0
    #: graphs warm-up deferred (``warm_graphs: first``) that the run compiled when a step first needed them, and
    #: the seconds those compiles took (the steps waited on them)
    deferred_compiles: int = 0
    deferred_compile_seconds: float = 0.0
    preemptions: int = 0
    #: from the ``generate`` call to the first token sampled (warm-up included where it came first)
    first_token_seconds: float = 0.0
    #: warm-up: graphs compiled and the seconds it took (0 when already warm)
    graphs_compiled: int = 0
    compile_seconds: float = 0.0
    #: fused path: steps run per K, and the K each bucket would choose at the end of the run
    steps_per_k: dict[int, int] = field(default_factory=dict)
    k_by_bucket: dict[int, int] = field(default_factory=dict)
    #: fused steps whose K differs from the step before's (adaptive K's explorations and changes of mind)
    k_switches: int = 0
    #: what those changes cost before their steps ran (the batch rebuilt, the MTP catch-up out of K = 0), seconds
    switch_seconds: float = 0.0
    #: where ``decode_seconds`` went (the step-time account): fused graph replays, the runner's host work around
    #: them (inputs, the tokens' transfer), prefills (eager, with their first drafts); the rest is the engine's loop
    graph_seconds: float = 0.0
    host_seconds: float = 0.0
    prefill_seconds: float = 0.0
    #: fused path: device batches rebuilt (composition, K, sampling mode or logprobs changed)
    batch_rebuilds: int = 0
    #: fused path, Σ over steps: the keys each verify's attention reads (graph rows × the block-table width it is
    #: passed) and the keys its live rows need (each row's context through its last query). Their ratio is what
    #: padding every row to the longest costs: 1 when the rows started together and advance alike, more when they
    #: finish apart (speculation, mixed lengths)
    attention_keys_read: int = 0
    attention_keys_live: int = 0

    @property
    def host_syncs_per_step(self) -> float:
        return self.host_syncs / self.num_steps if self.num_steps else 0.0

    @property
    def host_transfers_per_step(self) -> float:
        return self.host_transfers / self.num_steps if self.num_steps else 0.0
