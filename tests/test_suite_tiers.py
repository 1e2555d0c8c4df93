"""The suite's two tiers, as docs/test-suite.md writes them down: every test marked ``matrix`` (``make test-matrix``)
has a row in the document's matrix table naming the ``make test`` tests that cover its subject, and each of those is
a test ``make test`` runs. A repeat added to the matrix without its row, or a row whose covering test left
``make test`` (renamed, or moved to the matrix itself), fails here."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "test-suite.md"
#: the heading of the table (docs/test-suite.md) whose rows map each matrix test to its make test cover
TABLE = "## The second tier: what `make test-matrix` repeats"
#: make test's marker expression (Makefile)
MAKE_TEST = "not soak and not matrix"


def collected(marker: str) -> set[str]:
    """The node ids pytest collects under ``-m marker``, relative to tests/."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marker], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line.removeprefix("tests/") for line in proc.stdout.splitlines()
            if line.startswith("tests/") and "::" in line}


def table_rows(text: str) -> list[tuple[str, list[str]]]:
    """(matrix test, the make test tests covering it) for each row of the matrix table."""
    section = text.split(TABLE, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and "::" in cells[0]:
            rows.append((cells[0].strip("`"), re.findall(r"`([^`]+::[^`]+)`", cells[2])))
    return rows


def test_every_matrix_test_names_the_make_test_tests_covering_its_subject():
    rows = table_rows(DOC.read_text())
    assert rows, f"no rows under {TABLE!r} in {DOC}"
    matrix, core = collected("matrix"), collected(MAKE_TEST)
    assert matrix, "no test is marked matrix"
    documented = [name for name, _ in rows]
    assert len(documented) == len(set(documented)), "a matrix test has two rows"
    assert not matrix - set(documented), f"matrix tests without a row in {DOC.name}: {sorted(matrix - set(documented))}"
    assert not set(documented) - matrix, f"rows naming no matrix test: {sorted(set(documented) - matrix)}"
    for name, covers in rows:
        assert covers, f"{name}: its row names no make test test"
        assert set(covers) <= core, f"{name}: covered by tests make test does not run: {sorted(set(covers) - core)}"
