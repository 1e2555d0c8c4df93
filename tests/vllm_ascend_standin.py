"""A vllm-ascend package built from the vendored excerpts (tests/data/vllm_ascend/<tag>), importable without an NPU.

What can run here runs as vllm-ascend wrote it: the drafter factory (``spec_decode/__init__.py``) and
``AscendEagleProposer`` (``spec_decode/eagle_proposer.py``, on the installed vLLM's ``EagleProposer``) are the
release's own files. What cannot (its base proposer, forward context and V2 speculator import torch_npu, CANN ops and
vLLM 0.23-only modules) is replaced by stand-ins generated from the release's own signatures, whose bodies record
the call. For the V2 runner, ``init_speculator`` and ``AscendMTPSpeculator``'s module (on the installed vLLM's
``MTPSpeculator``) run as written; ``AscendEagleSpeculator`` and ``AscendAutoRegressiveSpeculator`` are stand-ins on
``_StandInV2Speculator`` (what vLLM's V2 speculator sets). The other proposer classes the factory imports are empty
stand-ins.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "vllm_ascend"
TAGS = ("v0.23.0", "v0.24.0rc1", "v0.25.1rc1", "main")
STUBBED = {
    "vllm_ascend/spec_decode/llm_base_proposer.py",
    "vllm_ascend/ascend_forward_context.py",
    "vllm_ascend/worker/v2/spec_decode/eagle/speculator.py",
    "vllm_ascend/worker/v2/spec_decode/autoregressive/speculator.py",
}
#: V2 speculator modules: their classes stand on V2_BASE (what vLLM's V2 speculator sets and the adapter reads)
V2_STUBBED = {"vllm_ascend/worker/v2/spec_decode/eagle/speculator.py",
              "vllm_ascend/worker/v2/spec_decode/autoregressive/speculator.py"}

#: runner module -> the function it imports by name from the module the route patches
RUNNERS = {"vllm_ascend/worker/model_runner_v1.py": "get_spec_decode_method",
           "vllm_ascend/worker/v2/model_runner.py": "init_speculator"}

RECORD = '''
import contextlib
CALLS = []

def _record(name, args):
    args = {k: v for k, v in args.items() if k != "self"}
    CALLS.append((name, args))
    return ("vllm-ascend", name)
'''

BASE_INIT = '''
    def __init__(self, vllm_config, device, pass_hidden_states_to_model=None, runner=None):
        # what vLLM's SpecDecodeBaseProposer.__init__ sets and the adapter reads
        self.vllm_config = vllm_config
        self.device = device
        self.runner = runner
        self.speculative_config = vllm_config.speculative_config
        self.num_speculative_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        _record("__init__", {"vllm_config": vllm_config, "device": device})
'''


V2_BASE = '''
import torch

class _StandInV2Speculator:
    """What vLLM's V2 speculator (EagleSpeculator / MTPSpeculator) sets and the adapter reads."""

    def __init__(self, vllm_config, device):
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.speculative_config = vllm_config.speculative_config
        self.num_speculative_steps = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.draft_tokens = torch.zeros(self.max_num_reqs, self.num_speculative_steps, dtype=torch.int64)
        self.draft_logits = None
        self.draft_attn_layer_names = set()
        _record("__init__", {"vllm_config": vllm_config, "device": device})

    def load_model(self, target_model):
        return _record("load_model", {"target_model": target_model})

    def capture(self, *args, **kwargs):
        return _record("capture", {"args": args, "kwargs": kwargs})
'''

V2_INIT = '''
    def __init__(self, vllm_config, device):
        _StandInV2Speculator.__init__(self, vllm_config, device)
'''

V2_SET_ATTN = '''
    def set_attn({args}):
        self.block_tables = block_tables  # as vLLM's set_attn keeps them
        return _record("set_attn", locals())
