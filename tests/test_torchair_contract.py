"""Contract between our ``CompilerConfig`` mapping and the real torchair configs.

torchair ships inside the torch_npu wheel (``torch_npu/dynamo/torchair/``) and cannot be imported without CANN,
so the network test downloads the wheel (download only, never installed), extracts the few pure-Python files that
``torchair.configs.compiler_config`` needs, and loads them under a synthetic top-level ``torchair`` package.
Every option that ``compiler_config_settings`` produces is then set on a real ``CompilerConfig()``; torchair's
``OptionValue`` setters validate values, so an unknown option or a value outside the allowed list raises.

Mode support in the real sources (``CompilerConfig.mode``'s allowed list):
  torch_npu 2.1 - 2.6:   "max-autotune", "reduce-overhead"
  torch_npu 2.7.1 - 2.14: "max-autotune", "reduce-overhead", "npugraph_ex"
In 2.14 "reduce-overhead" is still accepted (torchair treats it exactly like "npugraph_ex") but warns that it
will be deprecated in favour of "npugraph_ex", so each mode maps to itself.
"""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

from ascend_spec.config import GRAPH_MODES
from ascend_spec.graph.backends import BackendUnavailable
from ascend_spec.graph.backends.torchair import (
    _MODE_ALIASES,
    TorchairBackend,
    TorchairOptions,
    apply_settings,
    compiler_config_settings,
)

TORCH_NPU_VERSION = "2.14.0"
#: Newer torch_npu wheels are tagged manylinux_2_28, older ones manylinux_2_17; the config sources are the same.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64")
TORCHAIR_PREFIX = "torch_npu/dynamo/torchair/"
#: What ``configs/compiler_config.py`` imports beyond ``torchair.configs`` itself:
#: ``_utils/error_code.py`` (``pretty_error_msg``) and ``core/utils.py`` (``logger``); both are pure Python.
EXTRA_FILES = ("_utils/error_code.py", "core/utils.py")


def _cache_dir() -> Path:
    root = os.environ.get("ASCEND_SPEC_CACHE") or Path.home() / ".cache" / "ascend-spec"
    return Path(root) / "torch_npu-wheel"


def _download_wheel() -> Path:
    cache = _cache_dir()
    pattern = f"torch_npu-{TORCH_NPU_VERSION}-cp311-*.whl"
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    errors = []
    for platform in PLATFORMS:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"torch_npu=={TORCH_NPU_VERSION}",
               "--python-version", "3.11", "--platform", platform, "--only-binary=:all:", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        found = sorted(cache.glob(pattern))
        if proc.returncode == 0 and found:
            return found[0]
        errors.append(f"$ {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    pytest.fail(f"could not download torch_npu=={TORCH_NPU_VERSION} (needs the package index):\n"
                + "\n".join(errors))


