"""vllm-ascend's sources per release, from the source archives of its git tags.

vllm-ascend's PyPI sdist needs torch_npu (and CANN) to build its metadata, so the upgrade check reads the GitHub
source archive of a tag (``archive/refs/tags/<tag>.tar.gz``; ``main`` for the branch head) and keeps only the
manifest's ``scope`` files, cached per tag under ``<cache>/vllm-ascend/<tag>/``. ``archive_dir`` (a folder holding
``vllm-ascend-<tag>.tar.gz``) is read first, which is how the check runs offline.
"""
from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import IO

from packaging.version import InvalidVersion, Version

from .common import CheckError, VersionNotFound, log
from .source_tree import SourceTree

REPO_URL = "https://github.com/vllm-project/vllm-ascend"
ARCHIVE_URL = REPO_URL + "/archive/{ref}.tar.gz"
PACKAGE = "vllm-ascend"
BRANCH = "main"
#: the first release the adapter supports (the matrix starts here)
FIRST_SUPPORTED = "v0.23.0"


def tag_for(version: str) -> str:
    """``0.23.0`` / ``v0.23.0`` -> ``v0.23.0``; ``main`` stays."""
    if version == BRANCH:
        return BRANCH
    v = version[1:] if version.startswith("v") else version
    try:
        Version(v)
    except InvalidVersion as e:
        raise CheckError(f"--to {version!r}: not a vllm-ascend release (e.g. v0.23.0, 0.25.1rc1) nor 'main'") from e
    return f"v{v}"


def tag_version(tag: str) -> Version | None:
    try:
        return Version(tag[1:] if tag.startswith("v") else tag)
    except InvalidVersion:
        return None


def _ref(tag: str) -> str:
    return f"refs/heads/{tag}" if tag == BRANCH else f"refs/tags/{tag}"


class AscendSources:
    def __init__(self, scope: tuple[str, ...], cache: Path, archive_dir: Path | None = None,
                 refresh: bool = False) -> None:
        self.scope = scope
        self.cache = Path(cache) / PACKAGE
        self.archive_dir = Path(archive_dir) if archive_dir else None
        self.refresh = refresh

    # ---------------------------------------------------------------------------------- releases
    def tags(self) -> list[str]:
        """Release tags, oldest first (``git ls-remote``; offline: the archives in ``archive_dir``)."""
        if self.archive_dir is not None:
            found = [m.group(1) for p in self.archive_dir.glob(f"{PACKAGE}-*.tar.gz")
                     if (m := re.fullmatch(rf"{PACKAGE}-(.+)\.tar\.gz", p.name))]
        else:
            try:
                out = subprocess.run(["git", "ls-remote", "--tags", REPO_URL], capture_output=True, text=True,
                                     timeout=60, check=True).stdout
            except (OSError, subprocess.SubprocessError) as e:
                raise CheckError(f"cannot list vllm-ascend's tags ({e}); pass --archive-dir") from e
            found = [ln.split("refs/tags/")[1] for ln in out.splitlines()
                     if "refs/tags/" in ln and not ln.endswith("^{}")]
        tags = [t for t in found if t != BRANCH and tag_version(t) is not None]
        return sorted(set(tags), key=tag_version)

    def range(self, lo: str, hi: str | None) -> list[str]:
        """Tags from ``lo`` to ``hi`` (None: the newest tag), pre-releases included (most vllm-ascend tags are)."""
        tags = self.tags()
        lo_v = tag_version(tag_for(lo))
        hi_v = tag_version(tag_for(hi)) if hi else max((tag_version(t) for t in tags), default=None)
        sel = [t for t in tags if lo_v <= tag_version(t) <= hi_v]
        if not sel or tag_for(lo) not in tags:
            raise VersionNotFound(f"vllm-ascend {tag_for(lo)} not among its tags (newest: {tags[-1] if tags else 'none'})")
        return sel

    # ---------------------------------------------------------------------------------- sources
    def files(self, tag: str) -> dict[str, str]:
        """The scope files of ``tag`` (path -> text), extracted from the source archive."""
        with self._archive(tag) as fh:
            return extract_scope(fh, self.scope)

    def tree(self, version: str) -> SourceTree:
        tag = tag_for(version)
        d = self.cache / tag
        marker = d / ".complete.json"
        if tag == BRANCH or self.refresh or not marker.is_file():  # main moves: always re-read
            files = self.files(tag)
            if not any(p.startswith("vllm_ascend/") for p in files):
                raise CheckError(f"vllm-ascend {tag}: the archive holds none of the manifest's files")
            if d.exists():
                shutil.rmtree(d)
            for path, text in files.items():
                (d / path).parent.mkdir(parents=True, exist_ok=True)
                (d / path).write_text(text)
            marker.write_text(json.dumps({"tag": tag, "files": sorted(files)}))
        return SourceTree(d, f"vllm-ascend {tag}", tag, packages=("vllm_ascend",))

    def _archive(self, tag: str) -> IO[bytes]:
        if self.archive_dir is not None:
            p = self.archive_dir / f"{PACKAGE}-{tag}.tar.gz"
            if p.is_file():
                return p.open("rb")
            raise VersionNotFound(f"no {p.name} in {self.archive_dir}")
        url = ARCHIVE_URL.format(ref=_ref(tag))
        log(f"[fetch] {url}")
        tmp = tempfile.TemporaryFile()
        try:
            with urllib.request.urlopen(url, timeout=120) as r:  # noqa: S310 - a fixed https URL
                shutil.copyfileobj(r, tmp)
        except OSError as e:
            tmp.close()
            raise CheckError(f"cannot download {url}: {e}") from e
        tmp.seek(0)
        return tmp


def extract_scope(fh: IO[bytes], scope: tuple[str, ...]) -> dict[str, str]:
    """Members of a GitHub source archive (``<repo>-<ref>/<path>``) whose path matches a ``scope`` glob."""
    out: dict[str, str] = {}
    with tarfile.open(fileobj=fh, mode="r:*") as tar:
        for m in tar:
            if not m.isfile():
                continue
            path = m.name.split("/", 1)[1] if "/" in m.name else m.name
            if any(fnmatch.fnmatchcase(path, g) for g in scope):
                f = tar.extractfile(m)
                if f is not None:
                    out[path] = f.read().decode("utf-8")
    return out
