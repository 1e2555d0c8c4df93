"""Bad inputs, one table: CLI flags, YAML config, vLLM's ``additional_config``, checkpoint files and prompts.

Each case must give exactly one error that names the offending key, tensor or value (``expect``: substrings of
the message, including what is allowed where there is a choice); the CLI exits 2 without a traceback; nothing
is written: ``--output`` is not created (or keeps its content) and the checkpoint folder is unchanged.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_spec.cli import main
from ascend_spec.compat.settings import PluginSettings
from ascend_spec.config import ConfigError, EngineConfig
from ascend_spec.models import FIXTURE_MODEL_DIR

OUTPUT_SENTINEL = "previous result\n"


# -- checkpoint damage: each takes a writable copy of a checkpoint folder -------------------------------------------
def _rewrite_weights(d: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def truncate_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def int_weight(d: Path) -> None:
    _rewrite_weights(d, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))


def drop_weight(d: Path) -> None:
    _rewrite_weights(d, lambda t: t.pop("model.norm.weight"))


def edit_config(**changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        path = d / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return edit


def remove(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).unlink()


def write(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


@dataclass(frozen=True)
class Case:
    id: str
    #: ``generate`` arguments; ``{tmp}`` is the case's scratch folder
    argv: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)  # written into {tmp} first
    damage: Callable[[Path], None] | None = None  # applied to a copy of the fixture checkpoint, then {ckpt}
    plugin: dict | None = None  # instead of the CLI: vLLM's additional_config for PluginSettings
    engine: dict = field(default_factory=dict)  # instead of the CLI: Engine.generate keyword arguments


CLI_CASES = [
    Case("max-tokens-zero", ("--max-tokens", "0"), ("--max-tokens", "invalid value 0", "allowed: an int >= 1")),
    Case("max-tokens-word", ("--max-tokens", "many"), ("--max-tokens", "'many'", "allowed: an int >= 1")),
    Case("temperature-negative", ("--temperature", "-1"), ("temperature", "-1.0", ">= 0")),
    Case("temperature-nan", ("--temperature", "nan"), ("temperature", "nan", "finite")),
    Case("top-p-above-one", ("--top-p", "1.5"), ("top_p", "1.5", "(0, 1]")),
    Case("top-k-negative", ("--top-k", "-3"), ("top_k", "-3", ">= 0")),
    Case("seed-negative", ("--seed", "-1"), ("seed", "-1", ">= 0")),
    Case("logprobs-negative", ("--logprobs", "-2"), ("logprobs", "-2", ">= 0")),
    Case("backend-unknown", ("--backend", "tvm"), ("--backend", "'tvm'", "'inductor'")),
    Case("dtype-unknown", ("--dtype", "int8"), ("--dtype", "'int8'", "'bfloat16'")),
    Case("graph-batch-sizes-word", ("--graph-batch-sizes", "1,x"), ("--graph-batch-sizes", "'1,x'", "ints")),
    Case("graph-batch-sizes-zero", ("--graph-batch-sizes", "0,4"), ("graph_batch_sizes", "[0]", "positive ints")),
    Case("num-spec-tokens-zero", ("--num-speculative-tokens", "0"), ("num_speculative_tokens=0", "1..16")),
    Case("num-spec-tokens-17", ("--num-speculative-tokens", "17"), ("num_speculative_tokens=17", "1..16")),
    Case("max-model-len-one", ("--max-model-len", "1"), ("max_model_len=1", ">= 2")),
    Case("max-model-len-above-model", ("--max-model-len", "100000"),
         ("max_model_len=100000", "max_position_embeddings")),
    Case("max-num-seqs-zero", ("--max-num-seqs", "0"), ("max_num_seqs=0", ">= 1")),
    Case("kv-blocks-one", ("--kv-blocks", "1"), ("kv_blocks=1", "an int >= 2")),
    Case("kv-blocks-below-one-sequence", ("--kv-blocks", "8", "--max-model-len", "256"),
         ("kv_blocks=8", "max_model_len=256", "allowed: >= 17")),
    Case("model-missing", ("--model", "{tmp}/nowhere"), ("--model", "nowhere", "no such folder")),
    Case("prompts-file-missing", ("--prompts-file", "{tmp}/none.txt"), ("--prompts-file", "none.txt", "no such file")),
    Case("prompts-file-empty", ("--prompts-file", "{tmp}/empty.txt"), ("empty.txt", "holds no prompt"),
         files={"empty.txt": "\n  \n"}),
    Case("output-folder-missing", ("--output", "{tmp}/no/such/out.json"), ("--output", "existing folder")),
    # YAML config (--config)
    Case("config-missing", ("--config", "{tmp}/none.yaml"), ("--config", "none.yaml", "No such file")),
    Case("config-not-yaml", ("--config", "{tmp}/c.yaml"), ("c.yaml", "not valid YAML", "line 3"),
         files={"c.yaml": "speculative_config:\n  method: [mtp\n"}),
    Case("config-top-level-list", ("--config", "{tmp}/c.yaml"), ("c.yaml", "mapping at the top level", "list"),
         files={"c.yaml": "- speculative_config\n"}),
    Case("config-unknown-key", ("--config", "{tmp}/c.yaml"), ("unknown key(s) ['max_tokens']", "allowed keys"),
         files={"c.yaml": "max_tokens: 4\n"}),
    Case("config-spec-not-mapping", ("--config", "{tmp}/c.yaml"), ("speculative_config must be a mapping", "3"),
         files={"c.yaml": "speculative_config: 3\n"}),
    Case("config-method", ("--config", "{tmp}/c.yaml"), ("method='eagle'", "['deepseek_mtp', 'mtp']"),
         files={"c.yaml": "speculative_config:\n  method: eagle\n"}),
    Case("config-spec-tokens-word", ("--config", "{tmp}/c.yaml"), ("num_speculative_tokens='two'", "1..16"),
         files={"c.yaml": "speculative_config:\n  num_speculative_tokens: two\n"}),
    Case("config-max-model-len-word", ("--config", "{tmp}/c.yaml"), ("max_model_len='long'", "an int >= 2"),
         files={"c.yaml": "max_model_len: long\n"}),
    Case("config-graph-mode", ("--config", "{tmp}/c.yaml"), ("mode='fast'", "'max-autotune'"),
         files={"c.yaml": 
             "additional_config:\n  torchair_graph_config:\n    mode: fast\n"}),
    Case("config-graph-enabled-word", ("--config", "{tmp}/c.yaml"), ("enabled must be true or false", "'yes'"),
         files={"c.yaml": 
             "additional_config:\n  torchair_graph_config:\n    enabled: 'yes'\n"}),
    Case("config-graph-sizes-scalar", ("--config", "{tmp}/c.yaml"), ("graph_batch_sizes=4", "a list of positive ints"),
         files={"c.yaml": 
             "additional_config:\n  torchair_graph_config:\n    graph_batch_sizes: 4\n"}),
    Case("config-graph-set-while-off", ("--config", "{tmp}/c.yaml"), ("['mode'] set while enabled is false",),
         files={"c.yaml": 
             "additional_config:\n  torchair_graph_config:\n    enabled: false\n    mode: max-autotune\n"}),
    Case("config-additional-unknown", ("--config", "{tmp}/c.yaml"), ("unknown key(s) ['ascend']", "torchair_graph"),
         files={"c.yaml": "additional_config:\n  ascend: {}\n"}),
    # checkpoint files
    Case("ckpt-truncated", (), ("model.safetensors", "not a complete safetensors file"), damage=truncate_weights),
    Case("ckpt-int-weight", (), ("'model.norm.weight'", "I32", "'F32'"), damage=int_weight),
    Case("ckpt-missing-weight", (), ("missing tensor 'model.norm.weight'", "expected shape"), damage=drop_weight),
    Case("ckpt-config-mismatch", (), ("does not match its config.json", "shape mismatch", "expected"),
         damage=edit_config(intermediate_size=200)),
    Case("ckpt-no-tokenizer", (), ("no tokenizer.json", "tokenizer.json beside config.json"),
         damage=remove("tokenizer.json")),
    Case("ckpt-no-config", (), ("no config.json",), damage=remove("config.json")),
    Case("ckpt-config-not-json", (), ("config.json", "not readable JSON"), damage=write("config.json", "{hidden")),
    Case("ckpt-config-dtype", (), ("torch_dtype='int8'", "'float32'"), damage=edit_config(torch_dtype="int8")),
    Case("ckpt-no-weights", (), ("no *.safetensors file",), damage=remove("model.safetensors")),
    # prompts
    Case("prompt-empty", ("--prompt", ""), ("prompt 0 is empty", "at least one token")),
    Case("prompt-too-long", ("--prompt", "def f(x):\n" * 40, "--max-model-len", "64"),
         ("prompt 0 has", "max_model_len=64", "no room")),
]

PLUGIN_CASES = [
    Case("additional-ascend-not-mapping", plugin={"ascend_spec": "on"}, expect=("additional_config.ascend_spec",
                                                                               "must be a mapping", "'on'")),
    Case("additional-ascend-unknown", plugin={"ascend_spec": {"enable": True}},
         expect=("unknown key(s) ['enable']", "'enabled'")),
    Case("additional-ascend-enabled-word", plugin={"ascend_spec": {"enabled": "true"}},
         expect=("ascend_spec.enabled must be true or false", "'true'")),
    Case("additional-stats-dir-empty", plugin={"ascend_spec": {"stats_dir": ""}},
         expect=("ascend_spec.stats_dir", "folder path")),
    Case("additional-graph-unknown", plugin={"ascend_spec": {}, "torchair_graph_config": {"enable_kv_nz": True}},
         expect=("torchair_graph_config", "unknown key(s) ['enable_kv_nz']", "allowed keys")),
    Case("additional-graph-sizes-zero", plugin={"ascend_spec": {}, "torchair_graph_config": {"graph_batch_sizes": [0]}},
         expect=("graph_batch_sizes", "[0]", "positive ints")),
    Case("additional-graph-backend", plugin={"ascend_spec": {}, "torchair_graph_config": {"backend": "xla"}},
         expect=("backend='xla'", "'torchair'")),
]

ENGINE_CASES = [
    Case("ids-above-vocab", engine={"prompts": [[1, 2, 10**6]]}, expect=("prompt 0", "[1000000]", "outside [0,")),
    Case("ids-negative", engine={"prompts": [[5], [-1, 3]]}, expect=("prompt 1", "[-1]", "outside [0,")),
    Case("engine-max-tokens-zero", engine={"prompts": [[5]], "max_tokens": 0}, expect=("max_tokens=[0]", ">= 1")),
    Case("engine-params-count", engine={"prompts": [[5], [6]], "params": 3}, expect=("3 sampling params", "2 prompts")),
    Case("engine-max-num-seqs", engine={"prompts": [[5]], "max_num_seqs": 3}, expect=("max_num_seqs=3", "1..2")),
]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` by (size, mtime): a write or a new file shows."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", CLI_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("output_exists", [False, True], ids=["new-output", "old-output"])
def test_cli_bad_input(case: Case, output_exists: bool, tmp_path: Path, capsys) -> None:
    for name, text in case.files.items():
        (tmp_path / name).write_text(text)
    ckpt = FIXTURE_MODEL_DIR
    if case.damage is not None:
        ckpt = tmp_path / "ckpt"
        shutil.copytree(FIXTURE_MODEL_DIR, ckpt)
        case.damage(ckpt)
    out = tmp_path / "result.json"
    if output_exists:
        out.write_text(OUTPUT_SENTINEL)
    before = _snapshot(tmp_path), _snapshot(FIXTURE_MODEL_DIR)
    argv = [a.format(tmp=tmp_path) for a in case.argv]
    if "--model" not in argv:
        argv += ["--model", str(ckpt)]
    if "--output" not in argv:
        argv += ["--output", str(out)]
    if not {"--backend", "--graph-batch-sizes", "--config"} & set(argv):
        argv += ["--backend", "eager"]  # no compile for the cases that get as far as the engine
    try:
        code = main(["generate", "--max-tokens", "4", *argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    message = err[err.index("error:"):]
    for needle in case.expect:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert (_snapshot(tmp_path), _snapshot(FIXTURE_MODEL_DIR)) == before, "a failed run wrote or changed files"


@pytest.mark.parametrize("case", PLUGIN_CASES, ids=lambda c: c.id)
def test_additional_config_bad_input(case: Case) -> None:
    with pytest.raises(ConfigError) as err:
        PluginSettings.from_additional_config(case.plugin)
    for needle in case.expect:
        assert needle in str(err.value), f"{needle!r} not in {str(err.value)!r}"


@pytest.fixture(scope="module")
def eager_engine():
    from ascend_spec.config import GraphModeConfig
    from ascend_spec.engine import load_engine

    cfg = EngineConfig(max_model_len=64, max_num_seqs=2, graph=GraphModeConfig(enabled=False))
    return load_engine(FIXTURE_MODEL_DIR, cfg)


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda c: c.id)
def test_engine_bad_input(case: Case, eager_engine) -> None:
    from ascend_spec.sampling import SamplingParams

    kw = dict(case.engine)
    prompts = kw.pop("prompts")
    params = [SamplingParams()] * kw.pop("params", len(prompts))
    free = eager_engine.caches.allocator.num_free
    with pytest.raises(ValueError) as err:
        eager_engine.generate(prompts, params, kw.pop("max_tokens", 4), **kw)
    for needle in case.expect:
        assert needle in str(err.value), f"{needle!r} not in {str(err.value)!r}"
    assert eager_engine.caches.allocator.num_free == free, "a rejected request kept KV blocks"
