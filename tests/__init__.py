"""The test suite (pytest). Imported before any test module, so before torch loads OpenMP."""
import os

# Idle OpenMP threads sleep instead of spinning: the suite runs two test workers and their engine subprocesses side
# by side on a few cores, where spinning threads burn the cores the others wait for (docs/test-suite.md). The thread
# count, and so every graph's cache key, stays as it is; subprocesses inherit the setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
