#!/usr/bin/env python3
"""Does speculation pay, at every batch size? End to end, side by side in one run, with a step-time account.

    python tools/bench.py --out docs/bench [--batches 1 2 4 8 16] [--ks 1 2 3] [--max-tokens 128] [--rounds N]

One engine (inductor, the bundled model, greedy) serves every contender, so they replay the same compiled graphs:
no-spec (K = 0), fixed K for each ``--ks`` and adaptive K (the default policy, its acceptance and choices learned
afresh in each run). The requests are ``tools/bench_prompts.txt`` (prompts outside the training corpus), cycled to
at least four per slot; batch size ``b`` means at most ``b`` running at once, a finished request's slot going to the
next (continuous batching, as a server runs: a closed batch would end at the pace of its slowest request).
Contenders take turns on each chunk of 4b requests, in an order that rotates from chunk to chunk and round to round,
and all generate the same tokens. Rounds repeat the whole set; figures are medians over rounds. By default there are
as many rounds as contenders, so each runs once in every place of the order (at batch 4 and above a round is one
chunk: with fewer rounds a contender can run after the same neighbour every time). Every request runs to
``--max-tokens``, so plain decoding's requests, admitted together, advance in lockstep; ``--length-spread S`` draws
each request's budget from ``max-tokens ± S`` instead (the same for every contender), so that requests end apart
with or without drafts, as real traffic's do (``make bench-mixed``). ``--twin K`` runs fixed K a second time as one
more contender: measured against the best as adaptive K is, it shows the noise floor of that figure.

The step-time account (per batch size and K, on the first 4b requests): each fused step's graph time and the
host time around it, prefill and the engine's loop, measured inside a run and summed against its wall time; in a
second run, on every 4th step, the three phases of the fused graph (verify of 1 + K tokens, acceptance, the K-step
draft chain) are compiled separately and timed on that step's own inputs (medians). ``verify(1+K) ÷ step(1)``
compares verify with the K = 0 step's graph. Two figures name what rows finishing apart cost, which no step's time
shows: live rows a step (the queue's last requests drain unevenly) and the attention's keys read over the keys the
live rows need (each row padded to the longest: requests that started together and advance alike read 1×).

A speed-up is printed only when the baseline is sound: the no-spec runs' wall time per step within 20% of their
one-token step cost, the graph replays timed inside those same runs (otherwise they measured something else:
prefills, host work). Both come from the same runs because this machine's speed drifts by ±20% between runs
minutes apart; interleaving is what keeps the contenders comparable. The limit a run could reach is
``tokens per step × graph(K=0) ÷ graph(K)``, the graph times of the interleaved runs; efficiency is the speed-up
over it.
``--device cuda`` runs the CUDA-graph path; there a step's graph time is its replay's launch and the GPU's work is
waited for in the host time, so the baseline check withholds the speed-up column and the phase probe is off (a
phase's replay would overwrite the previous phase's CUDA-graph outputs); compare tokens/s.
Writes ``results.md``, ``results.json``, ``speedup.png`` and ``step_account.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ascend_spec.adaptive import speedup_limit
from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import Engine
from ascend_spec.fused_step import PHASE_DIMS, StepKey, make_spec_phases
from ascend_spec.graph.weights import load_model
from ascend_spec.k_policy import AcceptanceTracker
from ascend_spec.metrics import RunStats
from ascend_spec.models import BUNDLED_MODEL_DIR
from ascend_spec.sampling import GREEDY, SamplingParams
from ascend_spec.tokenizer import TextTokenizer

PROMPTS_FILE = Path(__file__).with_name("bench_prompts.txt")
MAX_MODEL_LEN = 512
#: a baseline whose wall time per step strays further than this from its one-token graph time is not a baseline
BASELINE_TOLERANCE = 0.20
PROBE_EVERY = 4
REQUESTS_PER_SLOT = 4


def read_prompts(path: Path, tok: TextTokenizer) -> list[list[int]]:
    return [tok.encode(line.replace("\\n", "\n")) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Tally:
    """One contender's run over every request at one batch size."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    request_steps: int = 0
    requests: int = 0
    graph: float = 0.0
    host: float = 0.0
    prefill: float = 0.0
    rebuilds: int = 0
    k_switches: int = 0
    switch_seconds: float = 0.0
    keys_read: int = 0
    keys_live: int = 0
    steps_per_k: dict[int, int] = field(default_factory=dict)
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    #: conditional acceptance counted per draft (a K that changes from step to step), else None
    rates: list[float] | None = None

    def add(self, stats: RunStats, outputs: list[list[int]], metrics) -> None:  # noqa: ANN001 - SpecMetrics | None
        self.tokens += stats.generated_tokens
        self.seconds += stats.decode_seconds
        self.steps += stats.num_steps
        self.request_steps += stats.request_steps
        self.requests += len(outputs)
        self.graph += stats.graph_seconds
        self.host += stats.host_seconds
        self.prefill += stats.prefill_seconds
        self.rebuilds += stats.batch_rebuilds
        self.k_switches += stats.k_switches
        self.switch_seconds += stats.switch_seconds
        self.keys_read += stats.attention_keys_read
        self.keys_live += stats.attention_keys_live
        for k, n in stats.steps_per_k.items():
            self.steps_per_k[k] = self.steps_per_k.get(k, 0) + n
        if metrics is not None:
            zeros = [0] * len(metrics.drafted_per_position)
            self.drafted = [a + b for a, b in zip(self.drafted or zeros, metrics.drafted_per_position)]
            self.accepted = [a + b for a, b in zip(self.accepted or zeros, metrics.accepted_per_position)]
        self.outputs += outputs

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_request_step(self) -> float:
        """Decode tokens per request-step (the first token of each request comes from its prefill)."""
        return (self.tokens - self.requests) / self.request_steps

    def acceptance(self) -> list[float]:
        """Conditional acceptance a_j = P(draft j accepted | drafts < j accepted): ``rates`` where counted per
        draft, else a fixed-K run's, whose accepted drafts form a prefix, so position j is reached as often as
        position j - 1 was accepted."""
        if self.rates is not None:
            return self.rates
        rates = []
        for j, a in enumerate(self.accepted):
            reached = self.accepted[j - 1] if j else self.drafted[0]
            rates.append(a / reached if reached else 0.0)
        return rates


