"""Chunks: runs of consecutive positions per request, right-padded into ``[B, n]`` (:func:`.inputs.pack_chunks`).
What runs them: a prompt's prefill and the MTP catch-up of a request back from K = 0 steps.
"""
from __future__ import annotations

from collections import deque
import torch

from .inputs import DeviceBatch, pack_chunks
from .proposer import DraftInputs
from .requests import Sequence, StepOutput, step_tokens
from .runner_parts import RunnerParts
from .sampling import SamplingTensors, logprob_entries, sample, top_logprobs
from .warmup import GraphWarmup

#: padded tokens one prefill forward takes (requests admitted together share forwards up to this)
PREFILL_TOKENS = 4096
#: K = 0 steps a request keeps the target's hidden states of, to write their MTP cache entries when it drafts again
#: (explorations bring every K back every ``EXPLORE_EVERY`` steps of a bucket); older positions stay unwritten
MAX_CATCH_UP = 512


class Chunks:
    def __init__(self, parts: RunnerParts, warm: GraphWarmup) -> None:
        self.parts = parts
        #: whether the prompt graphs are warm (``warm_graphs: first`` runs prompts eagerly until they are)
        self.warm = warm
        #: per request, its K = 0 steps since it last drafted: (the step's hidden states [rows, D], its row)
        self.undrafted: dict[int, deque[tuple[torch.Tensor, int]]] = {}

    def forget(self, req_id: int) -> None:
        """A request is prefilled anew (preempted): the hidden states kept for its catch-up are void."""
        self.undrafted.pop(req_id, None)

    # -- prompts ----------------------------------------------------------------------------------
    def prefill(self, seqs: list[Sequence], generator: torch.Generator | None) -> StepOutput:
        """Prefill each prompt, or for a preempted request its prompt and generated tokens (recompute); returns per
        request the token sampled at its last position, its logprob entry (if asked) and the drafts for its first
        step. Requests go together, right-padded, up to ``PREFILL_TOKENS`` padded tokens and the largest bucket a
        forward: one pass instead of one per request (at batch 16, a fifth of the run's time went to one-by-one
        prefills)."""
        out: list[tuple[int, dict[int, float] | None, list[int]]] = []
        group: list[Sequence] = []
        for seq in seqs:
            longest = max([seq.num_tokens, *(s.num_tokens for s in group)])
            if group and (longest * (len(group) + 1) > PREFILL_TOKENS or len(group) == self.parts.batch_sizes[-1]):
                out += self._prefill_group(group, generator)
                group = []
            group.append(seq)
        out += self._prefill_group(group, generator)
        logprobs = [[e] if e is not None else None for _, e, _ in out]
        return StepOutput([[t] for t, _, _ in out], [0] * len(out), 0,
                          logprobs if any(e is not None for e in logprobs) else None, [d for _, _, d in out])

    def _prefill_group(self, seqs: list[Sequence], generator: torch.Generator | None
                       ) -> list[tuple[int, dict[int, float] | None, list[int]]]:
        r = self.parts
        tokens = [s.prompt_ids + s.output_ids for s in seqs]
        n = max(len(t) for t in tokens)
        ids, pos, slots, table, seq_lens, last = self._pack(seqs, tokens, [0] * len(seqs))
        lens_host = r.host_lengths([n] * len(seqs))  # each block's end: padded to the longest (see _pack)
        graph = r.prefill_graph
        with torch.no_grad():
            args = [ids, pos, slots, table, seq_lens, last]
            # ``warm_graphs: first`` runs prompts eagerly unless warm-up compiled their graph (never in a step)
            warm = self.warm.prompts_warm or r.cfg.warm_graphs == "all"
            served = graph is not None and warm and graph.serves(len(seqs), n)
            hidden, last_logits = (graph(args, (r.caches.target,), host_lengths=lens_host) if served
                                   else r.prefill_eager(*args, r.caches.target, lens_host))
            hidden = hidden[:, :n]  # [B, n, D]: a graph's query may be padded wider
            token = sample(last_logits, SamplingTensors.from_params([s.params for s in seqs], r.device), generator)
        firsts = token.tolist()
        entries: list[dict[int, float] | None] = [None] * len(seqs)
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if wanted:
            top_ids, top_lp, tok_lp = (t.tolist() for t in top_logprobs(last_logits.unsqueeze(1), token.view(-1, 1),
                                                                          max(wanted)))
            entries = [logprob_entries(top_ids[i][0], top_lp[i][0], tok_lp[i][0], firsts[i], s.params.logprobs)
                       if s.params.logprobs is not None else None for i, s in enumerate(seqs)]
        if r.proposer is None:
            return [(t, e, []) for t, e in zip(firsts, entries)]
        drafts = self._draft(DraftInputs(ids, pos, hidden, slots, token, last, table, seq_lens, lens_host))
        return [(t, e, d) for t, e, d in zip(firsts, entries, drafts.tolist())]

    # -- the catch-up out of K = 0 ------------------------------------------------------------------
    def note_undrafted(self, running: list[Sequence], hidden: torch.Tensor) -> None:
        """A K = 0 step ran no MTP layer: keep each row's hidden state (a reference to the step's output, no copy)
        so that the MTP cache entries of this position can be written when the request drafts again."""
        live = {s.req_id for s in running}
        for rid in [r for r in self.undrafted if r not in live]:
            del self.undrafted[rid]  # finished
        for i, s in enumerate(running):
            kept = self.undrafted.get(s.req_id)
            if kept is None:
                kept = self.undrafted[s.req_id] = deque(maxlen=MAX_CATCH_UP)
            kept.append((hidden, i))

    def catch_up(self, batch: DeviceBatch, running: list[Sequence]) -> None:
        """Requests back from K = 0 steps: write the MTP cache entries of those positions from the hidden states
        kept (the draft chain over them as over a prompt chunk: each entry depends only on its position's hidden
        state and next token), so that the drafts attend to a whole context, and take the chunk's drafts as this
        step's. Without it those entries stay unwritten and every later draft of the request attends over the gap
        (the acceptance adaptive K learns from its explorations out of K = 0 fell with it)."""
        rows = [(i, s, self.undrafted.pop(s.req_id)) for i, s in enumerate(running) if s.req_id in self.undrafted]
        if not rows:
            return
        dev = self.parts.device
        seqs = [s for _, s, _ in rows]
        # the kept steps verified positions num_tokens - 1 - len(kept) .. num_tokens - 2, one token each
        firsts = [s.num_tokens - 1 - len(kept) for _, s, kept in rows]
        tokens = [(s.prompt_ids + s.output_ids)[f: s.num_tokens - 1] for (_, s, _), f in zip(rows, firsts)]
        ids, pos, slots, table, seq_lens, last = self._pack(seqs, tokens, firsts)
        n = ids.shape[1]
        first = rows[0][2][0][0]
        hidden = first.new_zeros(len(rows), n, first.shape[-1])
        for r, (_, _, kept) in enumerate(rows):
            hidden[r, : len(kept)] = torch.stack([h[i] for h, i in kept])
        token = torch.tensor([s.last_token for s in seqs], dtype=torch.long, device=dev)
        lens_host = self.parts.host_lengths(f + n for f in firsts)  # each block's padded end (see _pack)
        drafts = self._draft(DraftInputs(ids, pos, hidden, slots, token, last, table, seq_lens, lens_host))
        idx = torch.tensor([i for i, _, _ in rows], dtype=torch.long, device=dev)
        batch.input_ids[idx, 1:] = drafts[:, : batch.k].to(batch.input_ids.dtype)
        batch.num_draft[idx] = batch.k
        for i, _, _ in rows:
            batch.num_draft_host[i] = batch.k

    # -- shared -----------------------------------------------------------------------------------
    def _pack(self, seqs: list[Sequence], tokens: list[list[int]], firsts: list[int]) -> tuple[torch.Tensor, ...]:
        """``inputs.pack_chunks`` with the table as wide as the chunks' drafts reach (a row's padded query block
        ends at first + n, the drafts chain on from its last position)."""
        r = self.parts
        n = max(len(t) for t in tokens)
        width = r.width_for(max(step_tokens(f + n, r.k_max) for f in firsts))
        return pack_chunks(seqs, tokens, firsts, width, r.cfg.max_model_len, r.caches.block_size, r.device)

    def _draft(self, inputs: DraftInputs) -> torch.Tensor:
        """Drafts ``[B, K]`` for chunks of positions (a prompt, a K = 0 stretch), writing their MTP cache entries:
        the draft chain's graph where it was warmed for chunks (with the prompt graph), else the eager reference."""
        b, n = inputs.target_token_ids.shape
        proposer = self.parts.proposer
        assert proposer is not None
        if self.warm.prompts_warm and proposer.graph_serves(b, n):
            return proposer.propose(inputs)
        return proposer.propose_reference(inputs)
