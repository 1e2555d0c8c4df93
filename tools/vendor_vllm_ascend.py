#!/usr/bin/env python3
"""Refresh tests/data/vllm_ascend/<tag>/ from vllm-ascend source archives (the tests never download).

    python tools/vendor_vllm_ascend.py v0.23.0 v0.24.0rc1 v0.25.1rc1 main
    python tools/vendor_vllm_ascend.py --archive-dir ~/archives v0.23.0   # vllm-ascend-v0.23.0.tar.gz there

Each tag's GitHub source archive (or one already on disk) is read; only the excerpts listed in
``ascend_spec_tools.upgrade.ascend_excerpt.EXCERPTS`` are written, with a header naming the tag. Update
tests/data/vllm_ascend/README.md (tags, commits) when adding one.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ascend_spec_tools.upgrade.ascend_excerpt import EXCERPTS, write_excerpts  # noqa: E402
from ascend_spec_tools.upgrade.ascend_source import AscendSources, tag_for  # noqa: E402
from ascend_spec_tools.upgrade.fetch import cache_root  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tags", nargs="+")
    p.add_argument("--archive-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "vllm_ascend")
    args = p.parse_args(argv)
    sources = AscendSources(tuple(EXCERPTS), cache_root(None), archive_dir=args.archive_dir)
    for t in args.tags:
        tag = tag_for(t)
        files = sources.files(tag)
        written = write_excerpts(files, args.out / tag, f"excerpt of vllm-ascend {tag}")
        print(f"{tag}: {len(written)} files -> {args.out / tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
