"""``ascend-spec upgrade-check --package vllm-ascend``: the static verdict from vllm-ascend's sources, offline.

The releases are the vendored excerpts (tests/data/vllm_ascend/<tag>), read as source trees and, through
``--archive-dir``, as GitHub-style source archives built from them; nothing is downloaded.
"""
from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from ascend_spec_tools.upgrade.ascend_source import AscendSources, extract_scope, tag_for
from ascend_spec_tools.upgrade.cli import main
from ascend_spec_tools.upgrade.common import CheckError, M

DATA = Path(__file__).resolve().parent / "data" / "vllm_ascend"
BASE = ["--package", "vllm-ascend", "--json", "--quiet"]


def run(capsys, *argv: str) -> tuple[int, dict]:
    code = main([*BASE, *argv])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def verdicts(report: dict) -> dict[str, str]:
    return {r["id"]: r["verdict"] for r in report["items"]}


def archive(tag: str, dest: Path, tree: Path | None = None) -> Path:
    """``vllm-ascend-<tag>.tar.gz`` laid out as GitHub serves it (``vllm-ascend-<version>/vllm_ascend/...``)."""
    src = tree or DATA / tag
    p = dest / f"vllm-ascend-{tag}.tar.gz"
    with tarfile.open(p, "w:gz") as tar:
        tar.add(src / "vllm_ascend", arcname=f"vllm-ascend-{tag.lstrip('v')}/vllm_ascend")
        readme = f"vllm-ascend {tag}\n".encode()
        info = tarfile.TarInfo(f"vllm-ascend-{tag.lstrip('v')}/README.md")
        info.size = len(readme)
        tar.addfile(info, io.BytesIO(readme))
    return p


V2_LOCATION = {"v2.init_speculator", "v2.eagle.init_speculator", "v2.NPUModelRunner.init_speculator"}
#: from v0.25.1rc1 the MTP speculator is AscendMTPSpeculator on AscendAutoRegressiveSpeculator (shim ascend_v2_speculator)
V2_MTP_CLASS = {"v2.AscendMTPSpeculator", "v2.AscendEagleSpeculator", "v2.AscendEagleSpeculator.set_attn",
                "v2.AscendAutoRegressiveSpeculator.propose", "v2.AscendAutoRegressiveSpeculator.set_attn"}

#: from v0.24.0rc1 the indexer's keys are bound on a cache layer of their own (shim ascend_sfa_cache)
SFA_SPLIT = {"AscendSFAImpl._compose_sfa_kv_cache", "AscendSFAIndexerCacheSpec"}


@pytest.mark.parametrize("tag,shimmed", [
    ("v0.24.0rc1", V2_LOCATION | SFA_SPLIT),
    ("v0.25.1rc1", V2_LOCATION | V2_MTP_CLASS | SFA_SPLIT),
    ("main", V2_LOCATION | V2_MTP_CLASS | SFA_SPLIT | {"AscendEagleProposer._propose", "set_ascend_forward_context"}),
])
def test_supported_releases_pass_with_the_shims_named(capsys, tag, shimmed):
    code, rep = run(capsys, "--from", str(DATA / "v0.23.0"), "--source", str(DATA / tag), "--to", tag)
    v = verdicts(rep)
    assert code == 0 and rep["exit_code"] == 0, rep["summary"]
    assert {i for i, t in v.items() if t.startswith("drifted — covered")} == shimmed
    assert v["AscendEagleProposer"] == "unchanged" and v["get_spec_decode_method"] == "unchanged"
    # the runner's guard grew (AscendDSparkProposer) but still accepts AscendEagleProposer
    assert v["NPUModelRunner.initialize_kv_cache.isinstance"] == "drifted — compatible"


def test_a_release_whose_runner_guard_drops_ascend_eagle_proposer_is_broken(capsys, tmp_path):
    tree = tmp_path / "broken"
    shutil.copytree(DATA / "main", tree)
    runner = tree / "vllm_ascend" / "worker" / "model_runner_v1.py"
    text = runner.read_text()
    # the guard before initialize_attn_backend no longer names AscendEagleProposer
    start = text.index("def initialize_kv_cache")
    body = text[start:].replace("AscendEagleProposer | ", "", 1)
    runner.write_text(text[:start] + body)
    code, rep = run(capsys, "--from", str(DATA / "v0.23.0"), "--source", str(tree), "--to", "x")
    assert code == 1
    assert verdicts(rep)["NPUModelRunner.initialize_kv_cache.isinstance"] == "BROKEN"


