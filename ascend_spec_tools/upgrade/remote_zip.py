"""Reading only the needed members of a remote wheel, with HTTP range requests."""

from __future__ import annotations

import concurrent.futures as cf
import fnmatch
import io
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import Iterable

from .common import CheckError
from .index import USER_AGENT


try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a project dependency
    tqdm = None


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