def per_round_ratio(runs: list[Tally], base: list[Tally]) -> float:
    """A contender's tokens/s over another's (no-spec's, for × no-spec): each round's ratio to the other's run of
    that round, then the median. The machine's speed drifts between rounds (by 1.5x within one bench), and a
    contender's neighbours in time share its speed; a ratio of medians would set one round's run against another's."""
    return statistics.median(t.tokens_per_s / n.tokens_per_s for t, n in zip(runs, base, strict=True))


def graph_ms_per_step(tallies: list[Tally]) -> float:
    """Median over runs of the graph replay time per step (the step's cost without prefills, host work, the loop)."""
    return statistics.median(1e3 * t.graph / t.steps for t in tallies)


def requests_for(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """At least four requests per running slot (the prompts cycled): the batch stays full while the queue drains."""
    return [prompts[i % len(prompts)] for i in range(max(len(prompts), REQUESTS_PER_SLOT * batch))]


def lengths_for(n: int, max_tokens: int, spread: int) -> list[int]:
    """Each request's token budget: ``max_tokens`` for every one, or drawn uniformly from ``max_tokens ± spread`` (a
    fixed seed: the same for every contender), so that requests end apart as real traffic's do."""
    rng = random.Random(0)
    return [max_tokens + (rng.randint(-spread, spread) if spread else 0) for _ in range(n)]


def serve(eng: Engine, requests: list[list[int]], batch: int, max_tokens: list[int], k: int | None,
          tally: Tally | None = None) -> Tally:
    """``requests`` with at most ``batch`` running at once (continuous batching: a finished request's slot goes to
    the next), at K = ``k`` (None: adaptive)."""
    eng.force_k = k
    tally = tally or Tally()
    outs, stats, metrics = eng.generate(requests, SamplingParams(), max_tokens, max_num_seqs=batch)
    tally.add(stats, [o.token_ids for o in outs], metrics)
    return tally


def use_tracker(eng: Engine, tracker: AcceptanceTracker) -> None:
    eng.k_policy.acceptance = tracker


def turn_order(names: list[str], turn: int) -> list[str]:
    """``names`` rotated by ``turn``: over as many turns as there are contenders, each runs once in every place (a
    fixed order would always run one contender first after another batch size's graphs, or last)."""
    shift = turn % len(names)
    return names[shift:] + names[:shift]


def serve_interleaved(eng: Engine, requests: list[list[int]], batch: int, max_tokens: list[int],
                      contenders: dict[str, int | None], turn: int = 0) -> dict[str, Tally]:
    """The requests in chunks of ``REQUESTS_PER_SLOT × batch``, each chunk served by every contender in turn (the
    order rotating from chunk to chunk, starting at ``turn``), so a noisy second weighs on all of them alike.
    Adaptive K learns afresh, as an engine started now would (its acceptance and its choices; the step costs
    measured so far stay), and keeps what it learns across the chunks."""
    tallies = {name: Tally() for name in contenders}
    eng.k_policy.restart()
    own, scratch = eng.k_policy.acceptance, AcceptanceTracker.empty(eng.k_max)
    chunk = REQUESTS_PER_SLOT * batch
    try:
        for n, i in enumerate(range(0, len(requests), chunk)):
            for name in turn_order(list(contenders), turn + n):
                k = contenders[name]
                use_tracker(eng, own if k is None else scratch)
                serve(eng, requests[i: i + chunk], batch, max_tokens[i: i + chunk], k, tallies[name])
    finally:
        use_tracker(eng, scratch)
    for name, k in contenders.items():
        if k is None:  # adaptive K drafts a different K from step to step: its own tracker counts per draft
            tallies[name].rates = [a / o if o else 0.0 for a, o in zip(own.accepted, own.offered)]
    return tallies


class PhaseProbe:
    """Times the fused step's phases, compiled separately, on a real step's inputs (every ``PROBE_EVERY`` steps)."""

    def __init__(self, eng: Engine) -> None:
        self.eng = eng
        self.graphs: dict[int, tuple] = {}
        self.seconds: dict[str, list[float]] = {"verify": [], "accept": [], "draft": []}
        self.calls = 0

    def phases(self, k: int) -> tuple:
        if k not in self.graphs:
            p = make_spec_phases(self.eng.model, k, self.eng.cfg.max_model_len, GREEDY)
            backend = self.eng.backend
            self.graphs[k] = tuple(backend.compile(fn, f"probe_{name}_k{k}", PHASE_DIMS[name])
                                   for name, fn in (("verify", p.verify), ("accept", p.accept), ("propose", p.propose)))
        return self.graphs[k]

    def __call__(self, key: StepKey, args: tuple) -> None:
        self.calls += 1
        if self.calls % PROBE_EVERY == 0:
            self._time_phases(key, args)

    def _time_phases(self, key: StepKey, args: tuple) -> None:
        verify, accept, propose = self.phases(key.k)
        (input_ids, start, num_draft, table, live, temperature, top_k, top_p, greedy, uniform, exponential,
         max_len, caches, draft_cache) = args
        with torch.no_grad():
            for warm in (True, False):  # the first call of a new shape may compile
                t0 = time.perf_counter()
                pos, slots, seq_lens, nd, hidden, logits = verify(input_ids, start, num_draft, table, live, max_len,
                                                                caches)
                t1 = time.perf_counter()
                sampled, *_ = accept(input_ids, nd, logits, temperature, top_k, top_p, greedy, uniform, exponential)
                t2 = time.perf_counter()
                propose(input_ids, start, sampled, pos, hidden, slots, table, seq_lens, max_len, draft_cache)
                t3 = time.perf_counter()
        for name, t in (("verify", t1 - t0), ("accept", t2 - t1), ("draft", t3 - t2)):
            self.seconds[name].append(t)


def account(eng: Engine, prompts: list[list[int]], batch: int, max_tokens: int, spread: int, k: int) -> dict:
    """The step-time account at K = ``k``, ms per step: one run timed as it is (wall, graph, host, prefill, loop), one
    more with the phase probe (it runs extra graphs between steps, so its own step times are not used)."""
    reqs = requests_for(prompts, batch)[: REQUESTS_PER_SLOT * batch]
    lengths = lengths_for(len(reqs), max_tokens, spread)
    tally = serve(eng, reqs, batch, lengths, k)
    probe = PhaseProbe(eng)
    if not eng.backend.reuses_outputs:  # a phase's replay would overwrite the previous phase's CUDA-graph outputs
        eng.runner.step_observer = probe
        try:
            serve(eng, reqs, batch, lengths, k)
        finally:
            eng.runner.step_observer = None
    per_step = lambda s: 1e3 * s / tally.steps  # noqa: E731
    graph, host, prefill, wall = (per_step(x) for x in (tally.graph, tally.host, tally.prefill, tally.seconds))
    phases = {name: 1e3 * statistics.median(v) if v else float("nan") for name, v in probe.seconds.items()}
    draft = phases["draft"] if k else 0.0
    return {"batch": batch, "k": k, "wall_ms": wall, "graph_ms": graph, "host_ms": host, "prefill_ms": prefill,
            "loop_ms": wall - graph - host - prefill, "verify_ms": phases["verify"], "accept_ms": phases["accept"],
            "draft_ms": draft, "phases_ms": phases["verify"] + phases["accept"] + draft, "rebuilds": tally.rebuilds,
            "steps": tally.steps, "live_rows": tally.request_steps / tally.steps,
            "keys_read_per_live": tally.keys_read / tally.keys_live}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--model", type=Path, default=BUNDLED_MODEL_DIR)
    ap.add_argument("--prompts", type=Path, default=PROMPTS_FILE)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--length-spread", type=int, default=0,
                    help="draw each request's token budget from max-tokens ± this (default 0: all equal)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds over the whole set (default: one per contender, each in every place once)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda (inductor: plain on CPU, CUDA graphs on CUDA)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    ap.add_argument("--prefill-widths", type=int, nargs="*", default=None,
                    help="torchair_graph_config.prefill_query_widths (default the config's; none: eager prompts)")
    ap.add_argument("--twin", type=int, default=None, metavar="K",
                    help="run fixed K (one of --ks) as a second contender too: what two identical contenders come "
                         "to against each other, and against the best, is the noise floor of adaptive ÷ best")
    ap.add_argument("--no-account", dest="account", action="store_false",
                    help="end-to-end contenders only: skip the step-time account (its runs take as long again)")
    args = ap.parse_args()
    if min(args.ks) < 1:
        ap.error("--ks: speculative K values >= 1 (the no-spec baseline always runs)")
    if args.twin is not None and args.twin not in args.ks:
        ap.error(f"--twin: one of --ks {args.ks} (got {args.twin})")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds: at least 1 (got {args.rounds})")
    torch.manual_seed(0)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    tok = TextTokenizer(args.model)
    prompts = read_prompts(args.prompts, tok)
    k_max = max(args.ks)
    cfg = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=max(args.batches),
                       speculative=SpeculativeConfig(num_speculative_tokens=k_max),
                       graph=GraphModeConfig(backend="inductor", graph_batch_sizes=tuple(sorted(args.batches)),
                                                 **({} if args.prefill_widths is None
                                                    else {"prefill_query_widths": tuple(args.prefill_widths)})),
                       adaptive_k=True, keep_learnings=False)  # adaptive K learns afresh (no earlier run's figures)
    eng = Engine(model, cfg, device=args.device)
    eng.eos_token_id = None  # every request generates max_tokens: the same work for every contender
    t0 = time.perf_counter()
    report = eng.warmup(progress=True)
    warmup_s = time.perf_counter() - t0
    warm_costs = {b: dict(c) for b, c in eng.step_seconds.items()}  # the runs move the policy's figures
    contenders: dict[str, int | None] = {"no-spec": 0, **{f"K={k}": k for k in args.ks},
                                         **({twin_name(args.twin): args.twin} if args.twin else {}), "adaptive": None}
    if args.rounds is None:
        args.rounds = len(contenders)

    runs: dict[tuple[int, str], list[Tally]] = {}
    for r in range(args.rounds):
        for b in args.batches:
            reqs = requests_for(prompts, b)
            lengths = lengths_for(len(reqs), args.max_tokens, args.length_spread)
            for name, t in serve_interleaved(eng, reqs, b, lengths, contenders, turn=r).items():
                runs.setdefault((b, name), []).append(t)
                print(f"round {r} batch {b} {name}: {t.tokens_per_s:.1f} tok/s", flush=True)
    accounts = {(b, k): account(eng, prompts, b, args.max_tokens, args.length_spread, k)
                for b in args.batches for k in [0, *args.ks]} if args.account else {}
    for a in accounts.values():
        print(f"account batch {a['batch']} K={a['k']}: " + ", ".join(
            f"{key} {v:.2f}" for key, v in a.items() if key.endswith("_ms")), flush=True)

    rows = []
    for b in args.batches:
        base = runs[(b, "no-spec")]
        one_token = graph_ms_per_step(base)
        base_step = statistics.median(1e3 * t.seconds / t.steps for t in base)
        sound = abs(base_step - one_token) <= BASELINE_TOLERANCE * one_token
        for name, k in contenders.items():
            ts = runs[(b, name)]
            last = ts[-1]
            rate = statistics.median(t.tokens_per_s for t in ts)
            speedup = per_round_ratio(ts, base)
            row = {"batch": b, "contender": name, "tokens_per_s": rate, "vs_no_spec": speedup,
                   "tokens_per_s_per_round": [t.tokens_per_s for t in ts],
                   "speedup": speedup if sound else None,
                   "tokens_per_request_step": last.tokens_per_request_step,
                   "acceptance_per_position": last.acceptance(), "steps_per_k": last.steps_per_k,
                   "k_switches": last.k_switches,
                   "ms_per_switch": 1e3 * last.switch_seconds / last.k_switches if last.k_switches else None,
                   "same_tokens_as_no_spec": last.outputs == base[-1].outputs,
                   "baseline_ms_per_step": base_step, "one_token_graph_ms": one_token, "baseline_sound": sound}
            if k:  # the limit these step costs and this acceptance allow
                limit = speedup_limit({0: one_token, k: graph_ms_per_step(ts)}, last.acceptance(), k)
                row.update(limit=limit, efficiency=speedup / limit if sound else None)
            rows.append(row)
    by_batch = {b: {n: runs[(b, n)] for n in contenders} for b in args.batches}
    versus, twins = cells_vs_best(rows, by_batch, twin_name(args.twin) if args.twin else None)
    fixed = {k: name for name, k in contenders.items() if k is not None and not name.endswith(TWIN_SUFFIX)}
    for row in versus:
        b = row["batch"]
        row["choices"] = choices_vs_best(runs[(b, "adaptive")], {k: runs[(b, n)] for k, n in fixed.items()},
                                         runs[(b, row["best"])])
        print(f"batch {b}: adaptive {row['ratio']:.2f}x the best other contender ({row['best']}; "
              f"{fmt_interval(row['interval'])}), {fmt(row['held_out'])}x the best picked on the other rounds; "
              f"its choices {fmt(row['choices'])}x", flush=True)
    for t in twins:
        print(f"batch {t['batch']}: {t['twin']} {t['vs_original']:.2f}x {t['twin'].removesuffix(TWIN_SUFFIX)}, "
              f"{t['ratio']:.2f}x the best ({t['best']}; {fmt_interval(t['interval'])}), {fmt(t['held_out'])}x the "
              "best picked on the other rounds", flush=True)
    for line in summary_lines(versus, twins):
        print(line, flush=True)
    machine = torch.cuda.get_device_name() if eng.device.type == "cuda" else cpu_kind()
    meta = {"model": args.model.name, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": machine, "device": args.device, "max_tokens": args.max_tokens,
            "length_spread": args.length_spread,
            "rounds": args.rounds, "requests": len(prompts), "twin": args.twin, "warmup_seconds": warmup_s,
            "graphs_compiled": report.graphs_compiled, "step_seconds_at_warmup": warm_costs,
            "step_seconds_at_end": eng.step_seconds,
            "command": "python tools/bench.py"
                       + ("" if args.model.resolve() == Path(BUNDLED_MODEL_DIR).resolve() else f" --model {args.model}")
                       + " --batches " + " ".join(map(str, args.batches)) + " --ks "
                       + " ".join(map(str, args.ks)) + f" --max-tokens {args.max_tokens} --rounds {args.rounds}"
                       + (f" --length-spread {args.length_spread}" if args.length_spread else "")
                       + (f" --twin {args.twin}" if args.twin else "")
                       + ("" if args.device == "cpu" else f" --device {args.device}")
                       + (f" --dtype {args.dtype}" if args.dtype else "")}
    write_report(args.out, rows, list(accounts.values()), meta, versus, twins)
    print(f"wrote {args.out}/results.md and plots")


