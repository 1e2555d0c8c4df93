"""Compiled graphs kept across runs and checkouts: an on-disk cache of torch's compile artifacts.

Where
    ``$ASCEND_SPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ascend-spec``, else ``~/.cache/ascend-spec``.
    Compiled artifacts are code (pickles, generated Python, shared objects), so the folder must be the
    user's own: it is created with mode 0700, and an existing one that another user owns or that is
    group/world-writable is refused (:class:`CacheDirError`, naming the folder and the fix). The engine
    opens the cache through :func:`open_default_cache`, which turns that refusal into one warning and
    runs without the cache, like vLLM, which never fails a start over its compile cache; ``ascend-spec
    cache info|clear`` reports the error instead. ``ASCEND_SPEC_DISABLE_COMPILE_CACHE=1`` turns it off.

What
    One file per :class:`CacheKey` (model config, graph code digest, torch and Python versions, backend
    and its options, and a label for the warm-up), ``<digest>.bin``: a header (magic, format version,
    the key as JSON, sha256 and length of the payload) and the payload, the bytes of
    ``torch.compiler.save_cache_artifacts()``: the FX-graph (inductor), AOTAutograd, autotune and PGO
    cache entries this process produced or used. Those are process-wide, so a key names a warm-up, not
    one graph: load before the warm-up compiles anything, save once it is done
    (:meth:`CompileCache.around_warmup`). A corrupt, truncated, foreign (another key's or another
    torch's) or unloadable entry gives one warning, is deleted and reads as a miss: the caller compiles.

Inductor's working cache (``TORCHINDUCTOR_CACHE_DIR``)
    Loading artifacts writes them into inductor's on-disk cache, and every compile reads from it. Its
    default, ``/tmp/torchinductor_<user>``, lives in a world-writable folder that anyone can pre-create
    and it is wiped on reboot; it also holds what the payload lacks on CPU, the compiled C++ kernels
    (``.so``), which would otherwise be rebuilt on every fresh start. :meth:`CompileCache.use_for_inductor`
    therefore points it at ``<cache root>/inductor`` (0700) when the user has not set it; a value set by
    the user, or by a host such as vLLM, which keeps its own compile cache, is left as it is. Torch writes
    its default back into the environment on first use, so this takes effect only before the first
    compile of the process (the engine opens the cache at load). Entries there are keyed by torch itself
    (graph, inputs, versions, config), so stale ones miss rather than load.

Dynamo's tracing
    The payload above holds no Dynamo trace: a start from it traces every graph again. Where graphs can be saved
    whole (CPU inductor) the engine uses :mod:`.aot_graphs` instead, with entries in this folder and this file
    format, one per graph. ``TORCH_CACHING_PRECOMPILE=1`` (Dynamo entries in this payload) crashes the second
    start in torch 2.13 on this code (un-pickling a guard on an imported module) and is not used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

ENV_CACHE_DIR = "ASCEND_SPEC_CACHE_DIR"
ENV_DISABLE = "ASCEND_SPEC_DISABLE_COMPILE_CACHE"
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_SUBDIR = "inductor"

MAGIC = b"ASPCACHE"
FORMAT_VERSION = 1
# magic, format version, header length
_PREFIX = struct.Struct("<8sHI")
_MAX_HEADER = 1 << 20
ENTRY_SUFFIX = ".bin"
_TMP_SUFFIX = ".tmp"
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DIGEST_CHARS = 24
_HEADER_FIELDS = {"key", "payload_len", "payload_sha256"}


class CacheDirError(ValueError):
    """The cache folder is not private to the current user (or cannot be made so)."""


class BadEntry(Exception):
    """An entry that must not be loaded; the message is the reason shown to the user."""


# --------------------------------------------------------------------------- the folder


def cache_root() -> Path:
    """``$ASCEND_SPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ascend-spec``, else ``~/.cache/ascend-spec``.

    Created with mode 0700 when missing; raises :class:`CacheDirError` if it is not private.
    """
    if os.environ.get(ENV_CACHE_DIR):
        root = Path(os.environ[ENV_CACHE_DIR])
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]) / "ascend-spec"
    else:
        root = Path.home() / ".cache" / "ascend-spec"
    return ensure_private_dir(root.expanduser())


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` with mode 0700, or check that an existing one is owned by us and not writable by others."""
    path = path.absolute()
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700)
            path.chmod(0o700)  # mkdir's mode is filtered by the umask; state it exactly
        except FileExistsError:
            pass  # another process created it meanwhile: check it below like any existing folder
        except OSError as exc:
            raise CacheDirError(f"compile cache folder {path}: cannot create it ({exc}); set {ENV_CACHE_DIR} "
                                "to a folder of your own") from None
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    try:
        st = path.stat()
    except OSError as exc:
        raise CacheDirError(f"compile cache folder {path}: {exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"compile cache folder {path} is not a folder; set {ENV_CACHE_DIR} to a folder of your own")
    if not hasattr(os, "geteuid"):
        return  # no POSIX ownership to check (Windows)
    problems = []
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problems.append(f"mode {stat.S_IMODE(st.st_mode):04o} lets others write to it")
    if problems:
        raise CacheDirError(f"compile cache folder {path}: {'; '.join(problems)}. Compiled graphs are code and "
                            f"are never loaded from a folder others can write: run `chmod 700 {path}` if it is "
                            f"yours, or set {ENV_CACHE_DIR} to a folder of your own (allowed: owned by you, "
                            "not group/world-writable)")


# --------------------------------------------------------------------------- the key


def digest_sources(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py"), key=lambda p: p.relative_to(folder).as_posix()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:DIGEST_CHARS]


@functools.cache
def graph_code_digest() -> str:
    """sha256 over the sources of the ``ascend_spec.graph`` package: any change to a graph invalidates entries."""
    return digest_sources(Path(__file__).resolve().parent.parent)


def _torch_version() -> str:
    import torch

    return torch.__version__


def _python_version() -> str:
    return "{}.{}.{}".format(*sys.version_info[:3])


def _canonical(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"CacheKey.{what}={value!r} is not JSON-able ({exc}); allowed: dicts, lists, str, int, "
                         "finite float, bool, None") from None


def _key_digest(key_dict: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(key_dict, "key").encode()).hexdigest()[:DIGEST_CHARS]


@dataclass(frozen=True, eq=False)
class CacheKey:
    """What a cached warm-up depends on. Keys compare by their canonical JSON; the digest names the file."""

    what: str  # a short label, e.g. "spec_k2_greedy"
    model_config: dict[str, Any]
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    graph_code: str = field(default_factory=graph_code_digest)
    torch_version: str = field(default_factory=_torch_version)
    # The payload holds pickles and bytecode: tie it to the interpreter too.
    python_version: str = field(default_factory=_python_version)

    def __post_init__(self) -> None:
        if not isinstance(self.what, str) or not _LABEL.match(self.what):
            raise ValueError(f"CacheKey.what={self.what!r}; allowed: 1-64 characters of [A-Za-z0-9_.-], "
                             "starting with a letter or digit")
        for name in ("model_config", "backend_options"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"CacheKey.{name}={getattr(self, name)!r}; allowed: a JSON-able dict")
            _canonical(getattr(self, name), name)

    def to_dict(self) -> dict[str, Any]:
        """The key as plain JSON data (tuples become lists), as stored in an entry's header."""
        return json.loads(self.canonical_json())

    def canonical_json(self) -> str:
        return _canonical(dataclasses.asdict(self), "key")

    @property
    def digest(self) -> str:
        return _key_digest(self.to_dict())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CacheKey) and self.canonical_json() == other.canonical_json()

    def __hash__(self) -> int:  # the dict fields are not hashable
        return hash(self.canonical_json())


# --------------------------------------------------------------------------- the entry file format


def encode_entry(key: CacheKey, payload: bytes, variants: int | None = None) -> bytes:
    """``variants``: how many compiled variants a saved graph holds (``aot_graphs``), shown by ``cache info``."""
    fields = {"key": key.to_dict(), "payload_sha256": hashlib.sha256(payload).hexdigest(), "payload_len": len(payload)}
    if variants is not None:
        fields["variants"] = variants
    header = json.dumps(fields, sort_keys=True).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def _read_header(blob: bytes) -> tuple[dict[str, Any], int]:
    """The header and the payload's offset; raises :class:`BadEntry`."""
    if len(blob) < _PREFIX.size:
        raise BadEntry(f"truncated: {len(blob)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise BadEntry("not an ascend-spec compile cache entry (bad magic bytes)")
    if version != FORMAT_VERSION:
        raise BadEntry(f"format version {version}, this build reads version {FORMAT_VERSION}")
    end = _PREFIX.size + header_len
    if header_len > _MAX_HEADER or end > len(blob):
        raise BadEntry(f"truncated: header of {header_len} bytes, file has {len(blob) - _PREFIX.size} after the prefix")
    try:
        header = json.loads(blob[_PREFIX.size:end])
    except ValueError as exc:
        raise BadEntry(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or not _HEADER_FIELDS <= header.keys() or not isinstance(header["key"], dict):
        raise BadEntry(f"unreadable header (allowed: an object with {sorted(_HEADER_FIELDS)})")
    return header, end


def decode_entry(blob: bytes, key: CacheKey) -> bytes:
    """The payload of an entry for ``key``, after checking everything; raises :class:`BadEntry`."""
    header, start = _read_header(blob)
    payload = blob[start:]
    if len(payload) != header["payload_len"]:
        raise BadEntry(f"truncated: payload of {len(payload)} bytes, header says {header['payload_len']}")
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise BadEntry("corrupt: payload sha256 does not match the header")
    stored, wanted = header["key"], key.to_dict()
    if stored != wanted:
        differ = sorted(k for k in stored.keys() | wanted.keys() if stored.get(k) != wanted.get(k))
        raise BadEntry(f"foreign entry: written for another key (differs in {', '.join(differ)}), not {key.what!r} "
                       f"{key.digest}")
    return payload


# --------------------------------------------------------------------------- the cache


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

    def entries(self) -> list[EntryInfo]:
        out = []
        for path in sorted(self.root.glob(f"*{ENTRY_SUFFIX}")):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                out.append(_entry_info(path))
        return out

    def clear(self) -> int:
        """Remove every entry, leftover temporary file and ``<root>/inductor``; returns the bytes freed."""
        freed = 0
        for path in [*self.root.glob(f"*{ENTRY_SUFFIX}"), *self.root.glob(f".*{_TMP_SUFFIX}")]:
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

    def discard(self, path: Path, reason: str) -> bool:
        log.warning("compile cache: ignoring and removing %s: %s; compiling instead", path, reason)
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


def atomic_write(path: Path, data: bytes) -> None:
    """tmp file (0600, same folder) + fsync + os.replace: readers see the old entry or the new, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=_TMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _entry_info(path: Path) -> EntryInfo:
    st = path.stat()
    what = torch_version = problem = variants = None
    try:
        with path.open("rb") as f:
            prefix = f.read(_PREFIX.size)
            header_len = _PREFIX.unpack(prefix)[2] if len(prefix) == _PREFIX.size else 0
            header, start = _read_header(prefix + f.read(min(header_len, _MAX_HEADER)))
        what, torch_version = header["key"].get("what"), header["key"].get("torch_version")
        variants = header.get("variants")
        stored_digest = _key_digest(header["key"])
        if st.st_size - start != header["payload_len"]:
            problem = f"truncated: payload of {st.st_size - start} bytes, header says {header['payload_len']}"
        elif stored_digest != path.stem:
            problem = f"foreign entry: written for key {stored_digest}"
    except BadEntry as exc:
        problem = str(exc)
    return EntryInfo(path=path, digest=path.stem, size=st.st_size, mtime=st.st_mtime, what=what,
                     torch_version=torch_version, problem=problem, variants=variants)


def folder_size(folder: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
