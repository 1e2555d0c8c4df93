"""Contract between our ``CompilerConfig`` mapping and the real torchair configs.

torchair ships inside the torch_npu wheel (``torch_npu/dynamo/torchair/``) and cannot be imported without CANN,
so the network test downloads the wheel (download only, never installed), extracts the few pure-Python files that
``torchair.configs.compiler_config`` needs, and loads them under a synthetic top-level ``torchair`` package.
Every option that ``compiler_config_settings`` produces is then set on a real ``CompilerConfig()``; torchair's
``OptionValue`` setters validate values, so an unknown option or a value outside the allowed list raises.

Mode support in the real sources (``CompilerConfig.mode``'s allowed list):
  torch_npu 2.1 - 2.6:   "max-autotune", "reduce-overhead"
  torch_npu 2.7.1 - 2.14: "max-autotune", "reduce-overhead", "npugraph_ex"
In 2.14 "reduce-overhead" is still accepted (torchair treats it exactly like "npugraph_ex") but warns that it
will be deprecated in favour of "npugraph_ex", so each mode maps to itself.
"""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from ascend_spec.config import GRAPH_MODES
from ascend_spec.graph import moe_npu
from ascend_spec.graph.backends import BackendUnavailable
from ascend_spec.graph.backends.torchair import (
    _MODE_ALIASES,
    TorchairBackend,
    TorchairOptions,
    apply_settings,
    compiler_config_settings,
)

from .conftest import npu_available

TORCH_NPU_VERSION = "2.14.0"
#: Newer torch_npu wheels are tagged manylinux_2_28, older ones manylinux_2_17; the config sources are the same.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
TORCHAIR_PREFIX = "torch_npu/dynamo/torchair/"
#: What ``configs/compiler_config.py`` imports beyond ``torchair.configs`` itself:
#: ``_utils/error_code.py`` (``pretty_error_msg``) and ``core/utils.py`` (``logger``); both are pure Python.
EXTRA_FILES = ("_utils/error_code.py", "core/utils.py")


def _cache_dir() -> Path:
    root = os.environ.get("ASCEND_SPEC_CACHE") or Path.home() / ".cache" / "ascend-spec"
    return Path(root) / "torch_npu-wheel"


def _download_wheel() -> Path:
    """The cached torch_npu wheel, downloaded first if missing (one test worker at a time: a lock file beside it)."""
    import fcntl

    cache = _cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".download.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _download_wheel_locked(cache)