def cpu_kind() -> str:
    """The CPU the bench ran on: its model name, torch's capability and whether it has AMX tiles, and the threads.
    Torch's capability alone reads ``AVX512`` on a Xeon with AMX and on an AMD EPYC without, whose figures differ."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
             if line.startswith("model name")]
    amx = ", AMX" if platform.machine().lower() in ("x86_64", "amd64") and torch.cpu._is_amx_tile_supported() else ""
    name = f"{names[0]}, " if names else ""
    return (f"{name}{platform.machine()} ({torch.backends.cpu.get_cpu_capability()}{amx}), "
            f"{torch.get_num_threads()} threads")


#: the default must not lose: adaptive K's tokens/s against the best of no-spec and every fixed K, per batch
ADAPTIVE_GOAL = 0.97


#: what ``--twin K`` names its second run of fixed K
TWIN_SUFFIX = " again"


def twin_name(k: int) -> str:
    return f"K={k}{TWIN_SUFFIX}"


def against_best(rows: list[dict], contender: str = "adaptive") -> list[dict]:
    """Per batch: ``contender``'s tokens/s over the best other contender's (no-spec or a fixed K; adaptive and a
    twin are never the best), each taken as its median ratio to no-spec's run of the same round; needs no sound
    baseline (a ratio of tokens/s). A twin measured so shows what the machine's noise and picking the best of
    several noisy contenders make of a contender that is one of them."""
    out = []
    for b in sorted({r["batch"] for r in rows}):
        cell = {r["contender"]: r["vs_no_spec"] for r in rows if r["batch"] == b}
        others = [n for n in cell if n not in (contender, "adaptive") and not n.endswith(TWIN_SUFFIX)]
        if contender not in cell or not others:
            continue
        best = max(others, key=cell.__getitem__)
        out.append({"batch": b, "best": best, "ratio": cell[contender] / cell[best]})
    return out


def against_held_out_best(runs: dict[str, list[Tally]], contender: str = "adaptive") -> float | None:
    """``contender``'s tokens/s over the best other contender's, that one picked on the other rounds: per round,
    the contender with the best median ratio to no-spec over the rounds left, and the ratio of the two runs of this
    round; then the median. ``against_best`` picks the best on the same rounds it measures, so a contender that
    rose by noise is the yardstick and the figure errs low (a copy of the best came to 0.97x it over five cells);
    picked apart from the round it is measured in, the best's figure carries no such luck. None with one round."""
    others = [n for n in runs if n not in (contender, "adaptive") and not n.endswith(TWIN_SUFFIX)]
    rounds = len(runs["no-spec"])
    if rounds < 2 or contender not in runs or not others:
        return None

    def vs_no_spec(name: str, r: int) -> float:
        return statistics.median(runs[name][i].tokens_per_s / runs["no-spec"][i].tokens_per_s
                                 for i in range(rounds) if i != r)

    ratios = []
    for r in range(rounds):
        best = max(others, key=lambda name: vs_no_spec(name, r))
        ratios.append(runs[contender][r].tokens_per_s / runs[best][r].tokens_per_s)
    return statistics.median(ratios)


