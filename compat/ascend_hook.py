"""Patch a module right after it is imported (or now, if it already is).
A finder at the head of ``sys.meta_path`` runs the patch once the watched module's body has executed.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable

Patch = Callable[[ModuleType], None]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str, hook: "PatchOnImport") -> None:
        self._inner = inner
        self._name = name
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._hook.apply(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._inner, attr)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` once per watched module, after its body ran."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Patch]] = {}
        self._lock = threading.Lock()
        self._busy: set[str] = set()

    def watch(self, name: str, patch: Patch) -> None:
        self.patches.setdefault(name, []).append(patch)
        if name in sys.modules:  # already imported: patch now
            patch(sys.modules[name])

    def apply(self, name: str, module: ModuleType) -> None:
        for patch in self.patches.get(name, ()):
            patch(module)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.patches or fullname in self._busy:
            return None
        with self._lock:
            self._busy.add(fullname)
            try:
                spec = None
                for finder in sys.meta_path:
                    if finder is self or not hasattr(finder, "find_spec"):  # manifest: ignore (importlib)
                        continue
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
            finally:
                self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, fullname, self)
        return spec


_HOOK: PatchOnImport | None = None


def hook() -> PatchOnImport:
    """The process-wide hook, installed at the head of ``sys.meta_path`` on first use."""
    global _HOOK
    if _HOOK is None:
        _HOOK = PatchOnImport()
    if _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    return _HOOK


def uninstall() -> None:
    """Remove the hook and forget its patches (tests)."""
    global _HOOK
    if _HOOK is not None and _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
    _HOOK = None
