"""Bundled checkpoints."""
from pathlib import Path

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "tiny-dsv3-mtp"