def _download_wheel_locked(cache: Path) -> Path:
    pattern = f"torch_npu-{TORCH_NPU_VERSION}-cp311-*.whl"
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    errors = []
    for platform in PLATFORMS:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"torch_npu=={TORCH_NPU_VERSION}",
               "--python-version", "3.11", "--platform", platform, "--only-binary=:all:", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        found = sorted(cache.glob(pattern))
        if proc.returncode == 0 and found:
            return found[0]
        errors.append(f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    pytest.fail(f"could not download torch_npu=={TORCH_NPU_VERSION} (needs the package index):\n"
                + "\n".join(errors))


def _extract_configs(wheel: Path, dest: Path) -> Path:
    """Extract only ``configs/*.py`` and ``EXTRA_FILES``; returns the ``torchair`` folder."""
    root = dest / "torchair"
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(TORCHAIR_PREFIX)]
        wanted = [n for n in names if n.startswith(TORCHAIR_PREFIX + "configs/") and n.endswith(".py")]
        wanted += [TORCHAIR_PREFIX + f for f in EXTRA_FILES if TORCHAIR_PREFIX + f in names]
        assert any(n.endswith("configs/compiler_config.py") for n in wanted), f"no torchair configs in {wheel.name}"
        for name in wanted:
            target = root / name[len(TORCHAIR_PREFIX):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
    return root


@pytest.fixture(scope="module")
def torchair_configs(tmp_path_factory):
    """The real ``torchair.configs`` modules, loaded without importing torch_npu.

    Only the package initializers are bypassed, nothing is stubbed: ``torchair/__init__.py`` (imports torch_npu
    and the compiled ``.so`` extensions) and ``torchair/_utils/__init__.py`` (patches torch._dynamo internals)
    are replaced by empty packages whose ``__path__`` points at the extracted folders. ``configs/`` and ``core/``
    have no ``__init__.py`` in the wheel and load as namespace packages.
    """
    root = _extract_configs(_download_wheel(), tmp_path_factory.mktemp("torchair_src"))
    saved = {k: v for k, v in sys.modules.items() if k == "torchair" or k.startswith("torchair.")}
    logger_class = logging.getLoggerClass()  # core/utils.py calls logging.setLoggerClass at import
    for name, path in (("torchair", root), ("torchair._utils", root / "_utils")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    try:
        compiler_config = importlib.import_module("torchair.configs.compiler_config")
        option_base = importlib.import_module("torchair.configs._option_base")
        yield types.SimpleNamespace(CompilerConfig=compiler_config.CompilerConfig,
                                    OptionValue=option_base.OptionValue, NpuBaseConfig=option_base.NpuBaseConfig)
    finally:
        logging.setLoggerClass(logger_class)
        for k in [k for k in sys.modules if k == "torchair" or k.startswith("torchair.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _resolve(config, dotted: str):
    *parents, leaf = dotted.split(".")
    target = config
    for p in parents:
        target = getattr(target, p)
    return target, leaf


def _as_torchair_value(v) -> str:
    """How ``OptionValue.value`` reports a value: booleans as "1"/"0", everything else as ``str``."""
    return "1" if v is True else "0" if v is False else str(v)


ALL_OPTIONS = [
    TorchairOptions(mode=mode, frozen_parameter=fp, view_optimize=vo, tiling_schedule_optimize=ts)
    for mode, fp, vo, ts in itertools.product(sorted(_MODE_ALIASES), (True, False), (True, False), (True, False))
]


def test_allowed_modes_all_mapped():
    assert set(GRAPH_MODES) <= set(_MODE_ALIASES)


@pytest.mark.network
def test_every_setting_is_a_validated_option(torchair_configs):
    """Each dotted path exists on a fresh ``CompilerConfig`` and is an ``OptionValue`` under a config node, so
    assignments go through torchair's validating setter."""
    config = torchair_configs.CompilerConfig()
    for dotted in compiler_config_settings(TorchairOptions()):
        target, leaf = _resolve(config, dotted)
        assert isinstance(target, torchair_configs.NpuBaseConfig), dotted
        assert isinstance(getattr(target, leaf, None), torchair_configs.OptionValue), f"{dotted} is not an option"


@pytest.mark.network
@pytest.mark.parametrize("opts", ALL_OPTIONS,
                         ids=lambda o: f"{o.mode}-fp{int(o.frozen_parameter)}-vo{int(o.view_optimize)}"
                                       f"-ts{int(o.tiling_schedule_optimize)}")
def test_settings_accepted_by_real_compiler_config(torchair_configs, opts):
    settings = compiler_config_settings(opts)
    config = apply_settings(torchair_configs.CompilerConfig(), settings)
    for dotted, value in settings.items():
        target, leaf = _resolve(config, dotted)
        assert getattr(target, leaf).value == _as_torchair_value(value), dotted
    assert config.mode.value == _MODE_ALIASES[opts.mode]


@pytest.mark.network
@pytest.mark.parametrize("dotted, bad", [
    ("mode", "no-such-mode"),
    ("experimental_config.frozen_parameter", "yes"),
    ("experimental_config.enable_view_optimize", None),
    ("experimental_config.no_such_option", True),
    ("no_such_section.frozen_parameter", True),
])
def test_contract_check_can_fail(torchair_configs, dotted, bad):
    """Bad values and unknown options raise, so the acceptance test above really checks something."""
    with pytest.raises((ValueError, AttributeError)):
        apply_settings(torchair_configs.CompilerConfig(), {dotted: bad})


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_backend_unavailable_without_torch_npu():
    with pytest.raises(BackendUnavailable) as exc_info:
        TorchairBackend(TorchairOptions())
    msg = str(exc_info.value)
    assert "torch_npu" in msg and "CANN" in msg and "inductor" in msg


@pytest.mark.network
def test_patch_for_hcom_exists_in_torchair():
    """Under tensor parallel the backend calls ``torchair.patch_for_hcom()`` (collectives → HCOM), as vllm-ascend
    did: the function must be what torchair's package exports, taking no argument."""
    import ast

    with zipfile.ZipFile(_download_wheel()) as zf:
        names = [n for n in zf.namelist() if n.startswith(TORCHAIR_PREFIX) and n.endswith(".py")]
        init = ast.parse(zf.read(TORCHAIR_PREFIX + "__init__.py"))
        exported = {a.asname or a.name for node in ast.walk(init) if isinstance(node, ast.ImportFrom)
                    for a in node.names} | {n.name for n in init.body if isinstance(n, ast.FunctionDef)}
        defs = [node for n in names for node in ast.walk(ast.parse(zf.read(n)))
                if isinstance(node, ast.FunctionDef) and node.name == "patch_for_hcom"]
    assert "patch_for_hcom" in exported
    assert defs and all(not d.args.args and not d.args.kwonlyargs for d in defs)


def test_torchair_backend_patches_hcom_only_under_tp(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(CompilerConfig=lambda: types.SimpleNamespace(
        experimental_config=types.SimpleNamespace()), get_npu_backend=lambda compiler_config: "npu",
        patch_for_hcom=lambda: calls.append("hcom"))
    monkeypatch.setattr("ascend_spec.graph.backends.torchair._import_torchair", lambda: fake)
    TorchairBackend(TorchairOptions())
    assert calls == []
    TorchairBackend(TorchairOptions(distributed=True))
    assert calls == ["hcom"]


# ---------------------------------------------------------------------------------------------------------------
# graph/moe_npu.py: the torch_npu MoE ops it calls, against the wheel's own op schemas.
# ---------------------------------------------------------------------------------------------------------------

#: Where torch_npu 2.14.0 declares its ops: the op-plugin codegen list. Each entry's ``func`` is the schema string
#: registered with the dispatcher as ``torch.ops.npu.<name>`` (``_op_plugin_docs.py`` has the same prototypes,
#: but as prose for humans).
NPU_OP_DECLARATIONS = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
#: Where ``torch_npu.<op>`` gets bound: ``torch_npu.<op> = torch.ops.npu.<op>`` lines, or the ``exposed`` list.
NPU_OP_BINDINGS = ("torch_npu/utils/custom_ops.py", "torch_npu/utils/exposed_api.py")
GE_CONVERTERS = TORCHAIR_PREFIX + "_ge_concrete_graph/ge_converter/"
#: torch_npu's meta (shape) functions of its ops: pure Python over torch, run here on meta tensors.
NPU_META_REGISTRATIONS = "torch_npu/op_plugin/meta/_meta_registrations.py"
#: torchair's npugraph_ex capture: which arguments of each captured op it re-feeds on every replay.
ACL_GRAPH = TORCHAIR_PREFIX + "_acl_concrete_graph/acl_graph.py"
#: torchair's FX → GE translation: how each graph input (tensor or SymInt) becomes a GE ``Data`` node.
FX2GE = TORCHAIR_PREFIX + "_ge_concrete_graph/fx2ge_converter.py"


@pytest.fixture(scope="module")
def npu_wheel_ops() -> types.SimpleNamespace:
    """Default-overload schemas of every declared op, the torch_npu binding sources, the torchair GE converters."""
    import yaml

    with zipfile.ZipFile(_download_wheel()) as zf:
        decl = yaml.safe_load(zf.read(NPU_OP_DECLARATIONS))
        bindings = "\n".join(zf.read(n).decode() for n in NPU_OP_BINDINGS)
        converters = "\n".join(zf.read(n).decode() for n in zf.namelist()
                               if n.startswith(GE_CONVERTERS) and n.endswith(".py"))
        meta = zf.read(NPU_META_REGISTRATIONS).decode()
        acl_graph = zf.read(ACL_GRAPH).decode()
        fx2ge = zf.read(FX2GE).decode()
    schemas = {}
    for section in decl.values():
        for entry in section if isinstance(section, list) else ():
            if isinstance(entry, dict) and "func" in entry:
                name, _, overload = entry["func"].split("(", 1)[0].partition(".")
                if not overload:  # a Tensor group_list (npu_grouped_matmul) resolves to the default overload
                    schemas[name] = entry["func"]
    return types.SimpleNamespace(schemas=schemas, bindings=bindings, converters=converters, meta=meta,
                                 acl_graph=acl_graph, fx2ge=fx2ge)


def _call_errors(schema_str: str, call) -> list[str]:
    """What is wrong with calling ``schema_str`` as ``call`` (an ``NpuCall``) describes; empty when it is fine."""
    import torch

    args = torch._C.parse_schema(schema_str).arguments  # the dispatcher's own parser
    by_name = {a.name: a for a in args}
    errors = []
    for i, name in enumerate(call.positional):
        if i >= len(args) or args[i].kwarg_only or args[i].name != name:
            errors.append(f"positional #{i} is not {name!r}")
    for name in call.keyword:
        if name not in by_name:
            errors.append(f"no argument {name!r}")
        elif name in call.positional:
            errors.append(f"{name!r} passed twice")
    passed = set(call.positional) | set(call.keyword)
    errors += [f"required {a.name!r} not passed" for a in args if not a.has_default_value() and a.name not in passed]
    return errors


@pytest.mark.network
@pytest.mark.parametrize("op", list(moe_npu.NPU_MOE_CALLS))
def test_npu_moe_calls_match_wheel_schemas(npu_wheel_ops, op):
    assert op in npu_wheel_ops.schemas, f"{op} not declared in {NPU_OP_DECLARATIONS}"
    assert _call_errors(npu_wheel_ops.schemas[op], moe_npu.NPU_MOE_CALLS[op]) == [], npu_wheel_ops.schemas[op]
    assert (f"torch_npu.{op} = torch.ops.npu.{op}\n" in npu_wheel_ops.bindings
            or f"'{op}'" in npu_wheel_ops.bindings), f"torch_npu does not expose {op}"
    assert f"register_fx_node_ge_converter(torch.ops.npu.{op}.default)" in npu_wheel_ops.converters, \
        f"torchair has no GE converter for {op}: it could not be captured in a torchair graph"


@pytest.mark.network
def test_npu_attention_call_matches_wheel_schema(npu_wheel_ops):
    """graph/mla_kernels.npu_mla: query/key/value by position, then exactly ``NPU_ATTENTION_KWARGS``; the KV and
    query lengths are ``SymInt[]`` (host ints, graph inputs once symbolic), not tensors."""
    from ascend_spec.graph.mla_kernels import NPU_ATTENTION_KWARGS, NPU_ATTENTION_OP

    schema = npu_wheel_ops.schemas[NPU_ATTENTION_OP]
    call = moe_npu.NpuCall(("query", "key", "value"), NPU_ATTENTION_KWARGS)
    assert _call_errors(schema, call) == [], schema
    for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):  # the parser prints SymInt as int: read the text
        assert f"SymInt[]? {name}=" in schema, name
    assert f"register_fx_node_ge_converter(torch.ops.npu.{NPU_ATTENTION_OP}.default)" in npu_wheel_ops.converters


def _ge_converter(converters: str, op: str):
    """The GE converter function registered for ``torch.ops.npu.<op>.default`` (its AST)."""
    import ast

    marker = f"torch.ops.npu.{op}.default"
    return next(node for node in ast.walk(ast.parse(converters)) if isinstance(node, ast.FunctionDef)
                and any(marker in ast.unparse(d) for d in node.decorator_list))


@pytest.mark.network
def test_npu_attention_lengths_reach_torchair_graphs_as_host_inputs(npu_wheel_ops):
    """What ``npu_mla``'s host lengths rely on in torchair: its GE converter takes every keyword we pass and
    lengths as ``List[int]`` (SymInts there become host ``Data`` inputs of the GE graph), and npugraph_ex
    re-feeds both length lists of a captured call on every replay."""
    import ast

    from ascend_spec.graph.mla_kernels import NPU_ATTENTION_KWARGS, NPU_ATTENTION_OP

    conv = _ge_converter(npu_wheel_ops.converters, NPU_ATTENTION_OP)
    params = {a.arg: a for a in conv.args.kwonlyargs}
    assert set(NPU_ATTENTION_KWARGS) <= set(params), set(NPU_ATTENTION_KWARGS) - set(params)
    for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
        assert "List[int]" in ast.unparse(params[name].annotation), ast.unparse(params[name].annotation)
    parse_input = next(n for n in ast.walk(ast.parse(npu_wheel_ops.fx2ge))
                       if isinstance(n, ast.FunctionDef) and n.name == "parse_input")
    sym_branch = next(n for n in ast.walk(parse_input) if isinstance(n, ast.If) and "is_sym(" in ast.unparse(n.test))
    assert "placement='CPU'" in ast.unparse(sym_branch.body[:3]), "a SymInt input is no longer a host Data input"
    replay = npu_wheel_ops.acl_graph[npu_wheel_ops.acl_graph.index(f"torch.ops.npu.{NPU_ATTENTION_OP}.default:"):]
    updated = replay[replay.index("updated_param_keys="):replay.index("]", replay.index("updated_param_keys="))]
    assert '"actual_seq_lengths"' in updated and '"actual_seq_lengths_kv"' in updated, updated


def _wheel_meta_function(meta_source: str, name: str):
    """``name`` from torch_npu's meta registrations with the helpers it calls, defined without torch_npu."""
    import ast
    import typing

    import torch

    tree = ast.parse(meta_source)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    wanted, todo = set(), [name]
    while todo:  # the function and, transitively, the module-level helpers it calls
        fn = funcs[todo.pop()]
        wanted.add(fn.name)
        todo += [c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                 and c.func.id in funcs and c.func.id not in wanted]
    body = []
    for fn_name in sorted(wanted):
        fn = funcs[fn_name]
        fn.decorator_list = []
        body.append(fn)
    namespace = {"torch": torch, "Dict": typing.Dict, "List": typing.List, "Optional": typing.Optional,
                 "ops_error": lambda *a: "", "ErrCode": types.SimpleNamespace(VALUE=0, PARAM=0, TYPE=0)}
    exec(compile(ast.Module(body=body, type_ignores=[]), NPU_META_REGISTRATIONS, "exec"), namespace)
    return namespace[name]


@pytest.mark.network
@pytest.mark.parametrize("q_len, heads, block", [(3, 4, 128), (1, 32, 16), (4, 20, 128)])
def test_npu_mla_output_layout_matches_wheel_meta(npu_wheel_ops, monkeypatch, q_len, heads, block):
    """``npu_mla`` composed with the wheel's own shape function of the op (on meta tensors): the layout string,
    the query/key shapes we pass and our reading of its output (``[N, T, C]`` for ``TND_NTD``) agree."""
    import torch

    from ascend_spec.graph import mla_kernels
    from ascend_spec.graph.mla_kernels import NPU_ATTENTION_OP, NPU_INPUT_LAYOUT
    from ascend_spec.graph.paging import PagedInputs

    meta_fn = _wheel_meta_function(npu_wheel_ops.meta, f"{NPU_ATTENTION_OP}_forward")
    seen = {}

    def op(query, key, value, **kwargs):
        seen.update(kwargs, query=query, key=key)
        return meta_fn(query, key, value, **kwargs)

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = op
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    b, c, r, num_blocks = 3, 512, 64, 10
    m = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    inp = PagedInputs(m(b, q_len, dtype=torch.long), m(b, q_len, dtype=torch.long), m(b, 4, dtype=torch.long),
                      m(b, dtype=torch.long), (40, 0, 200))
    out = mla_kernels.npu_mla(m(b, q_len, heads, c), m(b, q_len, heads, r), (m(num_blocks, block, c),
                              m(num_blocks, block, r)), inp, 0.1)
    assert out.shape == (b, q_len, heads, c) and out.dtype == torch.bfloat16
    assert seen["input_layout"] == NPU_INPUT_LAYOUT and seen["query"].shape == (b * q_len, seen["num_heads"], c)
    assert seen["key"].shape == (num_blocks, 1, block, c) and seen["key_rope"].shape == (num_blocks, 1, block, r)
    assert seen["sparse_mode"] == (3 if q_len > 1 else 0)


@pytest.mark.network
def test_npu_mla_layout_check_can_fail(npu_wheel_ops):
    """The wheel's shape function refuses a layout it does not know and a query of the wrong rank."""
    import torch

    meta_fn = _wheel_meta_function(npu_wheel_ops.meta, "npu_fused_infer_attention_score_forward")
    q = torch.empty(6, 32, 512, dtype=torch.bfloat16, device="meta")
    k = torch.empty(10, 1, 128, 512, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError):
        meta_fn(q, k, k, num_heads=32, input_layout="TND_XYZ", block_table=torch.empty(2, 4, device="meta"))
    with pytest.raises(RuntimeError):
        meta_fn(q.unsqueeze(0), k, k, num_heads=32, input_layout="TND_NTD", block_table=torch.empty(2, 4,
                                                                                                   device="meta"))


@pytest.mark.network
@pytest.mark.parametrize("op, call", [
    ("npu_swiglu", moe_npu.NpuCall(("x",), ())),  # wrong positional name (it is "self")
    ("npu_moe_init_routing", moe_npu.NpuCall(("x",), ("row_idx", "expert_idx"))),  # active_num is required
    ("npu_moe_gating_top_k", moe_npu.NpuCall(("x", "bias"), ("k",))),  # bias is keyword-only
    ("npu_grouped_matmul", moe_npu.NpuCall((), ("x", "weight", "group_size"))),  # no such argument
    # the v2 op's names for the lengths are not the v1 op's
    ("npu_fused_infer_attention_score", moe_npu.NpuCall(("query", "key", "value"), ("actual_seq_kvlen",))),
])
def test_npu_call_check_can_fail(npu_wheel_ops, op, call):
    assert _call_errors(npu_wheel_ops.schemas[op], call)


# A fake torch_npu whose ops implement the formulas of the wheel's docs (``_op_plugin_docs.py``) in plain torch.
# It checks our composition of the ops and records the calls; it says nothing about the real kernels.

def _ref_gating(logits, bias, top_k: int, n_group: int, topk_group: int):
    """noaux_tc selection on fp32 logits [T, E] → (ids [T, k] int64, unbiased sigmoid scores [T, k])."""
    import torch

    scores = logits.float().sigmoid()
    biased = scores + bias.float()
    t, e = scores.shape
    group_scores = biased.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_scores).scatter(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
    biased = biased.masked_fill(keep.repeat_interleave(e // n_group, dim=1) == 0, float("-inf"))
    ids = biased.topk(top_k, dim=-1).indices
    return ids, scores.gather(1, ids)


def _ref_routed(x, gate_weight, bias, w13, w2, *, top_k, n_group, topk_group, routed_scaling_factor,
                norm_topk_prob):
    """Per (token, expert) loop in fp32: Σ_k w_k · (silu(x W_gate^T) · x W_up^T) W_down^T."""
    import torch
    import torch.nn.functional as F

    ids, w = _ref_gating(x.float() @ gate_weight.float().T, bias, top_k, n_group, topk_group)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * routed_scaling_factor
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = w13[e, :inter].float(), w13[e, inter:].float()
            h = F.silu(x[t].float() @ gate.T) * (x[t].float() @ up.T)
            out[t] += w[t, j] * (h @ w2[e].float().T)
    return out


def _fake_torch_npu(calls: list):
    import torch
    import torch.nn.functional as F

    def gating(x, k, *, bias, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
               routed_scaling_factor, eps):
        assert (group_select_mode, renorm, norm_type) == (1, 0, 1) and bias.dtype == x.dtype
        ids, y = _ref_gating(x, bias, k, group_count, k_group)
        y = y / (y.sum(-1, keepdim=True) + eps) * routed_scaling_factor  # sigmoid mode always renormalises
        return y.to(x.dtype), ids.to(torch.int32), x.float().sigmoid()

    def init_routing(x, *, row_idx, expert_idx, active_num):
        # expanded_expert_idx, sorted_row_idx = keyValueSort(expert_idx, row_idx)
        expanded_expert_idx, order = expert_idx.reshape(-1).sort(stable=True)
        sorted_row_idx = row_idx.reshape(-1)[order]
        expanded_row_idx = torch.empty_like(sorted_row_idx)  # expanded_row_idx[sorted_row_idx[i]] = i
        expanded_row_idx[sorted_row_idx.long()] = torch.arange(len(order), dtype=torch.int32)
        expanded_x = x[sorted_row_idx.long() % x.shape[0]]  # expanded_x[i] = x[sorted_row_idx[i] % num_rows]
        return expanded_x[:min(x.shape[0], active_num) * row_idx.shape[1]], expanded_row_idx, expanded_expert_idx

    def compute_expert_tokens(sorted_expert_for_source_row, num_expert):
        # expertTokens_i = BinarySearch(sorted, i): the end of expert i's rows
        return torch.searchsorted(sorted_expert_for_source_row, torch.arange(num_expert, dtype=torch.int32),
                                  right=True).to(torch.int32)

    def grouped_matmul(*, x, weight, split_item, group_list_type, group_type, group_list):
        assert (len(x), len(weight), split_item, group_list_type, group_type) == (1, 1, 2, 0, 0)
        (a,), (w,) = x, weight
        assert w.shape[1] == a.shape[1], "weight must be [E, K, N]"
        out, start = a.new_zeros(a.shape[0], w.shape[2]), 0
        for g, end in enumerate(group_list.tolist()):  # y_i = x_i × weight_i over each row group
            out[start:end] = a[start:end] @ w[g]
            start = end
        return [out]

    def swiglu(x, *, dim=-1):
        a, b = x.chunk(2, dim=dim)  # swish(A) * B
        return F.silu(a) * b

    def finalize_routing(expanded_permuted_rows, *, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                         export_for_source_row):
        # out(i, j) = Σ_k scales[i, k] · expandPermutedRows[expandedSrcToDstRow[i + k·num_rows], j]
        assert skip1 is None and skip2 is None and bias is None and scales.dtype == expanded_permuted_rows.dtype
        n, k = scales.shape
        idx = expanded_src_to_dst_row.view(k, n).t().long()
        return (expanded_permuted_rows[idx] * scales.unsqueeze(-1)).sum(1)

    impls = {"npu_moe_gating_top_k": gating, "npu_moe_init_routing": init_routing,
             "npu_moe_compute_expert_tokens": compute_expert_tokens, "npu_grouped_matmul": grouped_matmul,
             "npu_swiglu": swiglu, "npu_moe_finalize_routing": finalize_routing}
    fake = types.ModuleType("torch_npu")
    for name, impl in impls.items():
        def recorder(*args, _name=name, _impl=impl, **kwargs):
            calls.append((_name, len(args), tuple(kwargs)))
            # Bind the positional arguments by their schema names, as the dispatcher would.
            named = dict(zip(moe_npu.NPU_MOE_CALLS[_name].positional[1:], args[1:]))
            return _impl(*args[:1], **named, **kwargs)
        setattr(fake, name, recorder)
    return fake


MOE_CFG = dict(top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _moe_inputs(num_tokens: int, dtype, device="cpu", d: int = 32, inter: int = 16, experts: int = 16):
    import torch

    g = torch.Generator().manual_seed(num_tokens)
    mk = lambda *s, scale=0.2: (torch.randn(*s, generator=g) * scale).to(device)  # noqa: E731
    return (mk(num_tokens, d, scale=1.0).to(dtype), mk(experts, d), mk(experts, scale=0.1),
            mk(experts, 2 * inter, d).to(dtype), mk(experts, d, inter).to(dtype))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 5, 32])
def test_routed_experts_npu_with_fake_torch_npu(monkeypatch, num_tokens, norm_topk_prob):
    """The calls match ``NPU_MOE_CALLS`` exactly, in order, and the composition reproduces the reference."""
    import torch

    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    x, gate, bias, w13, w2 = _moe_inputs(num_tokens, torch.float32)
    got = moe_npu.routed_experts_npu(x, x.float() @ gate.float().T, bias, w13, w2, norm_topk_prob=norm_topk_prob,
                                     **MOE_CFG)

    order = ["npu_moe_gating_top_k", "npu_moe_init_routing", "npu_moe_compute_expert_tokens", "npu_grouped_matmul",
             "npu_swiglu", "npu_grouped_matmul", "npu_moe_finalize_routing"]
    table = moe_npu.NPU_MOE_CALLS
    assert calls == [(op, len(table[op].positional), table[op].keyword) for op in order] and set(order) == set(table)
    ref = _ref_routed(x, gate, bias, w13, w2, norm_topk_prob=norm_topk_prob, **MOE_CFG)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_routed_experts_npu_does_not_import_torch_npu_at_module_import():
    assert "torch_npu" not in vars(moe_npu)


@pytest.mark.parametrize("bad", [dict(n_group=3), dict(topk_group=5), dict(top_k=9)])
def test_routed_experts_npu_rejects_unsupported_gating(monkeypatch, bad):
    """Shapes outside npu_moe_gating_top_k's documented limits fail before any op runs."""
    import torch

    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    with pytest.raises(ValueError, match="npu_moe_gating_top_k"):
        x, gate, bias, w13, w2 = _moe_inputs(2, torch.float32)
        moe_npu.routed_experts_npu(x, x @ gate.T, bias, w13, w2, norm_topk_prob=True, **{**MOE_CFG, **bad})
    assert calls == []


@pytest.mark.npu
@pytest.mark.skipif(not npu_available(), reason="needs an Ascend NPU with torch_npu and CANN")
@pytest.mark.parametrize("backend", ["eager", "torchair"])
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_routed_experts_npu_parity_on_npu(backend, num_tokens):
    """DeepSeek-V3 routing shape (E=256, 8 groups, keep 4, top-8), bf16 experts, against the fp32 reference."""
    import torch

    cfg = dict(top_k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True)
    x, gate, bias, w13, w2 = _moe_inputs(num_tokens, torch.bfloat16, "npu", d=256, inter=128, experts=256)

    def fn(x, gate, bias, w13, w2):
        return moe_npu.routed_experts_npu(x, x.float() @ gate.float().T, bias, w13, w2, **cfg)

    if backend == "torchair":
        fn = TorchairBackend(TorchairOptions()).compile(fn, f"moe_npu_bs{num_tokens}")
    got = fn(x, gate, bias, w13, w2)
    ref = _ref_routed(x, gate, bias, w13, w2, **cfg)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
