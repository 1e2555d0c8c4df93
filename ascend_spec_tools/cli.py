"""The ``ascend-spec`` command: ``upgrade-check`` runs the upgrade check (:mod:`.upgrade.cli`), every other
command is the runtime's CLI (:mod:`ascend_spec.cli`), which never loads the tools.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["upgrade-check"]:
        from .upgrade.cli import main as upgrade_check

        return upgrade_check(argv[1:])
    from ascend_spec.cli import main as runtime_cli

    return runtime_cli(argv)


if __name__ == "__main__":
    sys.exit(main())
