"""Bundled checkpoints: ``BUNDLED_MODEL_DIR``, the demo and benchmark model, DeepSeek-V3's depth ratio in miniature,
and ``FIXTURE_MODEL_DIR``, the earlier 2-layer model kept as a small, fast-compiling test fixture.
"""
from pathlib import Path

_HERE = Path(__file__).resolve().parent
BUNDLED_MODEL_DIR = _HERE / "tiny-dsv3-mtp"
FIXTURE_MODEL_DIR = _HERE / "tiny-dsv3-2l-mtp"
