"""What a compile cache entry is: its key (:class:`CacheKey`: model, graph code, torch and Python versions, backend
and options, a label) and its file format (magic, format version, the key as JSON, payload length and sha256).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAGIC = b"ASPCACHE"
FORMAT_VERSION = 1
# magic, format version, header length
_PREFIX = struct.Struct("<8sHI")
_MAX_HEADER = 1 << 20
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DIGEST_CHARS = 24
_HEADER_FIELDS = {"key", "payload_len", "payload_sha256"}


class BadEntry(Exception):
    """An entry that must not be loaded; the message is the reason shown to the user."""


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


def key_digest(key_dict: dict[str, Any]) -> str:
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
        return key_digest(self.to_dict())

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


def read_file_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of the entry file at ``path`` and the payload's offset, reading no payload; raises
    :class:`BadEntry` (and OSError)."""
    with path.open("rb") as f:
        prefix = f.read(_PREFIX.size)
        header_len = _PREFIX.unpack(prefix)[2] if len(prefix) == _PREFIX.size else 0
        return _read_header(prefix + f.read(min(header_len, _MAX_HEADER)))
