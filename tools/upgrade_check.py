#!/usr/bin/env python3
"""Tell, before a vLLM bump, which vLLM names ascend-spec relies on drifted and whether a shim covers them.

A thin entry point: the tool is ``ascend_spec_tools.upgrade`` (also ``ascend-spec upgrade-check``); see
``ascend_spec_tools/upgrade/cli.py`` for its usage.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from ascend_spec_tools.upgrade.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
