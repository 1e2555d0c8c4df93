"""Fingerprints read from a release's sources (AST only): one per manifest item per release."""

from __future__ import annotations

import ast
import dataclasses
import re

from .source_tree import Def, SourceTree, dotted


@dataclasses.dataclass
class Reading:
    fp: dict
    shape: str  # short human-readable shape for the table
    loc: str = ""  # file:line
    detail: str = ""  # extra evidence text


ABSENT = {"found": False}
TENSOR_FACTORIES = {"zeros", "empty", "ones", "full", "tensor", "arange", "zeros_like", "empty_like", "ones_like",
                    "full_like", "as_tensor", "from_numpy", "randint", "rand", "randn", "empty_strided"}




def short_mod(mod: str) -> str:
    return mod[5:] if mod.startswith("vllm.") else mod


def render_params(fn: ast.FunctionDef, drop_first: bool) -> list[str]:
    a = fn.args
    out: list[str] = []
    pos = list(a.posonlyargs) + list(a.args)
    defaults_from = len(pos) - len(a.defaults)
    for i, p in enumerate(pos):
        if i == 0 and drop_first:
            continue
        out.append(p.arg + ("=" if i >= defaults_from else ""))
        if a.posonlyargs and p is a.posonlyargs[-1]:
            out.append("/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(p.arg + ("=" if d is not None else ""))
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


def params_facts(params: list[str], item) -> dict:
    names = [p.rstrip("=") for p in params if p not in ("/", "*") and not p.startswith("*")]
    has_kwargs = any(p.startswith("**") for p in params)
    required = [p for p in params if p not in ("/", "*") and not p.startswith("*") and not p.endswith("=")]
    missing = [n for n in item.needs if n not in names]
    new_required = [r for r in required if r not in item.needs and r not in item.positional]
    facts = {"_needs_met": not missing or has_kwargs, "_no_new_required": not new_required,
             "_missing": missing, "_new_required": new_required}
    if item.positional:
        plain = [p.rstrip("=") for p in params if p not in ("/",)]
        facts["_positional_ok"] = plain[:len(item.positional)] == list(item.positional)
    return facts


def list_diff(old: list[str] | None, new: list[str] | None) -> str:
    old, new = old or [], new or []
    added = [x for x in new if x not in old]
    removed = [x for x in old if x not in new]
    bits = [f"+{x}" for x in added] + [f"−{x}" for x in removed]
    if not bits and old != new:
        bits.append("reordered")
    return ", ".join(bits)


def classify_value(value: ast.expr | None, ann: ast.expr | None) -> tuple[str, str | None]:
    """(kind, device) of the value assigned to a runner attribute."""
    if isinstance(value, ast.Call):
        fn = dotted(value.func)
        last = fn.rsplit(".", 1)[-1]
        if last in ("_make_buffer", "CpuGpuBuffer") or last.endswith("CpuGpuBuffer"):
            return "CpuGpuBuffer", None
        root = fn.split(".", 1)[0]
        if root == "torch" and last in TENSOR_FACTORIES:
            dev = None
            for kw in value.keywords:
                if kw.arg == "device":
                    dev = "cpu" if isinstance(kw.value, ast.Constant) and kw.value.value == "cpu" else "device"
            return "tensor", dev or "cpu"
        if last in ("to", "cuda", "pin_memory", "clone", "contiguous", "view", "reshape"):
            inner = value.func.value if isinstance(value.func, ast.Attribute) else None
            if isinstance(inner, ast.Call):
                k, d = classify_value(inner, None)
                if k == "tensor":
                    return k, ("device" if last in ("to", "cuda") else d)
        if last == "numpy" or root in ("np", "numpy"):
            return "ndarray", None
        if last and last[0].isupper():
            return last, None
        return f"{last}()", None
    if isinstance(value, ast.Constant) and value.value is None or value is None:
        if ann is not None:
            text = ast.unparse(ann)
            if "CpuGpuBuffer" in text:
                return "CpuGpuBuffer", None
            if "Tensor" in text:
                return "tensor", None
            return text.replace(" | None", "").replace("Optional[", "").rstrip("]") or "None", None
        return "None", None
    if isinstance(value, (ast.Attribute, ast.Name)):
        return f"= {dotted(value)}", None
    if isinstance(value, ast.Subscript):
        k, d = classify_value(value.value, None)
        return (k, d) if k in ("tensor", "ndarray") else ("view", None)
    return type(value).__name__.lower(), None


_ASSIGN_INDEX: dict[int, dict[str, list]] = {}


def _self_assignments(cls_node: ast.ClassDef) -> dict[str, list]:
    """attr -> [(method, stmt)] for every ``self.attr = ...`` in the class, ``__init__`` first."""
    key = id(cls_node)
    if key not in _ASSIGN_INDEX:
        index: dict[str, list] = {}
        methods = [st for st in cls_node.body if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef))]
        methods.sort(key=lambda f: f.name != "__init__")
        for fn in methods:
            found: dict[str, list] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                for t in targets:
                    for sub in ([t] if not isinstance(t, ast.Tuple) else t.elts):
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                                sub.value.id == "self":
                            found.setdefault(sub.attr, []).append(node)
            for attr, nodes in found.items():
                if attr not in index:  # the first method (``__init__`` first) that sets it wins
                    index[attr] = [(fn, n) for n in sorted(nodes, key=lambda n: n.lineno)]
        _ASSIGN_INDEX[key] = index
    return _ASSIGN_INDEX[key]


