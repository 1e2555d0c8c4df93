"""The package index: which releases exist, and where their wheels are."""

from __future__ import annotations

import dataclasses
import html.parser
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from packaging.utils import InvalidSdistFilename, InvalidWheelFilename, parse_sdist_filename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .common import CheckError, VersionNotFound, log


DEFAULT_INDEX = "https://pypi.org/simple"
INDEX_TTL_S = 3600
USER_AGENT = "ascend-spec-upgrade-check/1 (+pip-compatible; range reads)"


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