def test_a_factory_with_a_new_required_parameter_is_broken(capsys, tmp_path):
    tree = tmp_path / "broken"
    shutil.copytree(DATA / "v0.25.1rc1", tree)
    f = tree / "vllm_ascend" / "spec_decode" / "__init__.py"
    f.write_text(f.read_text().replace("def get_spec_decode_method(method, vllm_config, device, runner):",
                                       "def get_spec_decode_method(method, vllm_config, device, runner, stream):"))
    code, rep = run(capsys, "--from", str(DATA / "v0.23.0"), "--source", str(tree), "--to", "x")
    assert code == 1 and verdicts(rep)["get_spec_decode_method"] == "BROKEN"
    item = next(r for r in rep["items"] if r["id"] == "get_spec_decode_method")
    assert "stream" in json.dumps(item)


def test_a_release_that_changes_the_sfa_cache_seam_is_broken(capsys, tmp_path):
    """The DSA seams are read too: an SFA cache composer that no longer takes the layer's cache is BROKEN until a
    shim covers it; the GLM gate and the top-k buffer share are reported as found in every supported release."""
    tree = tmp_path / "broken"
    shutil.copytree(DATA / "main", tree)
    f = tree / "vllm_ascend" / "attention" / "sfa_v1.py"
    f.write_text(f.read_text().replace("def _compose_sfa_kv_cache(self, kv_cache)",
                                       "def _compose_sfa_kv_cache(self, layer_caches)"))
    code, rep = run(capsys, "--from", str(DATA / "v0.23.0"), "--source", str(tree), "--to", "x")
    v = verdicts(rep)
    assert code == 1 and v["AscendSFAImpl._compose_sfa_kv_cache"] == "BROKEN"
    assert v["_is_glm_model"] == v["AscendSpecDecodeBaseProposer._maybe_share_topk_indices"] == "unchanged"
    assert v["AscendSFABackend.get_supported_kernel_block_sizes"] == "unchanged"


def test_to_reads_the_source_archive_of_a_tag(capsys, tmp_path):
    arch, cache = tmp_path / "archives", tmp_path / "cache"
    arch.mkdir()
    for tag in ("v0.23.0", "v0.25.1rc1"):
        archive(tag, arch)
    code, rep = run(capsys, "--to", "0.25.1rc1", "--archive-dir", str(arch), "--cache", str(cache))
    assert code == 0 and rep["from"]["version"] == "v0.23.0" and rep["to"]["version"] == "v0.25.1rc1"
    kept = sorted(p.relative_to(cache / "vllm-ascend" / "v0.25.1rc1").as_posix()
                  for p in (cache / "vllm-ascend" / "v0.25.1rc1").rglob("*.py"))
    manifest = M.load(M.ASCEND_PATH)
    assert kept and all(any(Path(k).match(g) for g in manifest.scope) for k in kept)  # only the scope is kept
    assert "README.md" not in {p.name for p in (cache / "vllm-ascend").rglob("*")}


def test_matrix_over_the_archives_then_main(capsys, tmp_path):
    arch = tmp_path / "archives"
    arch.mkdir()
    for tag in ("v0.23.0", "v0.24.0rc1", "v0.25.1rc1", "main"):
        archive(tag, arch)
    code, rep = run(capsys, "--matrix", "v0.23.0..main", "--archive-dir", str(arch), "--cache", str(tmp_path / "c"))
    assert code == 0 and rep["releases"] == ["v0.23.0", "v0.24.0rc1", "v0.25.1rc1", "main"]
    items = {i["id"]: i for i in rep["items"]}
    assert [d["release"] for d in items["AscendEagleProposer._propose"]["drifts"]] == ["main"]
    assert [d["release"] for d in items["v2.init_speculator"]["drifts"]] == ["v0.24.0rc1"]
    assert not any(i["broken"] for i in rep["items"])


def test_bad_release_names_are_one_clear_error(capsys, tmp_path):
    assert main([*BASE, "--to", "latest-ish", "--archive-dir", str(tmp_path)]) == 2
    err = capsys.readouterr()
    assert "not a vllm-ascend release" in err.err and "main" in err.err
    with pytest.raises(CheckError, match="v0.99.0"):
        AscendSources(("vllm_ascend/*.py",), tmp_path, archive_dir=tmp_path).tree("0.99.0")
    assert main([*BASE, "--to", "main", "--run-tests"]) == 2
    assert "only on an Ascend NPU" in capsys.readouterr().err


def test_tag_names_and_scope_extraction(tmp_path):
    assert tag_for("0.23.0") == tag_for("v0.23.0") == "v0.23.0" and tag_for("main") == "main"
    p = archive("v0.23.0", tmp_path)
    with p.open("rb") as fh:
        files = extract_scope(fh, ("vllm_ascend/spec_decode/*.py",))
    assert set(files) == {"vllm_ascend/spec_decode/__init__.py", "vllm_ascend/spec_decode/eagle_proposer.py",
                          "vllm_ascend/spec_decode/llm_base_proposer.py"}
    assert "def get_spec_decode_method" in files["vllm_ascend/spec_decode/__init__.py"]
