"""Bundled checkpoints: ``BUNDLED_MODEL_DIR`` (DeepSeek-V3's depth ratio in miniature), ``FIXTURE_MODEL_DIR`` (a
2-layer test fixture) and ``BUNDLED_DSA_MODEL_DIR`` (GLM-5's DSA architecture in miniature)."""
from pathlib import Path

_HERE = Path(__file__).resolve().parent
BUNDLED_MODEL_DIR = _HERE / "tiny-dsv3-mtp"
FIXTURE_MODEL_DIR = _HERE / "tiny-dsv3-2l-mtp"
#: trained by tools/train_tiny_dsa.py: MLA + DeepSeek Sparse Attention (index_topk 32), MoE, a shared-top-k layer
BUNDLED_DSA_MODEL_DIR = _HERE / "tiny-glm5-dsa-mtp"
#: what ``--model`` takes by name besides a folder
NAMED_MODELS = {"bundled": BUNDLED_MODEL_DIR, "bundled-dsa": BUNDLED_DSA_MODEL_DIR}
