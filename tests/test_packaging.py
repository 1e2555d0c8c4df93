"""The wheel installs graph/ and compat/ under the ascend_spec namespace, with the bundled model, and nothing else."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_has_only_the_ascend_spec_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("ascend_spec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"ascend_spec"}
    for expected in ("ascend_spec/graph/model.py", "ascend_spec/graph/backends/torchair.py",
                     "ascend_spec/compat/api_manifest.yaml", "ascend_spec/models/tiny-dsv3-mtp/model.safetensors",
                     "ascend_spec/models/tiny-dsv3-mtp/tokenizer.json", "ascend_spec/models/tiny-dsv3-2l-mtp/model.safetensors",
                     "ascend_spec/upgrade/cli.py", "ascend_spec/upgrade/runtime.py", "ascend_spec/upgrade/acceptance.py",
                     "ascend_spec/compat/api_manifest_ascend.yaml", "ascend_spec/compat/ascend.py",
                     "ascend_spec/upgrade/ascend_check.py", "ascend_spec/upgrade/ascend_source.py"):
        assert expected in names, expected
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]" in text and "ascend-spec = ascend_spec.cli:main" in text
