"""Every vLLM name that compat/ touches must be in compat/api_manifest.yaml.

The scan is static (AST; nothing is imported). It collects, from every ``.py`` under ``compat/``:

* imports of vLLM: ``import vllm.a.b [as x]`` (module ``vllm.a.b``) and ``from vllm.a.b import N``
  (``vllm.a.b.N``), and attribute chains on those names (``x.Name``, ``N.method``);
* string literals naming vLLM dotted paths (``"vllm.general_plugins"``, ``"vllm.v1.worker..."``);
* attributes read or written on variables/attributes named after vLLM objects (the manifest's
  ``owners`` section: ``runner``, ``input_batch``, ``spec_config``, ``common_attn_metadata``, ...),
  e.g. ``runner.positions``, ``self.runner.input_batch``;
* attribute names given as string literals to ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr``
  (on anything but ``self`` / ``cls``);
* shim ids given to ``covers(...)``.

A touched name passes when the manifest has an item for it. A line ending in ``# manifest: ignore``
is skipped (for names that only look like vLLM's). On failure the message lists each miss with a
YAML stub to paste into the manifest.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMPAT = REPO / "compat"


def _load_manifest_module():
    spec = importlib.util.spec_from_file_location("_coverage_api_manifest", COMPAT / "manifest.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


M = _load_manifest_module()
VLLM_DOTTED = re.compile(r"^vllm(_ascend)?(\.[A-Za-z_][A-Za-z0-9_]*)+$")
ATTR_FUNCS = {"getattr", "hasattr", "setattr", "delattr"}


@dataclasses.dataclass(frozen=True)
class Touch:
    file: str
    line: int
    name: str  # dotted vLLM name, or "<Owner>.<attr>", or a bare attribute name
    how: str  # import | attribute | string | getattr | owner-attribute | covers

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.name} ({self.how})"


def _chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None unless a pure Name/Attribute chain."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return node.id, attrs[::-1]
    return None


class Scanner(ast.NodeVisitor):
    def __init__(self, rel: str, source: str, owners: dict[str, str]) -> None:
        self.rel = rel
        self.owners = owners
        self.ignored = {i + 1 for i, ln in enumerate(source.splitlines()) if "# manifest: ignore" in ln}
        self.aliases: dict[str, str] = {}  # local name -> dotted vLLM name
        self.touches: list[Touch] = []
        self._chains_seen: set[int] = set()

    def add(self, node: ast.AST, name: str, how: str) -> None:
        if getattr(node, "lineno", 0) not in self.ignored:
            self.touches.append(Touch(self.rel, getattr(node, "lineno", 0), name, how))

    # imports ------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if a.name == "vllm" or a.name.startswith("vllm."):
                self.add(node, a.name, "import")
                if a.asname:
                    self.aliases[a.asname] = a.name
                else:
                    self.aliases["vllm"] = "vllm"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level == 0 and (mod == "vllm" or mod.startswith("vllm.")):
            for a in node.names:
                if a.name == "*":
                    self.add(node, f"{mod}.*", "import")
                    continue
                self.add(node, f"{mod}.{a.name}", "import")
                self.aliases[a.asname or a.name] = f"{mod}.{a.name}"

    # attribute chains -----------------------------------------------------------------
    def visit_Attribute(self, node: ast.Attribute) -> None:
        ch = _chain(node)
        if ch is not None and id(node) not in self._chains_seen:
            root, attrs = ch
            # mark inner attributes of the chain as seen: only the longest chain is judged
            inner = node.value
            while isinstance(inner, ast.Attribute):
                self._chains_seen.add(id(inner))
                inner = inner.value
            if root in self.aliases:
                self.add(node, ".".join([self.aliases[root], *attrs]), "attribute")
        # owner accesses: <owner>.<attr>, where <owner> is a Name or the last attribute of a chain
        owner = node.value.id if isinstance(node.value, ast.Name) else \
            node.value.attr if isinstance(node.value, ast.Attribute) else None
        if owner in self.owners and not node.attr.startswith("__"):
            self.add(node, f"{self.owners[owner]}.{node.attr}", "owner-attribute")
        self.generic_visit(node)

    # getattr / hasattr / covers ----------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        if name in ATTR_FUNCS and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            target = node.args[0]
            tname = target.id if isinstance(target, ast.Name) else \
                target.attr if isinstance(target, ast.Attribute) else None
            attr = node.args[1].value
            if tname not in ("self", "cls") and not attr.startswith("__"):
                if tname in self.owners:
                    self.add(node, f"{self.owners[tname]}.{attr}", "getattr")
                else:
                    ch = _chain(target)
                    if ch is not None and ch[0] in self.aliases:
                        self.add(node, ".".join([self.aliases[ch[0]], *ch[1], attr]), "getattr")
                    else:
                        self.add(node, attr, "getattr")
        if name == "covers":
            for a in node.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str):
                    self.add(node, a.value, "covers")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and VLLM_DOTTED.match(node.value):
            self.add(node, node.value, "string")


def scan_file(path: Path, owners: dict[str, str], root: Path = COMPAT) -> list[Touch]:
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    sc = Scanner(path.relative_to(root.parent).as_posix(), source, owners)
    sc.visit(tree)
    return sc.touches


class Coverage:
    """Judges touches against a manifest (and, for the Ascend route, vllm-ascend's: ``also``)."""

    def __init__(self, manifest, also=None) -> None:
        self.also = Coverage(also) if also is not None else None
        self.m = manifest
        self.qualified = manifest.qualified_names()
        self.modules = manifest.modules()
        self.strings = manifest.string_constants()
        self.members = manifest.all_member_names()
        self.classes = {it.locator["name"]: it for it in manifest.items if it.kind == "class"}
        self.class_qual = {q: it.locator["name"] for it in manifest.items if it.kind == "class"
                           for q in it.qualified_names()}

    def covered(self, t: Touch) -> bool:
        return self._covered(t) or (self.also is not None and self.also._covered(t))

    def _covered(self, t: Touch) -> bool:
        if t.how == "covers":
            return t.name in self.m.shims
        if t.how in ("owner-attribute",) or (t.how == "getattr" and "." in t.name and not t.name.startswith("vllm")):
            cls, _, attr = t.name.partition(".")
            return attr in self.m.members_of(cls)
        if t.how == "getattr":
            if t.name.startswith("vllm."):
                return self._dotted(t.name)
            return t.name in self.members
        if t.how == "string":
            return t.name in self.strings or self._dotted(t.name)
        return self._dotted(t.name)

    def _dotted(self, name: str) -> bool:
        """A dotted vLLM name: a module, an item's qualified name, or a member of a covered class."""
        if name in self.modules or name in self.qualified:
            return True
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in self.class_qual:  # Class.member[.deeper]: the member must be covered
                member = parts[i]
                return member.startswith("__") or member in self.m.members_of(self.class_qual[prefix])
            if prefix in self.qualified and prefix not in self.modules:
                return True  # attribute of a covered function / global: its value, not a vLLM name
        return False


def stub_for(t: Touch) -> str:
    if t.how == "covers":
        return f"  # add shim `{t.name}` under `shims:` (absorbs / detect / before / after / accepts)"
    if t.how in ("owner-attribute", "getattr") and "." in t.name and not t.name.startswith("vllm"):
        cls, _, attr = t.name.partition(".")
        return (f"  - id: {cls}.{attr}\n    kind: attribute-kind   # or config-field / method-params\n"
                f"    locator: {{module: <vllm module of {cls}>, class: {cls}, attr: {attr}}}")
    mod, _, name = t.name.rpartition(".")
    if t.how == "import" and name and name[:1].isupper():
        return f"  - id: {name}\n    kind: class\n    locator: {{module: {mod}, name: {name}}}"
    return (f"  - id: {t.name}\n    kind: module   # or class / function / module-global\n"
            f"    locator: {{module: {t.name}}}")


#: test support outside compat/ whose vLLM names the manifest lists too (the upgrade check probes them)
HARNESS = REPO / "ascend_spec_tools" / "vllm_harness.py"


def compat_files() -> list[Path]:
    return sorted(p for p in COMPAT.rglob("*.py") if "__pycache__" not in p.parts) + [HARNESS]


# ------------------------------------------------------------------------------------------------ tests


def test_compat_touches_only_manifest_names():
    manifest = M.load()
    cov = Coverage(manifest, M.load(M.ASCEND_PATH))
    missing: list[Touch] = []
    for p in compat_files():
        missing += [t for t in scan_file(p, dict(manifest.owners)) if not cov.covered(t)]
    if missing:
        lines = [f"compat/ touches vLLM names missing from compat/api_manifest.yaml ({len(missing)}):"]
        lines += [f"  {t}" for t in missing]
        lines += ["", "Add an item for each (then run tools/upgrade_check.py to see it read), e.g.:"]
        lines += sorted({stub_for(t) for t in missing})
        pytest.fail("\n".join(lines), pytrace=False)


def test_every_shim_marked_in_compat_exists():
    """``@covers("id")`` in compat must name a manifest shim; once compat marks shims, all must be marked."""
    manifest = M.load()
    ascend = M.load(M.ASCEND_PATH)
    shims = {**manifest.shims, **ascend.shims}
    marked: dict[str, list[str]] = {}
    for p in compat_files():
        for t in scan_file(p, {}):
            if t.how == "covers":
                marked.setdefault(t.name, []).append(f"{t.file}:{t.line}")
    unknown = {k: v for k, v in marked.items() if k not in shims}
    assert not unknown, f"covers() names shim ids the manifest lacks: {unknown}"
    if not marked:
        pytest.skip("compat/ marks no shims with covers() yet")
    unmarked = sorted(set(shims) - set(marked))
    assert not unmarked, f"manifest shims with no @covers(...) implementation in compat/: {unmarked}"


# -------------------------------------------------------------------------- the scanner itself


SAMPLE = '''
import vllm.v1.worker.gpu_model_runner as gmr
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.utils import CpuGpuBuffer
from vllm.config import SpeculativeConfig, NotInManifest
from ascend_spec.compat.manifest import covers

GROUP = "vllm.general_plugins"
BAD_GROUP = "vllm.not_a_group"

@covers("cpu_gpu_buffer")
def positions(runner):
    if hasattr(runner, "optimistic_seq_lens_cpu"):
        pass
    x = getattr(runner.input_batch, "num_tokens_no_spec")
    y = runner.input_batch.token_ids_cpu
    z = runner.not_a_runner_attr
    w = getattr(runner, "also_missing", None)
    gmr.EagleProposer = EagleProposer
    gmr.NotAGlobal = 1
    EagleProposer.propose
    EagleProposer.nonexistent_method
    n = spec_config.num_speculative_tokens
    runner.positions.gpu[:3]
    ok = runner.hidden_thing  # manifest: ignore
    return common_attn_metadata.query_start_loc

@covers("no_such_shim")
def other(self):
    return getattr(self, "anything")
'''


def test_scanner_flags_exactly_the_uncovered_names(tmp_path: Path):
    manifest = M.load()
    (tmp_path / "compat").mkdir()
    f = tmp_path / "compat" / "sample.py"
    f.write_text(SAMPLE)
    touches = scan_file(f, dict(manifest.owners), root=tmp_path / "compat")
    cov = Coverage(manifest)
    missing = sorted({t.name for t in touches if not cov.covered(t)})
    assert missing == sorted([
        "vllm.config.NotInManifest",
        "vllm.not_a_group",
        "GPUModelRunner.not_a_runner_attr",
        "GPUModelRunner.also_missing",
        "vllm.v1.worker.gpu_model_runner.NotAGlobal",
        "vllm.v1.spec_decode.eagle.EagleProposer.nonexistent_method",
        "no_such_shim",
    ]), missing
    names = {t.name for t in touches}
    assert {"GPUModelRunner.optimistic_seq_lens_cpu", "InputBatch.num_tokens_no_spec", "InputBatch.token_ids_cpu",
            "SpeculativeConfig.num_speculative_tokens", "CommonAttentionMetadata.query_start_loc",
            "GPUModelRunner.positions", "vllm.general_plugins"} <= names
    assert "GPUModelRunner.hidden_thing" not in names  # ignored line
    assert "anything" not in names  # getattr on self


def test_ascend_manifest_validates_and_scanner_judges_vllm_ascend_names(tmp_path: Path):
    ascend = M.load(M.ASCEND_PATH)
    assert ascend.root == "vllm_ascend" and ascend.items and ascend.shims
    (tmp_path / "compat").mkdir()
    f = tmp_path / "compat" / "sample.py"
    f.write_text('A = "vllm_ascend.spec_decode"\nB = "vllm_ascend.not_a_module"\n')
    cov = Coverage(M.load(), ascend)
    missing = [t.name for t in scan_file(f, {}, root=tmp_path / "compat") if not cov.covered(t)]
    assert missing == ["vllm_ascend.not_a_module"]


def test_manifest_validates():
    manifest = M.load()
    assert manifest.scope and manifest.shims and manifest.items
    # every owner maps to a class the manifest knows members of
    for var, cls in manifest.owners.items():
        assert manifest.members_of(cls), f"owners.{var} -> {cls}: no members listed"
