"""Shared by the upgrade check: its error type, logging and the API manifest (pure Python, no vLLM)."""

from __future__ import annotations

import sys
from pathlib import Path

from ascend_spec.compat import manifest as M  # noqa: F401 - pure Python: never imports vLLM or torch

__all__ = ["M", "REPO", "CheckError", "VersionNotFound", "log"]

REPO = Path(__file__).resolve().parents[2]  # the checkout (or site-packages when installed)


class CheckError(Exception):
    """The check could not be carried out (exit 2)."""


class VersionNotFound(CheckError):
    pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
