"""The wheel installs graph/ and compat/ under the ascend_spec namespace, with the bundled model, the tools as
ascend_spec_tools beside it, and nothing else."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_the_runtime_namespace_and_the_tools_beside_it(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("ascend_spec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"ascend_spec", "ascend_spec_tools"}
    for expected in ("ascend_spec/graph/model.py", "ascend_spec/graph/backends/torchair.py",
                     "ascend_spec/compat/api_manifest.yaml", "ascend_spec/models/tiny-dsv3-mtp/model.safetensors",
                     "ascend_spec/models/tiny-dsv3-mtp/tokenizer.json", "ascend_spec/models/tiny-dsv3-2l-mtp/model.safetensors",
                     "ascend_spec_tools/upgrade/cli.py", "ascend_spec_tools/upgrade/runtime.py",
                     "ascend_spec_tools/upgrade/acceptance.py", "ascend_spec_tools/cli.py",
                     "ascend_spec/compat/api_manifest_ascend.yaml", "ascend_spec/compat/ascend.py",
                     "ascend_spec_tools/upgrade/ascend_check.py", "ascend_spec_tools/upgrade/ascend_source.py"):
        assert expected in names, expected
    # what every vLLM worker imports carries no tools
    assert not [n for n in names if n.startswith(("ascend_spec/upgrade/", "ascend_spec/fault_injection",
                                                   "ascend_spec/tiny_models"))]
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]" in text and "ascend-spec = ascend_spec_tools.cli:main" in text