def _extract_configs(wheel: Path, dest: Path) -> Path:
    """Extract only ``configs/*.py`` and ``EXTRA_FILES``; returns the ``torchair`` folder."""
    root = dest / "torchair"
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(TORCHAIR_PREFIX)]
        wanted = [n for n in names if n.startswith(TORCHAIR_PREFIX + "configs/") and n.endswith(".py")]
        wanted += [TORCHAIR_PREFIX + f for f in EXTRA_FILES if TORCHAIR_PREFIX + f in names]
        assert any(n.endswith("configs/compiler_config.py") for n in wanted), f"no torchair configs in {wheel.name}"
        for name in wanted:
            target = root / name[len(TORCHAIR_PREFIX):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
    return root


@pytest.fixture(scope="module")
def torchair_configs(tmp_path_factory):
    """The real ``torchair.configs`` modules, loaded without importing torch_npu.

    Only the package initializers are bypassed, nothing is stubbed: ``torchair/__init__.py`` (imports torch_npu
    and the compiled ``.so`` extensions) and ``torchair/_utils/__init__.py`` (patches torch._dynamo internals)
    are replaced by empty packages whose ``__path__`` points at the extracted folders. ``configs/`` and ``core/``
    have no ``__init__.py`` in the wheel and load as namespace packages.
    """
    root = _extract_configs(_download_wheel(), tmp_path_factory.mktemp("torchair_src"))
    saved = {k: v for k, v in sys.modules.items() if k == "torchair" or k.startswith("torchair.")}
    logger_class = logging.getLoggerClass()  # core/utils.py calls logging.setLoggerClass at import
    for name, path in (("torchair", root), ("torchair._utils", root / "_utils")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    try:
        compiler_config = importlib.import_module("torchair.configs.compiler_config")
        option_base = importlib.import_module("torchair.configs._option_base")
        yield types.SimpleNamespace(CompilerConfig=compiler_config.CompilerConfig,
                                    OptionValue=option_base.OptionValue, NpuBaseConfig=option_base.NpuBaseConfig)
    finally:
        logging.setLoggerClass(logger_class)
        for k in [k for k in sys.modules if k == "torchair" or k.startswith("torchair.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def _resolve(config, dotted: str):
    *parents, leaf = dotted.split(".")
    target = config
    for p in parents:
        target = getattr(target, p)
    return target, leaf


def _as_torchair_value(v) -> str:
    """How ``OptionValue.value`` reports a value: booleans as "1"/"0", everything else as ``str``."""
    return "1" if v is True else "0" if v is False else str(v)


ALL_OPTIONS = [
    TorchairOptions(mode=mode, frozen_parameter=fp, view_optimize=vo, tiling_schedule_optimize=ts)
    for mode, fp, vo, ts in itertools.product(sorted(_MODE_ALIASES), (True, False), (True, False), (True, False))
]


def test_allowed_modes_all_mapped():
    assert set(GRAPH_MODES) <= set(_MODE_ALIASES)


@pytest.mark.network
def test_every_setting_is_a_validated_option(torchair_configs):
    """Each dotted path exists on a fresh ``CompilerConfig`` and is an ``OptionValue`` under a config node, so
    assignments go through torchair's validating setter."""
    config = torchair_configs.CompilerConfig()
    for dotted in compiler_config_settings(TorchairOptions()):
        target, leaf = _resolve(config, dotted)
        assert isinstance(target, torchair_configs.NpuBaseConfig), dotted
        assert isinstance(getattr(target, leaf, None), torchair_configs.OptionValue), f"{dotted} is not an option"


@pytest.mark.network
@pytest.mark.parametrize("opts", ALL_OPTIONS,
                         ids=lambda o: f"{o.mode}-fp{int(o.frozen_parameter)}-vo{int(o.view_optimize)}"
                                       f"-ts{int(o.tiling_schedule_optimize)}")
def test_settings_accepted_by_real_compiler_config(torchair_configs, opts):
    settings = compiler_config_settings(opts)
    config = apply_settings(torchair_configs.CompilerConfig(), settings)
    for dotted, value in settings.items():
        target, leaf = _resolve(config, dotted)
        assert getattr(target, leaf).value == _as_torchair_value(value), dotted
    assert config.mode.value == _MODE_ALIASES[opts.mode]


@pytest.mark.network
@pytest.mark.parametrize("dotted, bad", [
    ("mode", "no-such-mode"),
    ("experimental_config.frozen_parameter", "yes"),
    ("experimental_config.enable_view_optimize", None),
    ("experimental_config.no_such_option", True),
    ("no_such_section.frozen_parameter", True),
])
def test_contract_check_can_fail(torchair_configs, dotted, bad):
    """Bad values and unknown options raise, so the acceptance test above really checks something."""
    with pytest.raises((ValueError, AttributeError)):
        apply_settings(torchair_configs.CompilerConfig(), {dotted: bad})


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")
def test_backend_unavailable_without_torch_npu():
    with pytest.raises(BackendUnavailable) as exc_info:
        TorchairBackend(TorchairOptions())
    msg = str(exc_info.value)
    assert "torch_npu" in msg and "CANN" in msg and "inductor" in msg