#: share of bootstrap draws an interval holds, and the draws
INTERVAL_LEVEL = 0.9
INTERVAL_DRAWS = 2000


def interval_vs_best(runs: dict[str, list[Tally]], contender: str = "adaptive", level: float = INTERVAL_LEVEL,
                     draws: int = INTERVAL_DRAWS, seed: int = 0) -> tuple[float, float] | None:
    """The ``level`` bootstrap interval of ``against_best``'s figure: rounds drawn with replacement (one draw of
    round numbers for every contender, so a round's runs stay together), the best picked and ``contender`` set
    against it on each draw: how far a cell's figure may lie from the one more rounds would give. None with one
    round."""
    others = [n for n in runs if n not in (contender, "adaptive") and not n.endswith(TWIN_SUFFIX)]
    rounds = len(runs["no-spec"])
    if rounds < 2 or contender not in runs or not others:
        return None
    base = np.array([t.tokens_per_s for t in runs["no-spec"]])
    vs = {n: np.array([t.tokens_per_s for t in runs[n]]) / base for n in [contender, *others]}
    picks = np.random.default_rng(seed).integers(0, rounds, size=(draws, rounds))
    cell = {n: np.median(v[picks], axis=1) for n, v in vs.items()}
    figure = cell[contender] / np.max([cell[n] for n in others], axis=0)
    low, high = np.quantile(figure, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def cells_vs_best(rows: list[dict], runs: dict[int, dict[str, list[Tally]]],
                  twin: str | None = None) -> tuple[list[dict], list[dict]]:
    """Per batch (``runs``: each contender's tallies, round by round): adaptive K against the best other contender
    (``against_best`` on ``rows``), with the best picked on the other rounds and the interval; and the same for
    ``twin`` (None: no twin ran), with its ratio to the contender it copies."""
    versus = against_best(rows)
    for v in versus:
        v["held_out"] = against_held_out_best(runs[v["batch"]])
        v["interval"] = interval_vs_best(runs[v["batch"]])
    twins = []
    if twin is not None:
        original = twin.removesuffix(TWIN_SUFFIX)
        for t in against_best(rows, twin):
            per_name = runs[t["batch"]]
            twins.append({**t, "twin": twin, "vs_original": per_round_ratio(per_name[twin], per_name[original]),
                          "held_out": against_held_out_best(per_name, twin),
                          "interval": interval_vs_best(per_name, twin)})
    return versus, twins


def priced_mix(adaptive: Tally, fixed: dict[int, Tally]) -> float | None:
    """Tokens/s adaptive K's steps would have made at the fixed runs' own rates: its steps at each K priced at the
    tokens and seconds a step of that K's fixed run made and took (prefills and the loop included). None where it
    ran a K no fixed run measured."""
    ran = {k: n for k, n in adaptive.steps_per_k.items() if n}
    if not ran or any(k not in fixed or not fixed[k].steps for k in ran):
        return None
    tokens = sum(n * fixed[k].tokens / fixed[k].steps for k, n in ran.items())
    seconds = sum(n * fixed[k].seconds / fixed[k].steps for k, n in ran.items())
    return tokens / seconds


def choices_vs_best(adaptive: list[Tally], fixed: dict[int, list[Tally]], best: list[Tally]) -> float | None:
    """Adaptive K's choices against the best contender: per round, its mix of K priced at that round's fixed runs
    (``priced_mix``) over the best's tokens/s, then the median. What it chose, without what switching cost it and
    without its own run's noise, which ``against_best`` carries (a copy of the best contender came to 0.92x it)."""
    ratios = []
    for r, run in enumerate(adaptive):
        mix = priced_mix(run, {k: runs[r] for k, runs in fixed.items()})
        if mix is None:
            return None
        ratios.append(mix / best[r].tokens_per_s)
    return statistics.median(ratios)


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def fmt_interval(interval: tuple[float, float] | list[float] | None) -> str:
    return "—" if interval is None else f"{interval[0]:.2f}–{interval[1]:.2f}"


def summary_lines(versus: list[dict], twins: list[dict]) -> list[str]:
    """Geometric means over the batches: one cell's ratio errs by more than a cell's goal on a noisy machine, a
    mean over several cells by less; the twin's show what the same noise and the pick of the best make of a
    contender that is one of the others."""
    if len(versus) < 2:
        return []
    mean = lambda rows, key="ratio": statistics.geometric_mean(r[key] for r in rows)  # noqa: E731
    over = f"over batches {', '.join(str(v['batch']) for v in versus)}"
    lines = [f"{over}: adaptive {mean(versus):.3f}x the best other contender (geometric mean)"]
    if all(v.get("held_out") is not None for v in versus):
        lines.append(f"{over}: adaptive {mean(versus, 'held_out'):.3f}x the best picked on the other rounds "
                     "(geometric mean)")
    if all(v.get("choices") is not None for v in versus):
        lines.append(f"{over}: adaptive's choices, priced at the fixed runs' rates, {mean(versus, 'choices'):.3f}x "
                     "the best (geometric mean)")
    if len(twins) > 1:
        held_out = (f", {mean(twins, 'held_out'):.3f}x the best picked on the other rounds"
                    if all(t.get("held_out") is not None for t in twins) else "")
        lines.append(f"over batches {', '.join(str(t['batch']) for t in twins)}: {twins[0]['twin']} "
                     f"{mean(twins):.3f}x the best{held_out}, {mean(twins, 'vs_original'):.3f}x itself "
                     "(geometric means)")
    return lines


def plot_account(out: Path, batches: list[int], accounts: list[dict]) -> None:
    """step_account.png: each batch's step time per K, split into the account's parts."""
    import matplotlib.pyplot as plt

    ks = sorted({a["k"] for a in accounts})
    fig, axes = plt.subplots(1, len(batches), figsize=(2.2 * len(batches) + 1, 4), squeeze=False)
    axes = axes[0]
    parts = [("verify", "verify_ms"), ("accept", "accept_ms"), ("draft chain", "draft_ms"), ("host", "host_ms"),
             ("prefill", "prefill_ms"), ("loop", "loop_ms")]
    for ax, b in zip(axes, batches):
        acc = [next(a for a in accounts if a["batch"] == b and a["k"] == k) for k in ks]
        bottom = [0.0] * len(ks)
        for label, key in parts:
            vals = [max(0.0, a[key]) for a in acc]
            ax.bar([f"K={k}" for k in ks], vals, bottom=bottom, label=label)
            bottom = [x + y for x, y in zip(bottom, vals)]
        ax.plot([f"K={k}" for k in ks], [a["wall_ms"] for a in acc], "k_", markersize=20, label="wall")
        ax.set_title(f"batch {b}")
        ax.set_ylabel("ms per step" if b == batches[0] else "")
    axes[-1].legend(fontsize=7)
    fig.suptitle("Step-time account (measured inside the run)")
    fig.tight_layout()
    fig.savefig(out / "step_account.png", dpi=120)
    plt.close(fig)


def write_report(out: Path, rows: list[dict], accounts: list[dict], meta: dict, versus: list[dict],
                 twins: list[dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    batches = sorted({r["batch"] for r in rows})
    names = [n for n in dict.fromkeys(r["contender"] for r in rows) if n != "no-spec"]
    twins = twins or []
    fig, (ax, vs_ax) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for name in names:
        pts = [(b, r["speedup"]) for b in batches for r in rows
               if r["batch"] == b and r["contender"] == name and r["speedup"] is not None]
        ax.plot([batches.index(b) for b, _ in pts], [s for _, s in pts], marker="o",
                linewidth=2.5 if name == "adaptive" else 1.5, label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="no speculation")
    ax.set_xticks(range(len(batches)), [str(b) for b in batches])
    ax.set(xlabel="batch size (concurrent requests)", ylabel="speed-up over no speculation (×)",
           title=f"MTP speculation, greedy, {meta['model']}, {meta['machine']}")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    vs_ax.bar([str(v["batch"]) for v in versus], [v["ratio"] for v in versus], color="tab:purple")
    bounded = [v for v in versus if v.get("interval") is not None]
    if bounded:
        vs_ax.errorbar([str(v["batch"]) for v in bounded], [v["ratio"] for v in bounded], fmt="none", ecolor="black",
                       yerr=[[v["ratio"] - v["interval"][0] for v in bounded],
                             [v["interval"][1] - v["ratio"] for v in bounded]],
                       capsize=3, label=f"adaptive ÷ best, {INTERVAL_LEVEL:.0%} interval")
    for i, v in enumerate(versus):
        vs_ax.annotate(f"best: {v['best']}", (i, 0.02), ha="center", va="bottom", fontsize=7, color="white")
    if twins:
        vs_ax.plot([str(t["batch"]) for t in twins], [t["ratio"] for t in twins], "k_", markersize=18,
                   label=f"{twins[0]['twin']} ÷ best (noise floor)")
    held_out = [v for v in versus if v.get("held_out") is not None]
    if held_out:
        vs_ax.plot([str(v["batch"]) for v in held_out], [v["held_out"] for v in held_out], "x", color="tab:green",
                   label="÷ best picked on the other rounds")
    chosen = [v for v in versus if v.get("choices") is not None]
    if chosen:
        vs_ax.plot([str(v["batch"]) for v in chosen], [v["choices"] for v in chosen], "o", color="tab:orange",
                   label="its choices ÷ best")
    vs_ax.axhline(ADAPTIVE_GOAL, color="grey", linestyle="--", linewidth=1, label=f"goal {ADAPTIVE_GOAL}")
    vs_ax.set(xlabel="batch size", ylabel="adaptive ÷ best other contender (×)", title="Does the default lose?")
    vs_ax.set_ylim(0, max([1.1, *(1.1 * v["ratio"] for v in versus)]))
    vs_ax.legend(fontsize=7)
    vs_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)

    if accounts:
        plot_account(out, batches, accounts)

    spread = f" ± {meta['length_spread']}" if meta.get("length_spread") else ""
    lines = [f"# Does speculation pay? ({meta['model']})", "",
             f"{meta['machine']}; torch {meta['torch']}; {meta.get('dtype', 'float32')}; greedy, {meta['requests']} "
             f"held-out prompts cycled to 4 requests per slot (at least one each), {meta['max_tokens']}{spread} tokens "
             f"each, continuous batching, max_model_len {MAX_MODEL_LEN}, inductor, fused one-graph step; medians of "
             f"{meta['rounds']} rounds, contenders interleaved (× no-spec: the median of each round's ratio). "
             f"Command: `{meta['command']}`. Warm-up {meta['warmup_seconds']:.0f} s ({meta['graphs_compiled']} "
             "graphs).", "",
             "## End to end", "",
             "| batch | contender | tokens/s | × no-spec | tokens / request-step | limit | efficiency | K run "
             "(steps) | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = ", ".join(f"{k}: {n}" for k, n in sorted(r["steps_per_k"].items()))
        if r["k_switches"]:
            steps += f" ({r['k_switches']} switches, {r['ms_per_switch']:.1f} ms each)"
        lines.append(f"| {r['batch']} | {r['contender']} | {r['tokens_per_s']:.1f} | {fmt(r['speedup'])} | "
                     f"{r['tokens_per_request_step']:.2f} | {fmt(r.get('limit'))} | {fmt(r.get('efficiency'))} | "
                     f"{steps} | {r['same_tokens_as_no_spec']} |")
    lines += ["", "limit: tokens per request-step × graph(K=0) ÷ graph(K), the graph replay times per step of these "
              "same runs; efficiency: × no-spec over the limit."]
    if versus:
        lines += ["", f"Adaptive K (the default) against the best other contender in each batch, their × no-spec "
                  f"figures over each other (goal ≥ {ADAPTIVE_GOAL}):", "",
                  f"| batch | best other | adaptive ÷ best | {INTERVAL_LEVEL:.0%} interval | ÷ best picked on the "
                  "other rounds | its choices ÷ best |", "|---|---|---|---|---|---|"]
        lines += [f"| {v['batch']} | {v['best']} | {v['ratio']:.2f} | {fmt_interval(v.get('interval'))} | "
                  f"{fmt(v.get('held_out'))} | {fmt(v.get('choices'))} |" for v in versus]
        lines += ["", "÷ best picked on the other rounds: per round, adaptive over the contender with the best × "
                  "no-spec over the other rounds, in this round's runs (median of rounds): the best is not picked "
                  "on the luck of the runs it is measured in. Its choices: the K it ran on each step priced at what "
                  "a step of that K made and took in the same round's fixed run, over the best's tokens/s (median "
                  "of rounds): what it chose, without what switching cost it and without its own run's noise. "
                  f"The {INTERVAL_LEVEL:.0%} interval: adaptive ÷ best over rounds drawn with replacement "
                  f"({INTERVAL_DRAWS} draws), how far the figure may lie from the one more rounds would give."]
    if twins:
        name, original = twins[0]["twin"], twins[0]["twin"].removesuffix(TWIN_SUFFIX)
        lines += ["", f"The noise floor: {original} ran twice, as two contenders ({name}). Measured as adaptive is, "
                  f"{name} ÷ best shows what noise and picking the best of several noisy contenders make of a "
                  "contender no worse than one of them:", "",
                  f"| batch | {name} ÷ {original} | best other | {name} ÷ best | {INTERVAL_LEVEL:.0%} interval | "
                  "÷ best picked on the other rounds |", "|---|---|---|---|---|---|"]
        lines += [f"| {t['batch']} | {t['vs_original']:.2f} | {t['best']} | {t['ratio']:.2f} | "
                  f"{fmt_interval(t.get('interval'))} | {fmt(t.get('held_out'))} |" for t in twins]
    if len(versus) > 1:
        lines += [""] + [f"{line[0].upper()}{line[1:]}." for line in summary_lines(versus, twins)]
    unsound = sorted({r["batch"] for r in rows if not r["baseline_sound"]})
    if unsound:
        lines += ["", f"Speed-ups withheld at batch {unsound}: the no-spec wall time per step strays more than "
                  f"{BASELINE_TOLERANCE:.0%} from its one-token graph time in the same runs (" + "; ".join(
                      f"batch {r['batch']}: {r['baseline_ms_per_step']:.2f} vs {r['one_token_graph_ms']:.2f} ms"
                      for r in rows if r["contender"] == "no-spec" and not r["baseline_sound"]) + ")."]
    if accounts:
        lines += account_table(accounts)
    lines += ["", "![speed-up](speedup.png)", ""] + (["![step account](step_account.png)", ""] if accounts else [])
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"meta": meta, "end_to_end": rows, "accounts": accounts,
                                                  "adaptive_vs_best": versus, "twin": twins},
                                                 indent=2, default=str) + "\n")


