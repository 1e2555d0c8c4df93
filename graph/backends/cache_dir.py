"""The compile cache's folder: where it is (``$ASCEND_SPEC_CACHE_DIR``, XDG, ``~/.cache``), that it is the user's
own (0700, refused otherwise: compiled artifacts are code), atomic writes into it and its size on disk.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

ENV_CACHE_DIR = "ASCEND_SPEC_CACHE_DIR"
#: a temporary file's suffix while :func:`atomic_write` writes it
TMP_SUFFIX = ".tmp"


class CacheDirError(ValueError):
    """The cache folder is not private to the current user (or cannot be made so)."""


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


def atomic_write(path: Path, data: bytes) -> None:
    """tmp file (0600, same folder) + fsync + os.replace: readers see the old entry or the new, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=TMP_SUFFIX)
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


def folder_size(folder: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