'''


def excerpt(tag: str, path: str) -> str:
    return (DATA / tag / path).read_text()


def _plain_args(args: ast.arguments) -> str:
    """The parameters of a def without annotations; every default becomes None (names the stand-in lacks)."""
    args = ast.parse(f"def f({ast.unparse(args)}): pass").body[0].args
    for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if a is not None:
            a.annotation = None
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    return ast.unparse(args)


def stub_module(source: str, base_imports: str = "", v2: bool = False) -> str:
    """Functions and classes of ``source`` with their parameters, bodies recording the call."""
    out = [RECORD, base_imports, V2_BASE if v2 else ""]
    for st in ast.parse(source).body:
        if isinstance(st, ast.FunctionDef):
            deco = "@contextlib.contextmanager\n" if any(ast.unparse(d) == "contextmanager"
                                                           for d in st.decorator_list) else ""
            body = ("    _record(%r, locals())\n    yield\n" % st.name) if deco else \
                   ("    return _record(%r, locals())\n" % st.name)
            out.append(f"{deco}def {st.name}({_plain_args(st.args)}):\n{body}")
        elif isinstance(st, ast.ClassDef):
            bases = "_StandInV2Speculator" if v2 else \
                ", ".join(ast.unparse(b) for b in st.bases if ast.unparse(b) == "SpecDecodeBaseProposer")
            lines = [f"class {st.name}({bases}):"]
            for f in st.body:
                if v2 and isinstance(f, ast.FunctionDef) and f.name in ("__init__", "set_attn"):
                    lines.append(V2_INIT if f.name == "__init__" else V2_SET_ATTN.format(args=_plain_args(f.args)))
                elif isinstance(f, ast.FunctionDef) and f.name == "__init__" and st.name.startswith("Ascend"):
                    lines.append(BASE_INIT)
                elif isinstance(f, ast.FunctionDef):
                    lines.append(f"    def {f.name}({_plain_args(f.args)}):\n"
                                 f"        return _record({f.name!r}, locals())\n")
            out.append("\n".join(lines) if len(lines) > 1 else lines[0] + "\n    pass\n")
    return "\n".join(out)


def build(tag: str, root: Path) -> Path:
    """Write the importable stand-in package of ``tag`` under ``root``; returns ``root``."""
    src = DATA / tag
    for p in sorted(src.rglob("*.py")):
        rel = p.relative_to(src).as_posix()
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = p.read_text()
        if rel in STUBBED:
            base = "from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer\n" \
                if rel.endswith("llm_base_proposer.py") else ""
            text = stub_module(text, base, v2=rel in V2_STUBBED)
        elif rel in RUNNERS:
            # the runners import half of vllm-ascend: here only the binding the route patches, as the release has it
            text = "".join(ast.unparse(st) + "\n" for st in ast.parse(text).body if isinstance(st, ast.ImportFrom)
                           and any(a.name == RUNNERS[rel] for a in st.names))
        elif rel == "vllm_ascend/platform.py":
            text = ""
        dest.write_text(text)
    for pkg in ("vllm_ascend/spec_decode", "vllm_ascend/worker/v2/spec_decode/eagle"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
    # empty stand-ins for the other proposers the factory imports
    factory = ast.parse(excerpt(tag, "vllm_ascend/spec_decode/__init__.py"))
    for st in factory.body:
        if isinstance(st, ast.ImportFrom) and st.module and st.module.startswith("vllm_ascend.spec_decode.") \
                and not st.module.endswith("eagle_proposer"):
            mod = root / (st.module.replace(".", "/") + ".py")
            body = "from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer\n"
            for a in st.names:
                base = "AscendEagleProposer" if a.name in ("AscendStep3p5MTPProposer", "AscendDflashProposer") \
                    else "object"
                body += f"class {a.name}({base}):\n    def __init__(self, *args, **kwargs):\n" \
                        f"        self.args = args\n"
            mod.write_text(body)
    return root


def forget() -> None:
    for name in [m for m in sys.modules if m == "vllm_ascend" or m.startswith("vllm_ascend.")]:
        del sys.modules[name]
