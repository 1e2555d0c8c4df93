"""Comparing two releases item by item, and the Markdown / JSON reports."""

from __future__ import annotations

import dataclasses
from typing import Any

from .common import M
from .reader import Reader, Reading, list_diff
from .source_tree import SourceTree


@dataclasses.dataclass
class Row:
    id: str
    kind: str
    before: Reading
    after: Reading
    verdict: Any  # manifest.Verdict

    def evidence(self) -> str:
        a, b = self.before, self.after
        bits = []
        if b.loc:
            bits.append(b.loc)
        elif a.loc:
            bits.append(f"was {a.loc}")
        if self.kind in ("method-params", "function") and a.fp.get("found") and b.fp.get("found") \
                and a.fp["params"] != b.fp["params"]:
            bits.append(list_diff(a.fp["params"], b.fp["params"]))
        if self.kind == "dataclass-fields" and a.fp.get("found") and b.fp.get("found"):
            diff = list_diff(a.fp["fields"], b.fp["fields"])
            if diff:
                bits.append(diff)
        for key, label in (("_missing", "missing"), ("_new_required", "new required")):
            if b.fp.get(key):
                bits.append(f"{label}: {', '.join(b.fp[key])}")
        if b.fp.get("_positional_ok") is False:
            bits.append("positional order changed")
        if b.detail:
            bits.append(b.detail)
        return "; ".join(bits)


def compare(manifest, before: SourceTree, after: SourceTree) -> list[Row]:
    rb, ra = Reader(before), Reader(after)
    rows = []
    for it in manifest.items:
        a, b = rb.read(it), ra.read(it)
        rows.append(Row(it.id, it.kind, a, b, M.verdict(manifest, it, a.fp, b.fp)))
    return rows


def md_cell(s: str) -> str:
    return (s or "").replace("|", "\\|").replace("\n", " ")


def render_markdown(rows: list[Row], before: SourceTree, after: SourceTree, extra: str = "") -> str:
    fl, tl = before.version or before.label, after.version or after.label
    out = [f"## API drift: {before.label} → {after.label}", "",
           f"| item | from ({fl}) | to ({tl}) | verdict | evidence |", "|---|---|---|---|---|"]
    for r in rows:
        v = r.verdict.text if not r.verdict.broken else "**BROKEN**"
        out.append(f"| `{r.id}` | {md_cell(r.before.shape)} | {md_cell(r.after.shape)} | {v} | "
                   f"{md_cell(r.evidence())} |")
    out += ["", summary_line(rows)]
    if extra:
        out += ["", extra]
    return "\n".join(out)


def summary_line(rows: list[Row]) -> str:
    n_b = sum(r.verdict.broken for r in rows)
    n_u = sum(r.verdict.text == M.UNCHANGED for r in rows)
    n_s = sum(r.verdict.shim is not None for r in rows)
    n_c = len(rows) - n_b - n_u - n_s
    s = f"**{len(rows)} items**: {n_u} unchanged, {n_s} drifted and covered by a shim, {n_c} drifted and compatible, " \
        f"{n_b} BROKEN."
    if n_b:
        s += " Broken: " + ", ".join(f"`{r.id}`" for r in rows if r.verdict.broken) + "."
    return s


def rows_json(rows: list[Row]) -> list[dict]:
    def clean(fp):
        return {k: v for k, v in fp.items() if not k.startswith("_")}

    return [{"id": r.id, "kind": r.kind, "from": r.before.shape, "to": r.after.shape,
             "from_fingerprint": clean(r.before.fp), "to_fingerprint": clean(r.after.fp),
             "verdict": r.verdict.text, "shim": r.verdict.shim, "broken": r.verdict.broken,
             "evidence": r.evidence()} for r in rows]
