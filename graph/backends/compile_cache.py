"""Compiled graphs kept across runs and checkouts: an on-disk cache of torch's compile artifacts.
One file per :class:`CacheKey` in a folder the user owns; the engine opens it through :func:`open_default_cache`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .cache_dir import (ENV_CACHE_DIR, TMP_SUFFIX, CacheDirError, atomic_write, cache_root, check_private_dir,
                        ensure_private_dir, folder_size)
from .cache_entry import (DIGEST_CHARS, FORMAT_VERSION, MAGIC, BadEntry, CacheKey, decode_entry, digest_sources,
                          encode_entry, graph_code_digest, key_digest, read_file_header)

__all__ = ["BadEntry", "CacheDirError", "CacheKey", "CompileCache", "DIGEST_CHARS", "ENTRY_SUFFIX", "ENV_CACHE_DIR",
           "ENV_DISABLE", "EntryInfo", "FORMAT_VERSION", "MAGIC", "atomic_write", "cache_root", "check_private_dir",
           "decode_entry", "digest_sources", "encode_entry", "ensure_private_dir", "folder_size",
           "graph_code_digest", "open_default_cache"]

log = logging.getLogger(__name__)

ENV_DISABLE = "ASCEND_SPEC_DISABLE_COMPILE_CACHE"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_SUBDIR = "inductor"
ENTRY_SUFFIX = ".bin"
LOCK_SUFFIX = ".lock"


@dataclass(frozen=True)
class EntryInfo:
    path: Path
    digest: str
    size: int  # bytes
    mtime: float
    what: str | None  # the key's label; None when the header is unreadable
    torch_version: str | None
    problem: str | None  # why it would not load, when the header already tells
    variants: int | None = None  # a saved graph's compiled variants (aot_graphs); None for torch's artifacts

    @property
    def age_seconds(self) -> float:
        return max(0.0, time.time() - self.mtime)


class CompileCache:
    """One folder of entries, one per :class:`CacheKey`. Never raises on a bad entry: it warns and misses."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = cache_root() if root is None else ensure_private_dir(Path(root))

    def path_for(self, key: CacheKey) -> Path:
        return self.root / f"{key.digest}{ENTRY_SUFFIX}"

    @property
    def inductor_dir(self) -> Path:
        return self.root / INDUCTOR_SUBDIR

    def use_for_inductor(self) -> Path | None:
        """Point ``TORCHINDUCTOR_CACHE_DIR`` at ``<root>/inductor`` unless it is already set; returns it if so."""
        if os.environ.get(INDUCTOR_ENV):
            return None
        os.environ[INDUCTOR_ENV] = str(ensure_private_dir(self.inductor_dir))
        return self.inductor_dir

    def read_payload(self, key: CacheKey) -> bytes | None:
        """The checked payload of ``key``'s entry; None on a miss (a bad entry warns once and is removed)."""
        path = self.path_for(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            log.info("compile cache: no entry for %s (%s)", key.what, key.digest)
            return None
        except OSError as exc:
            self.discard(path, f"unreadable ({exc})")
            return None
        try:
            return decode_entry(blob, key)
        except BadEntry as exc:
            self.discard(path, str(exc))
            return None

    def load(self, key: CacheKey) -> bool:
        """Hot-load the artifacts saved for ``key`` into torch's caches; False (the caller compiles) on a miss."""
        payload = self.read_payload(key)
        if payload is None:
            return False
        path = self.path_for(key)
        try:
            info = _load_artifacts(payload)
        except Exception as exc:  # noqa: BLE001 - whatever torch raises, the answer is "recompile"
            return self.discard(path, f"torch could not load its artifacts ({exc.__class__.__name__}: {exc})")
        if info is None:
            return self.discard(path, "torch could not load its artifacts (un-pickling failed)")
        log.info("compile cache: loaded %s (%s, %d bytes)", key.what, path, len(payload))
        return True

    def save(self, key: CacheKey) -> Path | None:
        """Write what torch compiled in this process under ``key``; None when there is nothing to save."""
        import torch

        result = torch.compiler.save_cache_artifacts()
        payload = result[0] if result else b""
        if not payload:
            log.info("compile cache: nothing compiled to save for %s", key.what)
            return None
        path = self.path_for(key)
        if self._holds(path, key, payload):
            return path  # a warm run that compiled nothing new: keep the file as it is
        atomic_write(path, encode_entry(key, payload))
        log.info("compile cache: saved %s (%s, %d bytes)", key.what, path, len(payload))
        return path

    @contextlib.contextmanager
    def around_warmup(self, key: CacheKey) -> Iterator[bool]:
        """``with cache.around_warmup(key) as hit: warm_up()`` — load before, save after a warm-up that succeeded."""
        hit = self.load(key)
        yield hit
        self.save(key)

    @contextlib.contextmanager
    def compiling(self, key: CacheKey) -> Iterator[None]:
        """Held while one process compiles ``key``: another process of this host that needs the same entry (a
        data-parallel rank, a second engine) waits, then reads what the first saved instead of compiling it too.
        An advisory lock on a file beside the entry; the kernel releases it if the holder dies."""
        try:
            import fcntl
        except ImportError:  # no POSIX locks (Windows): each process compiles its own
            yield
            return
        lock = self.root / f".{key.digest}{LOCK_SUFFIX}"
        with open(lock, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def entries(self) -> list[EntryInfo]:
        out = []
        for path in sorted(self.root.glob(f"*{ENTRY_SUFFIX}")):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                out.append(_entry_info(path))
        return out

    def clear(self) -> int:
        """Remove every entry, leftover temporary file and ``<root>/inductor``; returns the bytes freed."""
        freed = 0
        for path in [*self.root.glob(f"*{ENTRY_SUFFIX}"), *self.root.glob(f".*{TMP_SUFFIX}"),
                     *self.root.glob(f".*{LOCK_SUFFIX}")]:
            with contextlib.suppress(FileNotFoundError):
                size = path.stat().st_size
                path.unlink()
                freed += size
        if self.inductor_dir.is_dir():
            freed += folder_size(self.inductor_dir)
            shutil.rmtree(self.inductor_dir, ignore_errors=True)
        return freed

    def _holds(self, path: Path, key: CacheKey, payload: bytes) -> bool:
        try:
            return decode_entry(path.read_bytes(), key) == payload
        except (OSError, BadEntry):
            return False

    def discard(self, path: Path, reason: str, instead: str = "compiling instead") -> bool:
        """Warn once about a bad entry (``instead``: what the run does without it) and remove it; False."""
        log.warning("compile cache: ignoring and removing %s: %s; %s", path, reason, instead)
        with contextlib.suppress(OSError):
            path.unlink()
        return False


def open_default_cache(inductor: bool = True) -> CompileCache | None:
    """The engine's entry point: the cache at :func:`cache_root`, inductor's working cache pointed into it (unless
    ``inductor`` is False: a host engine that points it elsewhere).

    None (compile without caching) when ``ASCEND_SPEC_DISABLE_COMPILE_CACHE=1`` or, with one warning, when
    the folder is not private.
    """
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return None
    try:
        cache = CompileCache()
    except CacheDirError as exc:
        log.warning("%s; compiling without the cache", exc)
        return None
    if inductor:
        cache.use_for_inductor()
    return cache


# --------------------------------------------------------------------------- helpers


def _load_artifacts(payload: bytes) -> object:
    import torch

    # Torch logs its own warning when un-pickling fails; ours (with the path) is the one the user sees.
    with _quiet("torch.compiler._cache"):
        return torch.compiler.load_cache_artifacts(payload)


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous


def _entry_info(path: Path) -> EntryInfo:
    st = path.stat()
    what = torch_version = problem = variants = None
    try:
        header, start = read_file_header(path)
        what, torch_version = header["key"].get("what"), header["key"].get("torch_version")
        variants = header.get("variants")
        stored_digest = key_digest(header["key"])
        if st.st_size - start != header["payload_len"]:
            problem = f"truncated: payload of {st.st_size - start} bytes, header says {header['payload_len']}"
        elif stored_digest != path.stem:
            problem = f"foreign entry: written for key {stored_digest}"
    except BadEntry as exc:
        problem = str(exc)
    return EntryInfo(path=path, digest=path.stem, size=st.st_size, mtime=st.st_mtime, what=what,
                     torch_version=torch_version, problem=problem, variants=variants)
