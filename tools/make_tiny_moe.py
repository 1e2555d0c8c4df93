"""Write deterministic random DeepSeek-V3 MoE + YaRN checkpoints (see ``ascend_spec.tiny_models.PRESETS``).

    python tools/make_tiny_moe.py --out /tmp/tiny-moe [--preset moe-e16-k4 ...] [--seed 0]
                                  [--dtype float32|bfloat16] [--shard-mb N] [--fp8]

Writes one folder per preset under ``--out``: config.json, safetensors (sharded with an index when
``--shard-mb`` is given), and the bundled tokenizer.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ascend_spec.tiny_models import PRESETS, write_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--shard-mb", type=float, default=None, help="shard size; default one model.safetensors")
    ap.add_argument("--fp8", action="store_true", help="DeepSeek block-fp8 linear weights with *_scale_inv")
    args = ap.parse_args()
    shard = int(args.shard_mb * 2**20) if args.shard_mb else None
    for name in args.preset or sorted(PRESETS):
        path = write_checkpoint(args.out / name, name, args.seed, args.dtype, shard, args.fp8)
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
