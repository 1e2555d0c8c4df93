"""Source trees: a directory holding vllm/ (installed site-packages, a checkout, or a cache entry)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Iterator


def dotted(e: ast.AST) -> str:
    if isinstance(e, ast.Name):
        return e.id
    if isinstance(e, ast.Attribute):
        inner = dotted(e.value)
        return f"{inner}.{e.attr}" if inner else e.attr
    if isinstance(e, ast.Call):
        return dotted(e.func) + "()"
    return ""


@dataclasses.dataclass
class Def:
    """Where a name is bound: its AST node, the module and file holding it."""

    kind: str  # class | function | assign | module | external
    module: str
    node: ast.AST | None
    tree: "SourceTree"
    target: str = ""  # for external: the dotted name it was imported from

    @property
    def path(self) -> Path | None:
        return self.tree.module_file(self.module)

    def loc(self) -> str:
        rel = self.tree.rel(self.path) if self.path else self.module.replace(".", "/") + ".py"
        line = getattr(self.node, "lineno", 1) if self.node is not None else 1
        return f"{rel}:{line}"


class SourceTree:
    def __init__(self, root: Path, label: str, version: str | None = None,
                 packages: tuple[str, ...] = ("vllm",)) -> None:
        self.root = Path(root)
        self.packages = packages  # top-level packages read (vllm; vllm_ascend for vllm-ascend's tree)
        self.label = label
        self.version = version
        self._ast: dict[Path, ast.Module | None] = {}
        self.parse_errors: list[str] = []

    # files ------------------------------------------------------------------------------
    def module_file(self, mod: str) -> Path | None:
        base = self.root.joinpath(*mod.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def is_package(self, mod: str) -> bool:
        p = self.module_file(mod)
        return p is not None and p.name == "__init__.py"

    def rel(self, p: Path) -> str:
        try:
            return p.relative_to(self.root).as_posix()
        except ValueError:
            return str(p)

    def parse(self, p: Path | None) -> ast.Module | None:
        if p is None:
            return None
        if p not in self._ast:
            try:
                self._ast[p] = ast.parse(p.read_bytes(), filename=str(p))
            except (SyntaxError, ValueError, OSError) as e:
                self.parse_errors.append(f"{self.rel(p)}: {e}")
                self._ast[p] = None
        return self._ast[p]

    def module_ast(self, mod: str) -> ast.Module | None:
        return self.parse(self.module_file(mod))

    def all_modules(self) -> Iterator[str]:
        for p in sorted(f for pkg in self.packages for f in (self.root / pkg).rglob("*.py")):
            parts = list(p.relative_to(self.root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts)

    # name resolution --------------------------------------------------------------------
    def _package_of(self, mod: str) -> str:
        return mod if self.is_package(mod) else mod.rpartition(".")[0]

    def _abs_from(self, mod: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        pkg = self._package_of(mod).split(".")
        base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
        return ".".join(base + ([node.module] if node.module else []))

    @staticmethod
    def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        """Module-level statements bound at run time: into if/try/with blocks (not defs, not TYPE_CHECKING)."""
        for st in body:
            if isinstance(st, ast.If):
                if not dotted(st.test).endswith("TYPE_CHECKING"):
                    yield from SourceTree._top_level(st.body)
                yield from SourceTree._top_level(st.orelse)
            elif isinstance(st, ast.Try) or type(st).__name__ == "TryStar":
                yield from SourceTree._top_level(st.body)
                for h in st.handlers:
                    yield from SourceTree._top_level(h.body)
                yield from SourceTree._top_level(st.orelse)
                yield from SourceTree._top_level(st.finalbody)
            elif isinstance(st, (ast.With, ast.AsyncWith)):
                yield from SourceTree._top_level(st.body)
            else:
                yield st

    def resolve(self, mod: str, name: str, _depth: int = 0) -> Def | None:
        """What ``from mod import name`` gives, following re-exports within the tree."""
        if _depth > 12:
            return None
        tree = self.module_ast(mod)
        if tree is None:
            if self.module_file(f"{mod}.{name}"):
                return Def("module", f"{mod}.{name}", None, self)
            return None
        found: Def | None = None
        for st in self._top_level(tree.body):
            d = None
            if isinstance(st, ast.ClassDef) and st.name == name:
                d = Def("class", mod, st, self)
            elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
                d = Def("function", mod, st, self)
            elif isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
                d = Def("assign", mod, st, self)
            elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == name \
                    and st.value is not None:
                d = Def("assign", mod, st, self)
            elif isinstance(st, ast.ImportFrom):
                for a in st.names:
                    if (a.asname or a.name) == name:
                        src = self._abs_from(mod, st)
                        d = self.resolve(src, a.name, _depth + 1)
                        if d is None:
                            d = Def("external", mod, st, self, target=f"{src}.{a.name}")
            elif isinstance(st, ast.Import):
                for a in st.names:
                    if a.asname == name:
                        d = Def("module", a.name, st, self) if self.module_file(a.name) else \
                            Def("external", mod, st, self, target=a.name)
            if d is not None and found is None:
                found = d
        if found is None and self.module_file(f"{mod}.{name}"):
            found = Def("module", f"{mod}.{name}", None, self)
        return found

    def binding_stmt(self, mod: str, name: str) -> ast.stmt | None:
        """The first module-level statement of ``mod`` that binds ``name`` (import or definition)."""
        tree = self.module_ast(mod)
        if tree is None:
            return None
        for st in self._top_level(tree.body):
            if isinstance(st, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
                return st
            if isinstance(st, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in st.names):
                return st
            if isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in st.targets):
                return st
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == name:
                return st
        return None

    def resolve_expr(self, mod: str, expr: ast.expr) -> Def | None:
        """Resolve a base-class expression (``Name`` or dotted ``Attribute``) seen in module ``mod``."""
        if isinstance(expr, ast.Name):
            return self.resolve(mod, expr.id)
        if isinstance(expr, ast.Attribute):
            owner = self.resolve_expr(mod, expr.value)
            if owner is not None and owner.kind == "module":
                return self.resolve(owner.module, expr.attr)
        if isinstance(expr, ast.Subscript):  # Generic[T]
            return self.resolve_expr(mod, expr.value)
        return None

    def find_class(self, mod: str, name: str) -> Def | None:
        d = self.resolve(mod, name)
        return d if d is not None and d.kind == "class" else None

    def mro(self, cls: Def) -> list[Def]:
        out: list[Def] = []
        seen: set[tuple[str, str]] = set()

        def walk(c: Def) -> None:
            key = (c.module, c.node.name)
            if key in seen:
                return
            seen.add(key)
            out.append(c)
            for b in c.node.bases:
                d = self.resolve_expr(c.module, b)
                if d is not None and d.kind == "class":
                    walk(d)

        walk(cls)
        return out

    def find_method(self, cls: Def, name: str) -> tuple[Def, ast.FunctionDef] | None:
        for c in self.mro(cls):
            for st in c.node.body:
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
                    return c, st
        return None

    def search_class(self, name: str) -> list[Def]:
        """Every ``class name`` definition in the tree (a cheap text filter, then the AST)."""
        out = []
        needle = f"class {name}".encode()
        for mod in self.all_modules():
            p = self.module_file(mod)
            try:
                if needle not in p.read_bytes():
                    continue
            except OSError:
                continue
            t = self.parse(p)
            for st in self._top_level(t.body if t else []):
                if isinstance(st, ast.ClassDef) and st.name == name:
                    out.append(Def("class", mod, st, self))
        return out
