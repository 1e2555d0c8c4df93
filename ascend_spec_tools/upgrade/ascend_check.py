"""``ascend-spec upgrade-check --package vllm-ascend``: the static verdict on vllm-ascend's API, per release.

    ascend-spec upgrade-check --package vllm-ascend --to v0.25.1rc1          # from v0.23.0, the first supported
    ascend-spec upgrade-check --package vllm-ascend --to main --from 0.24.0rc1
    ascend-spec upgrade-check --package vllm-ascend --matrix v0.23.0..main   # every tag, then main
    ascend-spec upgrade-check --package vllm-ascend --source ~/src/vllm-ascend --to local
    ... --archive-dir DIR   # read vllm-ascend-<tag>.tar.gz from DIR (offline)

Items come from ``compat/api_manifest_ascend.yaml``; each release is read from its source archive
(:mod:`.ascend_source`). There is no runtime check: vllm-ascend runs only on an NPU.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from .ascend_source import BRANCH, FIRST_SUPPORTED, AscendSources, tag_for
from .common import CheckError, M, log
from .fetch import cache_root
from .matrix import render_matrix
from .report import compare, render_markdown, rows_json, summary_line
from .source_tree import SourceTree


def _tree(sources: AscendSources, spec: str) -> SourceTree:
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "vllm_ascend").is_dir():
            raise CheckError(f"{p}: no vllm_ascend/ package in it")
        return SourceTree(p, f"vllm-ascend {p.name}", p.name, packages=("vllm_ascend",))
    return sources.tree(spec)


def run(args) -> int:
    t0 = time.time()
    if args.run_tests:
        raise CheckError("--run-tests: vllm-ascend runs only on an Ascend NPU; its check here is static only")
    manifest = M.load(args.manifest or M.ASCEND_PATH)
    sources = AscendSources(manifest.scope, cache_root(args.cache), archive_dir=args.archive_dir,
                            refresh=args.refresh_index)
    if args.matrix:
        lo, sep, hi = args.matrix.partition("..")
        if not sep:
            raise CheckError(f"--matrix wants FROM..TO (TO a tag, 'latest' or 'main'), got {args.matrix!r}")
        labels = sources.range(lo, None if hi in ("latest", BRANCH) else hi)
        if hi == BRANCH:
            labels.append(BRANCH)
        log(f"[matrix] vllm-ascend: {', '.join(labels)}")
        trees = {t: sources.tree(t) for t in labels}
        _check_parsed(trees.values())
        text, data, code = render_matrix(manifest, "vllm-ascend", labels, trees)
        if args.json:
            data.update(exit_code=code, seconds=round(time.time() - t0, 1))
            print(json.dumps(data, indent=1))
        else:
            print(text)
        return code

    if not (args.to or args.source):
        raise CheckError("say what to check: --to TAG (e.g. v0.25.1rc1, main), --source DIR or --matrix FROM..TO")
    after = _tree(sources, str(args.source)) if args.source else _tree(sources, args.to)
    if args.to and args.source:
        after.version = args.to
    frm = FIRST_SUPPORTED if args.frm == "installed" else args.frm
    before = _tree(sources, frm if Path(frm).expanduser().is_dir() else tag_for(frm))
    _check_parsed([before, after])
    rows = compare(manifest, before, after)
    code = 1 if any(r.verdict.broken for r in rows) else 0
    if args.json:
        print(json.dumps({"package": "vllm-ascend", "from": {"label": before.label, "version": before.version},
                          "to": {"label": after.label, "version": after.version}, "items": rows_json(rows),
                          "summary": summary_line(rows), "exit_code": code,
                          "seconds": round(time.time() - t0, 1)}, indent=1))
    else:
        print(render_markdown(rows, before, after))
    return code


def _check_parsed(trees) -> None:
    unparsed = [f"{t.label}: {e}" for t in trees for e in t.parse_errors]
    if unparsed:
        raise CheckError("cannot parse " + "; ".join(unparsed) + " (a newer Python may be needed)")
    for t in trees:
        if t.module_file("vllm_ascend") is None:
            raise CheckError(f"{t.label}: no vllm_ascend package under {t.root}")
