"""Which of Dynamo's guards a compiled step keeps: those on what changes between calls, not on what never does.
A graph key already fixes the model, K and the sampling mode, so guards on them only cost time.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

#: guards kept whatever they guard: process-wide state a compiled graph was traced under
GLOBAL_STATE_GUARDS = frozenset({"SHAPE_ENV", "GRAD_MODE", "GLOBAL_STATE", "DEFAULT_DEVICE",
                                 "DETERMINISTIC_ALGORITHMS", "TORCH_FUNCTION_STATE",
                                 "AUTOGRAD_SAVED_TENSORS_HOOKS"})
#: guards kept on the call's own arguments (not on globals or closure contents reached from them)
INPUT_GUARDS = frozenset({"TENSOR_MATCH", "SEQUENCE_LENGTH", "NO_TENSOR_ALIASING", "DUPLICATE_INPUT"})
#: an argument or an item of one (``live``, ``caches[0]``); not a closure cell, an attribute chain, a global or an
#: import (``phases.verify.__closure__[2]…``, ``G['torch']``, ``__import__('torch')…``)
_ARGUMENT = re.compile(r"[A-Za-z_]\w*(\[\d+\])*")


def _is_argument(name: str) -> bool:
    return _ARGUMENT.fullmatch(name) is not None and not name.startswith("__")


def keep_input_guards(entries: Sequence[Any]) -> list[bool]:
    """Dynamo ``guard_filter_fn``: True for each guard to keep (see the module docstring)."""
    keep = []
    for e in entries:
        if e.guard_type in GLOBAL_STATE_GUARDS:
            keep.append(True)
        elif e.guard_type in INPUT_GUARDS and not e.is_global and _is_argument(e.name):
            keep.append(not (e.has_value and isinstance(e.value, torch.nn.Parameter)))
        else:
            keep.append(False)
    return keep
