"""Configuration validation (vLLM / vllm-ascend keys), YAML + flags, and the CLI's JSON contract."""
import json
from pathlib import Path

import pytest

from ascend_spec.cli import build_parser, engine_config_from_args, main
from ascend_spec.config import (ConfigError, SpeculativeConfig, GraphModeConfig, default_graph_batch_sizes,
                                power_of_two_batch_sizes)


def test_speculative_config_validation():
    assert SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3}).num_speculative_tokens == 3
    with pytest.raises(ConfigError, match=r"method='eagle'; allowed: \['deepseek_mtp', 'mtp'\]"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ConfigError, match="num_speculative_tokens=0"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['num_spec_tokens'\]"):
        SpeculativeConfig.from_dict({"num_spec_tokens": 2})


def test_graph_config_validation():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['enable_kv_nz'\]"):
        GraphModeConfig.from_dict({"enable_kv_nz": True})
    with pytest.raises(ConfigError, match=r"\['graph_batch_sizes'\] set while enabled is false"):
        GraphModeConfig.from_dict({"enabled": False, "graph_batch_sizes": [1, 2]})
    with pytest.raises(ConfigError, match="mode='fast'"):
        GraphModeConfig.from_dict({"mode": "fast"})
    with pytest.raises(ConfigError, match="backend='tvm'"):
        GraphModeConfig.from_dict({"backend": "tvm"})
    assert GraphModeConfig.from_dict({"enabled": False}).effective_backend == "eager"


def test_buckets():
    assert default_graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert power_of_two_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert GraphModeConfig.from_dict({"graph_batch_sizes": [8, 2, 2]}).batch_sizes(16) == [2, 8]
    assert GraphModeConfig.from_dict({"graph_batch_sizes_init": True}).batch_sizes(16) == [1, 2, 4, 8, 16]


def _run_cli(capsys, *argv):
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json(capsys, tmp_path):
    cfg = tmp_path / "spec.yaml"
    cfg.write_text("speculative_config:\n  method: deepseek_mtp\n  num_speculative_tokens: 1\n"
                   "additional_config:\n  torchair_graph_config:\n    enabled: false\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\\n\nimport os\n")
    code, out, _ = _run_cli(capsys, "--json", "--config", str(cfg), "--prompts-file", str(prompts),
                            "--prompt", "x = [", "--max-tokens", "12", "--num-speculative-tokens", "2")
    assert code == 0
    data = json.loads(out)
    assert [o["prompt"] for o in data["outputs"]] == ["x = [", "def add(a, b):\n", "import os"]
    assert all(len(o["token_ids"]) <= 12 and o["text"] for o in data["outputs"])
    assert data["backend"] == "eager" and data["speculative"] == "deepseek_mtp K=2"  # flag overrides the file
    assert data["host_syncs_per_step"] == 0
    assert 0 <= data["acceptance_rate"] <= 1 and len(data["acceptance_per_position"]) == 2
    assert data["tokens_per_s"] > 0


@pytest.mark.slow
def test_cli_no_spec_matches_spec_text(capsys):
    args = ["--json", "--backend", "eager", "--prompt", "class Stack:\n", "--max-tokens", "20"]
    _, spec_out, _ = _run_cli(capsys, *args)
    _, plain_out, _ = _run_cli(capsys, *args, "--no-spec")
    spec, plain = json.loads(spec_out), json.loads(plain_out)
    assert spec["outputs"][0]["token_ids"] == plain["outputs"][0]["token_ids"]
    assert plain["acceptance_rate"] is None


def test_cli_output_file_and_kv_blocks(capsys, tmp_path):
    """--output receives the result (stdout stays empty); kv_blocks comes from the file, the flag overrides it.
    Bad input of every kind: tests/test_bad_inputs.py."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("kv_blocks: 40\nmax_num_seqs: 2\n")
    out = tmp_path / "out.json"
    code, stdout, _ = _run_cli(capsys, "--json", "--backend", "eager", "--config", str(cfg), "--prompt", "x = [",
                               "--max-tokens", "5", "--output", str(out))
    assert code == 0 and stdout == ""
    assert 1 <= len(json.loads(out.read_text())["outputs"][0]["token_ids"]) <= 5
    assert engine_config_from_args(build_parser().parse_args(["generate", "--config", str(cfg)])).kv_blocks == 40
    args = build_parser().parse_args(["generate", "--config", str(cfg), "--kv-blocks", "50"])
    assert engine_config_from_args(args).kv_blocks == 50


def test_cli_logprobs_and_dtype(capsys, moe_ckpts):
    code, out, _ = _run_cli(capsys, "--model", str(moe_ckpts["bundled-moe"]), "--backend", "eager", "--json",
                            "--max-tokens", "6", "--logprobs", "3", "--dtype", "bfloat16", "--prompt", "def f(x):")
    assert code == 0
    result = json.loads(out)
    assert result["dtype"] == "bfloat16"
    (o,) = result["outputs"]
    assert len(o["logprobs"]) == len(o["token_ids"]) == 6
    for token, entry in zip(o["token_ids"], o["logprobs"]):
        lps = {int(t): v for t, v in entry.items()}
        assert token in lps and 3 <= len(lps) <= 4 and all(v <= 0 for v in lps.values())
        assert lps[token] == max(lps.values())  # greedy: the sampled token is the top one


def test_cli_inspect_and_bad_dtype(capsys, tmp_path):
    (tmp_path / "config.json").write_text((Path(__file__).parent / "data" / "deepseek-v3-config.json").read_text())
    assert main(["inspect", "--model", str(tmp_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert round(info["parameters"]["target"] / 1e9, 1) == 671.0 and round(info["parameters"]["mtp"] / 1e9, 1) == 11.6
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--dtype", "float64"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--dtype" in err and "'float64'" in err and "bfloat16" in err


def test_adaptive_k_is_the_default_and_fixed_k_pins_k():
    parse = build_parser().parse_args
    assert engine_config_from_args(parse(["generate"])).adaptive_k
    assert engine_config_from_args(parse(["generate", "--adaptive-k"])).adaptive_k
    fixed = engine_config_from_args(parse(["generate", "--fixed-k", "--num-speculative-tokens", "3"]))
    assert not fixed.adaptive_k and fixed.speculative.num_speculative_tokens == 3
    with pytest.raises(SystemExit):
        parse(["generate", "--fixed-k", "--adaptive-k"])


def test_step_by_step_drafts_a_fixed_k_and_refuses_adaptive_k():
    """The step-by-step path drafts through the proposer's K_max graph: ``--step-by-step`` runs at the fixed K, and
    asking it for adaptive K (flag or config) is one clear error, not K_max drafted silently."""
    from ascend_spec.config import EngineConfig

    parse = build_parser().parse_args
    cfg = engine_config_from_args(parse(["generate", "--step-by-step"]))
    assert not cfg.fused_step and not cfg.adaptive_k
    with pytest.raises(ConfigError, match=r"adaptive_k=True needs fused_step=True.*allowed with fused_step=False: "
                                          r"adaptive_k=False \(--fixed-k\)"):
        engine_config_from_args(parse(["generate", "--step-by-step", "--adaptive-k"]))
    with pytest.raises(ConfigError, match="adaptive_k=True needs fused_step=True"):
        EngineConfig(fused_step=False)
    assert EngineConfig(fused_step=False, speculative=None).speculative is None  # no drafts: nothing to adapt
    assert EngineConfig(fused_step=False, adaptive_k=False).speculative is not None


def test_former_graph_config_name_is_a_deprecated_alias():
    import ascend_spec.config as config
    with pytest.warns(DeprecationWarning, match="use GraphModeConfig"):
        assert config.TorchairGraphConfig is config.GraphModeConfig