def account_table(accounts: list[dict]) -> list[str]:
    """The step-time account as Markdown lines."""
    lines = ["", "## Step-time account (ms per step, measured inside the run)", "",
              "wall = graph + host + prefill + loop (loop: the engine's scheduling and bookkeeping, what no other "
              "timer holds). The graph's phases are compiled separately and timed on every 4th step's own inputs; "
              "their sum against the fused graph shows what fusing saves. Rows finishing apart: live rows (a step's "
              "requests, on average, against the batch size: the drain at the end of the queue) and keys read ÷ live "
              "(the attention's keys, every row padded to the longest, over the keys the rows need).", "",
              "| batch | K | wall | graph | host | prefill | loop | verify | accept | draft chain | phases Σ | "
              "verify ÷ step(1) | draft ÷ step(1) | rebuilds | live rows | keys read ÷ live |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in accounts:
        one = next(x for x in accounts if x["batch"] == a["batch"] and x["k"] == 0)["graph_ms"]
        lines.append(f"| {a['batch']} | {a['k']} | {a['wall_ms']:.2f} | {a['graph_ms']:.2f} | {a['host_ms']:.2f} | "
                     f"{a['prefill_ms']:.2f} | {a['loop_ms']:.2f} | {a['verify_ms']:.2f} | {a['accept_ms']:.2f} | "
                     f"{a['draft_ms']:.2f} | {a['phases_ms']:.2f} | {a['verify_ms'] / one:.2f} | "
                     f"{a['draft_ms'] / one:.2f} | {a['rebuilds']} | {a['live_rows']:.2f} | "
                     f"{a['keys_read_per_live']:.2f} |")
    return lines


if __name__ == "__main__":
    main()
