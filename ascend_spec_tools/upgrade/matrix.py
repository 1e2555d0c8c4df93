"""--matrix: in which release each manifest item drifted, over a range of releases."""

from __future__ import annotations

import concurrent.futures as cf
import re

from packaging.version import InvalidVersion, Version

from .common import CheckError, M, VersionNotFound, log
from .fetch import Fetcher
from .reader import Reader, Reading, list_diff
from .remote_zip import Progress
from .report import Row, md_cell
from .runners import V2_ONLY_SHIM, read_runners
from .source_tree import SourceTree


def parse_range(spec: str) -> tuple[Version, Version | None]:
    """``FROM..TO``; TO ``latest`` (None) is the newest release on the index."""
    lo, sep, hi = spec.partition("..")
    if not sep:
        raise CheckError(f"--matrix wants FROM..TO (TO a version or 'latest'), got {spec!r}")
    try:
        return Version(lo), None if hi == "latest" else Version(hi)
    except InvalidVersion as e:
        raise CheckError(f"--matrix: {e}") from e


def matrix(manifest, fetcher: Fetcher, lo: Version, hi: Version | None, jobs: int) -> tuple[str, dict, int]:
    known = fetcher.index.versions()
    hi = hi if hi is not None else max(v for v in known if not v.is_prerelease and not v.is_devrelease)
    for v in (lo, hi):
        if v not in known:
            raise VersionNotFound(f"{fetcher.package} {v} not found on {fetcher.index.index_url} "
                                  f"(latest there: {known[-1] if known else 'none'})")
    versions = [v for v in known if lo <= v <= hi and not v.is_prerelease and not v.is_devrelease]
    log(f"[matrix] {len(versions)} releases of {fetcher.package}: {versions[0]} … {versions[-1]}")
    prog = Progress(f"{fetcher.package} ×{len(versions)}", fetcher.progress)
    trees: dict[Version, SourceTree] = {}
    try:
        with cf.ThreadPoolExecutor(max_workers=jobs) as ex:
            futs = {ex.submit(fetcher.tree, str(v), prog): v for v in versions}
            for f in cf.as_completed(futs):
                trees[futs[f]] = f.result()
    finally:
        prog.close()
    text, data, code = render_matrix(manifest, fetcher.package, versions, trees)
    if manifest.root == "vllm":
        runners = {str(v): read_runners(manifest, trees[v], trees[versions[-1]]) for v in versions}
        data["runners"] = {v: r.as_dict() for v, r in runners.items()}
        text += "\n\n| release | MTP model runner: default, and each runner's drafter seam |\n|---|---|\n" + \
            "\n".join(f"| {v} | {md_cell(r.cell())} |" for v, r in runners.items())
        last = runners[str(versions[-1])]
        v2_items = {it.id for it in manifest.items if V2_ONLY_SHIM in it.shims}
        counted = [i["id"] for i in data["items"] if i["broken"] and (last.default == "v2" or i["id"] not in v2_items)]
        if last.default != "v2":
            text += f"\n\nV1 is the MTP default in {versions[-1]}: V2 items' verdicts there do not count."
        code = int(bool(counted) or last.broken)
    data["fetch"] = fetcher.stats
    return text, data, code


def render_matrix(manifest, package: str, versions: list, trees: dict) -> tuple[str, dict, int]:
    """The drift table over ``versions`` (oldest first), each read from ``trees[version]``."""
    readings: dict = {}
    for v in versions:
        r = Reader(trees[v])
        readings[v] = {it.id: r.read(it) for it in manifest.items}
    unparsed = [f"{t.label}: {e}" for t in trees.values() for e in t.parse_errors]
    if unparsed:
        raise CheckError("cannot parse " + "; ".join(unparsed) + " (a newer Python may be needed)")
    first, last = versions[0], versions[-1]
    lines = [f"## {'vLLM' if manifest.root == 'vllm' else manifest.package} API drift across {package} {first} … "
             f"{last} ({len(versions)} releases)", "",
             f"| item | {first} | drifted in (release: before → after) | {last} | verdict {first} → {last} "
             f"| unsupported in |", "|---|---|---|---|---|---|"]
    out_items = []
    broken_last = 0
    for it in manifest.items:
        hist = []
        for prev, cur in zip(versions, versions[1:]):
            a, b = readings[prev][it.id], readings[cur][it.id]
            if M.comparable(a.fp, it.compare) != M.comparable(b.fp, it.compare):
                hist.append({"release": str(cur), "before": a.shape, "after": b.shape,
                             "change": change_text(it.kind, a, b),
                             "evidence": Row(it.id, it.kind, a, b, None).evidence()})
        unsupported = [str(v) for v in versions
                       if M.verdict(manifest, it, readings[v][it.id].fp, readings[v][it.id].fp).broken]
        v = M.verdict(manifest, it, readings[first][it.id].fp, readings[last][it.id].fp)
        broken_last += v.broken
        hist_s = "<br>".join(f"**{h['release']}**: {h['change']}" for h in hist) or "—"
        lines.append(f"| `{it.id}` | {md_cell(readings[first][it.id].shape)} | {md_cell(hist_s)} | "
                     f"{md_cell(readings[last][it.id].shape)} | {'**BROKEN**' if v.broken else v.text} | "
                     f"{compress_versions(unsupported, [str(x) for x in versions]) or '—'} |")
        out_items.append({"id": it.id, "first": readings[first][it.id].shape, "last": readings[last][it.id].shape,
                          "drifts": hist, "verdict": v.text, "shim": v.shim, "broken": v.broken,
                          "unsupported_in": unsupported})
    lines += ["", f"**{len(manifest.items)} items** over {len(versions)} releases; "
                  f"{sum(bool(i['drifts']) for i in out_items)} items drifted at least once; "
                  f"{broken_last} BROKEN in {last}."]
    data = {"package": package, "releases": [str(v) for v in versions], "items": out_items}
    return "\n".join(lines), data, 1 if broken_last else 0


def change_text(kind: str, a: Reading, b: Reading) -> str:
    """What changed between two readings of one item, briefly (lists as +added/−removed)."""
    if a.fp.get("found") and b.fp.get("found"):
        key = {"method-params": "params", "function": "params", "dataclass-fields": "fields"}.get(kind)
        if key and a.fp[key] != b.fp[key]:
            diff = list_diff(a.fp[key], b.fp[key])
            where_a, where_b = (re.search(r"\[in (\w+)\]$", r.shape) for r in (a, b))
            where_a, where_b = (w.group(1) if w else None for w in (where_a, where_b))
            if kind == "method-params" and where_a != where_b:
                diff += f" (now in {where_b})" if where_b else " (now on the class itself)"
            return diff
    return f"{a.shape} → {b.shape}"


def compress_versions(sel: list[str], allv: list[str]) -> str:
    """['0.10.0','0.10.1','0.11.0'] over a contiguous run of releases -> '0.10.0–0.11.0'."""
    if not sel:
        return ""
    idx = [allv.index(s) for s in sel]
    runs, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b is None or b != a + 1:
            runs.append(allv[start] if start == a else f"{allv[start]}–{allv[a]}")
            start = b
    return ", ".join(runs)