def attribute_assignments(tree: SourceTree, cls: Def, attr: str) -> list[tuple[Def, ast.FunctionDef, ast.stmt]]:
    """``self.attr = ...`` statements: in ``__init__`` first, then other methods, along the MRO."""
    for c in tree.mro(cls):
        for st in c.node.body:  # @property def attr(self)
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == attr and \
                    any(dotted(d) in ("property", "cached_property", "functools.cached_property")
                        for d in st.decorator_list):
                return [(c, None, st)]
        hits = _self_assignments(c.node).get(attr)
        if hits:
            return [(c, fn, st) for fn, st in hits]
        class_level = [st for st in c.node.body if isinstance(st, ast.AnnAssign) and
                       isinstance(st.target, ast.Name) and st.target.id == attr]
        if class_level:
            return [(c, None, class_level[0])]
    return []


class Reader:
    """Reads every manifest item from one source tree."""

    def __init__(self, tree: SourceTree) -> None:
        self.t = tree

    def read(self, item) -> Reading:
        fn = getattr(self, "_" + item.kind.replace("-", "_"))
        try:
            r = fn(item)
            if item.compare == ("found",) and r.fp.get("found"):
                r.shape = "present"
        except RecursionError:
            r = Reading(dict(ABSENT), "unreadable", detail="recursion while resolving")
        if item.kind in ("method-params", "function") and r.fp.get("found"):
            r.fp.update(params_facts(r.fp["params"], item))
        if item.kind == "dataclass-fields" and r.fp.get("found"):
            missing = [n for n in item.needs if n not in r.fp["fields"]]
            r.fp.update({"_needs_met": not missing, "_missing": missing})
        return r

    def _where_else(self, name: str, skip_mod: str | None = None) -> str:
        alts = [d for d in self.t.search_class(name) if d.module != skip_mod]
        return f"; defined at {alts[0].loc()}" if alts else ""

    # kinds ------------------------------------------------------------------------------
    def _module(self, item) -> Reading:
        p = self.t.module_file(item.locator["module"])
        if p is None:
            return Reading(dict(ABSENT), "absent", detail=f"no {item.locator['module'].replace('.', '/')}.py")
        return Reading({"found": True}, "present", f"{self.t.rel(p)}:1")

    def _class(self, item) -> Reading:
        mod, name = item.locator["module"], item.locator["name"]
        d = self.t.resolve(mod, name)
        if d is None or d.kind not in ("class", "external"):
            return Reading(dict(ABSENT), "absent", detail=f"not importable from {mod}" + self._where_else(name))
        if d.kind == "external":
            return Reading({"found": True, "defined_in": d.target.rpartition(".")[0]},
                           f"re-export of {short_mod(d.target)}", d.loc())
        bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in d.node.bases]
        shape = "class" if d.module == mod else f"class (from {short_mod(d.module)})"
        if bases:
            shape += f"({', '.join(bases)})"
        return Reading({"found": True, "defined_in": d.module, "bases": bases}, shape, d.loc())

    def _function(self, item) -> Reading:
        mod, name = item.locator["module"], item.locator["name"]
        d = self.t.resolve(mod, name)
        if d is None or d.kind != "function":
            return Reading(dict(ABSENT), "absent", detail=f"not importable from {mod}")
        params = render_params(d.node, drop_first=False)
        return Reading({"found": True, "params": params}, f"({', '.join(params)})", d.loc())

    def _method_params(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not in {loc['module']}"
                           + self._where_else(loc["class"], loc["module"]))
        hit = self.t.find_method(cls, loc["method"])
        if hit is None:
            return Reading(dict(ABSENT), "absent", cls.loc(), detail=f"{loc['class']} has no {loc['method']}()")
        owner, fn = hit
        is_static = any(dotted(d) == "staticmethod" for d in fn.decorator_list)
        params = render_params(fn, drop_first=not is_static)
        where = "" if owner.node.name == loc["class"] else f" [in {owner.node.name}]"
        return Reading({"found": True, "params": params}, f"({', '.join(params)}){where}",
                       f"{self.t.rel(owner.path)}:{fn.lineno}")

    def _attribute_kind(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not in {loc['module']}")
        hits = attribute_assignments(self.t, cls, loc["attr"])
        if not hits:
            return Reading(dict(ABSENT), "absent", cls.loc(), detail=f"{loc['class']} never sets self.{loc['attr']}")
        kinds, devs = [], []
        for _, _, st in hits:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                k, d = "property", None
            else:
                k, d = classify_value(st.value, st.annotation if isinstance(st, ast.AnnAssign) else None)
            if k not in kinds:
                kinds.append(k)
            if d and d not in devs:
                devs.append(d)
        owner, fn, st = hits[0]
        kind = "|".join(kinds)
        fp = {"found": True, "kind": kind}
        shape = kind
        if kind == "tensor" and devs:
            fp["device"] = "|".join(devs)
            shape = f"tensor ({fp['device']})"
        where = "" if fn is None or fn.name == "__init__" else f"set in {fn.name}()"
        if owner.node.name != loc["class"]:
            where = f"set in {owner.node.name}" + (f".{fn.name}()" if fn else "")
        return Reading(fp, shape, f"{self.t.rel(owner.path)}:{st.lineno}", where)

    def _dataclass_fields(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not importable from {loc['module']}"
                           + self._where_else(loc["class"], loc["module"]))
        fields, required = [], []
        for c in reversed(self.t.mro(cls)):
            for st in c.node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and \
                        "ClassVar" not in ast.unparse(st.annotation):
                    if st.target.id not in fields:
                        fields.append(st.target.id)
                    if st.value is None and st.target.id not in required:
                        required.append(st.target.id)
        fp = {"found": True, "fields": fields, "required": required}
        moved = "" if cls.module == loc["module"] else f" (from {short_mod(cls.module)})"
        return Reading(fp, f"{len(fields)} fields{moved}", cls.loc())

    @staticmethod
    def _norm_type(text: str) -> str:
        text = re.sub(r"\bOptional\[(.*)\]$", r"\1 | None", text)
        m = re.match(r"^Union\[(.*)\]$", text)
        if m:
            text = " | ".join(p.strip() for p in m.group(1).split(","))
        return text.replace("typing.", "")

    def _config_field(self, item) -> Reading:
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        if cls is None:
            return Reading(dict(ABSENT), "absent", detail=f"class {loc['class']} not importable from {loc['module']}")
        for c in self.t.mro(cls):
            for st in c.node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id == loc["field"]:
                    typ = self._norm_type(ast.unparse(st.annotation))
                    default = ast.unparse(st.value) if st.value is not None else None
                    if default:
                        default = re.sub(r"\b[Ff]ield\((default=)?", "field(", default)
                    fp = {"found": True, "type": typ}
                    shape = typ + (f" = {default}" if default and len(default) < 40 else "")
                    return Reading(fp, shape, f"{self.t.rel(c.path)}:{st.lineno}",
                                   "" if c.node.name == loc["class"] else f"in {c.node.name}")
        return Reading(dict(ABSENT), "absent", cls.loc(), detail=f"{loc['class']} has no field {loc['field']}")

    def _entry_point_group(self, item) -> Reading:
        loc = item.locator
        p = self.t.module_file(loc["module"])
        tree = self.t.parse(p)
        if tree is None:
            return Reading(dict(ABSENT), "absent", detail=f"no module {loc['module']}")
        lit = next((n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == loc["group"]), None)
        loader = loc.get("loader")
        has_loader = loader is None or self.t.resolve(loc["module"], loader) is not None
        if lit is None:
            return Reading(dict(ABSENT), "absent", detail=f"{loc['group']!r} not in {self.t.rel(p)}")
        fp = {"found": True, "loader": bool(has_loader)}
        shape = "loaded" + (f" by {loader}()" if loader and has_loader else " (loader missing)" if loader else "")
        return Reading(fp, shape, f"{self.t.rel(p)}:{lit.lineno}")

    def _module_global(self, item) -> Reading:
        loc = item.locator
        mod, name = loc["module"], loc["name"]
        st = self.t.binding_stmt(mod, name)
        if st is None:
            return Reading(dict(ABSENT), "absent", detail=f"{mod} binds no global {name}")
        if isinstance(st, ast.ImportFrom):
            alias = next(a for a in st.names if (a.asname or a.name) == name)
            src = f"{self.t._abs_from(mod, st)}.{alias.name}"
        else:  # defined (or assigned) in the module itself
            src = f"{mod}.{name}"
        calls, isinst = [], 0
        tree = self.t.module_ast(mod)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name:
                sig = ", ".join([ast.unparse(a) for a in n.args] + [f"{k.arg}=" for k in n.keywords])
                if sig not in calls:
                    calls.append(sig)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "isinstance" and \
                    len(n.args) == 2 and name in {x.id for x in ast.walk(n.args[1]) if isinstance(x, ast.Name)}:
                isinst += 1
        fp = {"found": True, "imported_from": src, "calls": calls}
        fp["_called"] = bool(calls)
        shape = f"from {short_mod(src.rpartition('.')[0])}" + (f"; {name}({calls[0]})" if calls else "; never called")
        detail = f"{isinst} isinstance check(s)" if isinst else ""
        if len(calls) > 1:
            detail = (detail + "; " if detail else "") + f"{len(calls)} call shapes"
        return Reading(fp, shape, f"{self.t.rel(self.t.module_file(mod))}:{st.lineno}", detail)

    def _isinstance_check(self, item) -> Reading:
        """``isinstance(<subject>, A | B ...)`` checks in one method: do they accept class ``accepts``?"""
        loc = item.locator
        cls = self.t.find_class(loc["module"], loc["class"])
        hit = self.t.find_method(cls, loc["method"]) if cls is not None else None
        if hit is None:
            return Reading(dict(ABSENT), "absent", detail=f"no {loc['class']}.{loc['method']}() in {loc['module']}")
        owner, fn = hit
        checks: list[tuple[list[str], int]] = []
        for n in ast.walk(fn):
            if isinstance(n, ast.Call) and dotted(n.func) == "isinstance" and len(n.args) == 2 \
                    and ast.unparse(n.args[0]) == loc["subject"]:
                names = sorted({x.id if isinstance(x, ast.Name) else x.attr for x in ast.walk(n.args[1])
                                if isinstance(x, (ast.Name, ast.Attribute))})
                checks.append((names, n.lineno))
        if not checks:
            return Reading(dict(ABSENT), "absent", f"{self.t.rel(owner.path)}:{fn.lineno}",
                           detail=f"no isinstance({loc['subject']}, ...) in {loc['method']}()")
        accepting = [c for c in checks if loc["accepts"] in c[0]]
        names, line = accepting[0] if accepting else checks[0]
        fp = {"found": True, "classes": names, "_accepts": bool(accepting)}
        return Reading(fp, " | ".join(names), f"{self.t.rel(owner.path)}:{line}",
                       "" if accepting else f"{loc['accepts']} not accepted")

    def _call_args(self, item) -> Reading:
        """What function ``name`` hands ``callee`` (its first call of it): the arguments, and whether the callee
        writes the function's own output (its first parameter, passed as it is or copied back after the call)
        rather than a converted copy nobody reads (``writes_output``). No call left: the shape is gone."""
        loc = item.locator
        d = self.t.resolve(loc["module"], loc["name"])
        if d is None or d.kind != "function":
            return Reading(dict(ABSENT), "absent", detail=f"no function {loc['name']} in {loc['module']}")
        where = f"{self.t.rel(d.path)}:{d.node.lineno}"
        call = next((n for n in ast.walk(d.node) if isinstance(n, ast.Call)
                     and dotted(n.func).rsplit(".", 1)[-1] == loc["callee"]), None)
        if call is None:
            return Reading({"found": True, "args": [], "writes_output": True}, f"no call of {loc['callee']}()",
                           where)
        args = [ast.unparse(a) for a in call.args]
        out = d.node.args.args[0].arg if d.node.args.args else ""
        copied_back = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "copy_"
                          and ast.unparse(n.func.value) == out for n in ast.walk(d.node))
        writes = bool(args) and (args[0] == out or copied_back)
        shape = f"{loc['callee']}({args[0] if args else ''}, ...)" + ("" if writes else f": {out} never written")
        return Reading({"found": True, "args": args, "writes_output": writes}, shape,
                       f"{self.t.rel(d.path)}:{call.lineno}")

    def _call_site(self, item) -> Reading:
        loc = item.locator
        fname = loc["function"].rsplit(".", 1)[-1]
        callers, first = [], ""
        for mod in loc["modules"]:
            tree = self.t.module_ast(mod)
            if tree is None:
                continue
            stack: list[tuple[ast.AST, str]] = [(tree, "")]
            while stack:
                node, ctx = stack.pop()
                for ch in ast.iter_child_nodes(node):
                    c2 = ctx
                    if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        c2 = f"{ctx}.{ch.name}" if ctx else ch.name
                    if isinstance(ch, ast.Call) and dotted(ch.func).rsplit(".", 1)[-1] == fname:
                        where = f"{short_mod(mod)}:{ctx or '<module>'}"
                        if where not in callers:
                            callers.append(where)
                        if not first:
                            first = f"{self.t.rel(self.t.module_file(mod))}:{ch.lineno}"
                    stack.append((ch, c2))
        if not callers:
            return Reading(dict(ABSENT), "absent", detail=f"{fname}() not called in {', '.join(loc['modules'])}")
        callers.sort()
        return Reading({"found": True, "callers": callers}, "called in " + ", ".join(callers), first)
