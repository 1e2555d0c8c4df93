"""The vLLM API manifest: every vLLM name ``compat/`` relies on, and the shims that absorb its drift.
Pure Python (stdlib + PyYAML): it never imports vLLM or torch. Code marks each shim with :func:`covers`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

import yaml

DEFAULT_PATH = Path(__file__).with_name("api_manifest.yaml")
#: the vllm-ascend API the Ascend route relies on (same schema; ``root: vllm_ascend``)
ASCEND_PATH = Path(__file__).with_name("api_manifest_ascend.yaml")

#: item kind -> locator keys it requires
KINDS: dict[str, tuple[str, ...]] = {
    "module": ("module",),
    "class": ("module", "name"),
    "function": ("module", "name"),
    "method-params": ("module", "class", "method"),
    "attribute-kind": ("module", "class", "attr"),
    "dataclass-fields": ("module", "class"),
    "config-field": ("module", "class", "field"),
    "entry-point-group": ("module", "group"),
    "module-global": ("module", "name"),
    "call-site": ("function", "modules"),
    "call-args": ("module", "name", "callee"),
    "isinstance-check": ("module", "class", "method", "subject", "accepts"),
}

#: verdict strings (the tool prints these)
UNCHANGED = "unchanged"
COMPATIBLE = "drifted — compatible"
BROKEN = "BROKEN"


def covered_by(shim_id: str) -> str:
    return f"drifted — covered by shim {shim_id}"


class ManifestError(ValueError):
    """The manifest file is malformed."""


@dataclasses.dataclass(frozen=True)
class Shim:
    id: str
    absorbs: str
    detect: str
    before: str
    after: str
    accepts: tuple[Mapping[str, Any], ...]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Item:
    id: str
    kind: str
    locator: Mapping[str, Any]
    expect: Mapping[str, Any]
    shims: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    positional: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    compare: tuple[str, ...] = ()
    note: str = ""

    @property
    def module(self) -> str | None:
        return self.locator.get("module")

    @property
    def owner(self) -> str | None:
        """The class whose attribute/field/method this item is, if any."""
        return self.locator.get("class")

    def qualified_names(self) -> set[str]:
        """Dotted names (``vllm.a.b.Name``) this item makes importable/accessible."""
        loc = self.locator
        names: set[str] = set(self.aliases)
        mod = loc.get("module")
        if self.kind == "module":
            names.add(mod)
        elif self.kind == "call-site":
            names.add(loc["function"])
        elif "name" in loc:
            names.add(f"{mod}.{loc['name']}")
        elif "class" in loc:
            names.add(f"{mod}.{loc['class']}")
            for key in ("attr", "field", "method"):
                if key in loc:
                    names.add(f"{mod}.{loc['class']}.{loc[key]}")
        return names

    def member_names(self) -> set[str]:
        """Bare names (attributes, fields, methods, parameters) this item covers."""
        loc = self.locator
        out = {loc[k] for k in ("name", "attr", "field", "method", "class") if k in loc}
        out.update(self.needs)
        out.update(loc.get("fields", ()))
        if self.kind == "call-site":
            out.add(loc["function"].rsplit(".", 1)[-1])
        return out


@dataclasses.dataclass(frozen=True)
class Manifest:
    path: Path
    scope: tuple[str, ...]
    shims: Mapping[str, Shim]
    items: tuple[Item, ...]
    owners: Mapping[str, str]  # variable name -> vLLM class it usually holds (for the coverage test)
    root: str = "vllm"  # the top-level package whose sources are read (vllm_ascend for the Ascend manifest)
    package: str = "vllm"  # the distribution, for reports

    def item(self, item_id: str) -> Item:
        for it in self.items:
            if it.id == item_id:
                return it
        raise KeyError(item_id)

    def items_for_shim(self, shim_id: str) -> list[Item]:
        return [it for it in self.items if shim_id in it.shims]

    def qualified_names(self) -> set[str]:
        out: set[str] = set()
        for it in self.items:
            out |= it.qualified_names()
        return out

    def modules(self) -> set[str]:
        """Every vLLM module path named anywhere in the manifest (and their parent packages)."""
        mods: set[str] = set()
        for it in self.items:
            for m in [it.locator.get("module"), *it.locator.get("modules", ())]:
                if m:
                    parts = m.split(".")
                    mods.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        return mods

    def members_of(self, cls: str) -> set[str]:
        """Names covered on instances of vLLM class ``cls`` (attributes, fields, methods)."""
        out: set[str] = set()
        for it in self.items:
            if it.owner == cls:
                out |= {it.locator[k] for k in ("attr", "field", "method") if k in it.locator}
            if it.kind == "dataclass-fields" and it.locator["class"] == cls:
                out.update(it.needs)
        return out

    def all_member_names(self) -> set[str]:
        out: set[str] = set()
        for it in self.items:
            out |= it.member_names()
        return out

    def string_constants(self) -> set[str]:
        """Dotted string literals the manifest covers (modules, entry-point groups, qualified names)."""
        out = self.modules() | self.qualified_names()
        out |= {it.locator["group"] for it in self.items if it.kind == "entry-point-group"}
        return out


def _tuple(v: Any, where: str, key: str) -> tuple:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, (list, tuple)):
        raise ManifestError(f"{where}: `{key}` must be a list")
    return tuple(v)


def load(path: str | Path | None = None) -> Manifest:
    """Load and validate the manifest; raises :class:`ManifestError` with every problem found."""
    p = Path(path) if path else DEFAULT_PATH
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ManifestError(f"cannot read manifest {p}: {e}") from e
    if not isinstance(raw, dict):
        raise ManifestError(f"{p}: top level must be a mapping")
    errors: list[str] = []
    root = str(raw.get("root", "vllm"))
    package = str(raw.get("package", "vllm"))

    scope = _tuple(raw.get("scope"), "manifest", "scope")
    if not scope:
        errors.append("`scope` lists no files")

    shims: dict[str, Shim] = {}
    for sid, s in (raw.get("shims") or {}).items():
        where = f"shim {sid}"
        if not isinstance(s, dict):
            errors.append(f"{where}: must be a mapping")
            continue
        missing = [k for k in ("absorbs", "detect", "before", "after", "accepts") if k not in s]
        if missing:
            errors.append(f"{where}: missing {', '.join(missing)}")
            continue
        accepts = _tuple(s["accepts"], where, "accepts")
        if not all(isinstance(a, dict) for a in accepts):
            errors.append(f"{where}: `accepts` must be a list of fingerprint patterns (mappings)")
        shims[sid] = Shim(sid, str(s["absorbs"]), str(s["detect"]), str(s["before"]), str(s["after"]),
                          accepts, str(s.get("note", "")))

    items: list[Item] = []
    seen: set[str] = set()
    for i, it in enumerate(raw.get("items") or []):
        where = f"item #{i} ({it.get('id', '?') if isinstance(it, dict) else '?'})"
        if not isinstance(it, dict):
            errors.append(f"{where}: must be a mapping")
            continue
        iid, kind, loc = it.get("id"), it.get("kind"), it.get("locator")
        if not iid or not isinstance(iid, str):
            errors.append(f"{where}: missing `id`")
            continue
        if iid in seen:
            errors.append(f"{where}: duplicate id")
        seen.add(iid)
        if kind not in KINDS:
            errors.append(f"{where}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
            continue
        if not isinstance(loc, dict):
            errors.append(f"{where}: missing `locator` mapping")
            continue
        lacking = [k for k in KINDS[kind] if k not in loc]
        if lacking:
            errors.append(f"{where}: locator of a {kind} needs {', '.join(lacking)}")
        mod = loc.get("module")
        if mod is not None and not (isinstance(mod, str) and (mod == root or mod.startswith(root + "."))):
            errors.append(f"{where}: locator.module must be a {root} module path")
        item_shims = _tuple(it.get("shims"), where, "shims")
        for sid in item_shims:
            if sid not in shims:
                errors.append(f"{where}: unknown shim id {sid!r}")
        expect = it.get("expect") or {"found": True}
        if not isinstance(expect, dict):
            errors.append(f"{where}: `expect` must be a fingerprint pattern (mapping)")
            expect = {"found": True}
        items.append(Item(
            id=iid, kind=kind, locator=loc, expect=expect, shims=item_shims,
            needs=_tuple(it.get("needs"), where, "needs"),
            positional=_tuple(it.get("positional"), where, "positional"),
            aliases=_tuple(it.get("aliases"), where, "aliases"),
            compare=_tuple(it.get("compare"), where, "compare"),
            note=str(it.get("note", "")),
        ))
    unused = sorted(set(shims) - {s for it in items for s in it.shims})
    if unused:
        errors.append(f"shims covering no item: {', '.join(unused)}")
    owners = raw.get("owners") or {}
    if not isinstance(owners, dict):
        errors.append("`owners` must map variable names to vLLM class names")
        owners = {}
    if errors:
        raise ManifestError(f"{p}: " + "; ".join(errors))
    return Manifest(p, scope, shims, tuple(items), dict(owners), root, package)


# ---------------------------------------------------------------------------------------------
# Fingerprints and verdicts.
#
# The checker reduces each item, in each release, to a *fingerprint*: a flat dict such as
# ``{"found": True, "kind": "tensor", "device": "device"}``. Keys starting with "_" are derived
# facts (e.g. ``_needs_met``) used only for matching, never for "did it change" comparisons.
# A *pattern* is a dict; a fingerprint matches when every key matches: a list in the pattern means
# "any of", a scalar means equality; a key absent from the fingerprint is None.


def match(fp: Mapping[str, Any] | None, pattern: Mapping[str, Any]) -> bool:
    fp = fp or {"found": False}
    for key, want in pattern.items():
        have = fp.get(key)
        if isinstance(want, list):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


def comparable(fp: Mapping[str, Any] | None, keys: Iterable[str] = ()) -> dict[str, Any]:
    fp = fp or {"found": False}
    keys = tuple(keys)
    return {k: v for k, v in fp.items() if not k.startswith("_") and (not keys or k in keys)}


@dataclasses.dataclass(frozen=True)
class Verdict:
    text: str
    shim: str | None
    broken: bool
    changed: bool


def verdict(manifest: Manifest, item: Item, before: Mapping[str, Any] | None,
            after: Mapping[str, Any] | None) -> Verdict:
    """Judge one item between two releases.

    BROKEN when the new shape meets neither ``expect`` nor a listed shim's ``accepts``; otherwise
    ``unchanged`` when the comparable fingerprint is equal; otherwise covered by the shim that
    bridges the two shapes (one accepting both; else the one accepting whichever side is not the
    expected shape); otherwise compatible (the drift touches nothing we rely on).
    """
    before = before or {"found": False}
    after = after or {"found": False}
    changed = comparable(before, item.compare) != comparable(after, item.compare)

    def accepts(sid: str, fp: Mapping[str, Any]) -> bool:
        return any(match(fp, p) for p in manifest.shims[sid].accepts)

    acc_after = [s for s in item.shims if accepts(s, after)]
    acc_before = [s for s in item.shims if accepts(s, before)]
    if not match(after, item.expect) and not acc_after:
        return Verdict(BROKEN, None, True, changed)
    if not changed:
        return Verdict(UNCHANGED, None, False, False)
    both = [s for s in acc_after if s in acc_before]
    if both:
        pick = both
    elif not match(after, item.expect):
        pick = acc_after
    else:
        pick = acc_before or acc_after
    if pick:
        return Verdict(covered_by(pick[0]), pick[0], False, True)
    return Verdict(COMPATIBLE, None, False, True)


# ---------------------------------------------------------------------------------------------
# Marking shims in compat/ code.

_F = TypeVar("_F", bound=Callable[..., Any])
REGISTRY: dict[str, list[str]] = {}


def covers(*shim_ids: str) -> Callable[[_F], _F]:
    """Decorator marking a compat function/class as the implementation of manifest shim ids.

    ``@covers("cpu_gpu_buffer")`` points the decorated code at every manifest item whose ``shims``
    list names ``cpu_gpu_buffer``; ``tests/test_manifest_coverage.py`` checks the ids exist.
    """

    def deco(obj: _F) -> _F:
        qual = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
        for sid in shim_ids:
            REGISTRY.setdefault(sid, []).append(qual)
        try:
            obj.__manifest_shims__ = tuple(shim_ids)  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            pass
        return obj

    return deco


def shim_items(shim_id: str, manifest: Manifest | None = None) -> list[str]:
    """Ids of the manifest items a shim covers."""
    m = manifest or load()
    if shim_id not in m.shims:
        raise KeyError(f"unknown shim id {shim_id!r}")
    return [it.id for it in m.items_for_shim(shim_id)]
