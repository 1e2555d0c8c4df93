"""The on-disk cache of compiled graphs: folder rules, keys, entry validation, warm loads, ``ascend-spec cache``.

Compiles one tiny function (an extern ``addmm``: no C++ kernel to build) with each test's own inductor cache
folder and a fresh artifact recorder, and resets Dynamo after, so nothing leaks into other tests.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import clear_caches
from torch.compiler._cache import CacheArtifactManager

from ascend_spec.cli import main
from ascend_spec.graph.backends import compile_cache as cc
from ascend_spec.graph.backends.compile_cache import (CacheDirError, CacheKey, CompileCache, cache_root,
                                                      graph_code_digest, open_default_cache)

KEY = CacheKey(what="tiny_addmm", model_config={"hidden_size": 8, "layers": 1}, backend="inductor",
               backend_options={"dynamic": False})
OTHER_KEY = CacheKey(what="tiny_addmm", model_config={"hidden_size": 16, "layers": 1}, backend="inductor",
                     backend_options={"dynamic": False})


def _addmm(b: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.addmm(b, x, w)


def _compile_and_check() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    args = (torch.randn(8), torch.randn(4, 8), torch.randn(8, 8))
    out = torch.compile(_addmm, fullgraph=True, dynamic=False)(*args)
    torch.testing.assert_close(out, _addmm(*args))


def _use_inductor_dir(mp: pytest.MonkeyPatch, path: Path) -> None:
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    clear_caches()  # drop torch's memoised paths and loaded modules of the previous folder
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cc.ENV_DISABLE, raising=False)
    _use_inductor_dir(monkeypatch, tmp_path / "inductor")
    counters.clear()
    with CacheArtifactManager.with_fresh_cache():
        yield
    torch._dynamo.reset()
    clear_caches()


@pytest.fixture(scope="module")
def saved_entry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real entry for KEY: one cold compile in its own inductor folder, then ``save``."""
    base = tmp_path_factory.mktemp("compile_cache")
    with pytest.MonkeyPatch.context() as mp, CacheArtifactManager.with_fresh_cache():
        _use_inductor_dir(mp, base / "inductor")
        _compile_and_check()
        path = CompileCache(base / "cache").save(KEY)
    torch._dynamo.reset()
    clear_caches()
    assert path is not None
    return path


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- the folder


def test_root_resolution_order_and_private_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "explicit"
    monkeypatch.delenv(cc.ENV_CACHE_DIR)
    assert cache_root() == tmp_path / "xdg" / "ascend-spec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == tmp_path / "home" / ".cache" / "ascend-spec"
    for root in (tmp_path / "explicit", tmp_path / "xdg" / "ascend-spec", tmp_path / "home" / ".cache" / "ascend-spec"):
        assert stat.S_IMODE(root.stat().st_mode) == 0o700, root


def test_folder_others_can_write_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture, capsys) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(shared))
    with pytest.raises(CacheDirError, match=rf"{shared}.*mode 0777.*chmod 700"):
        cache_root()
    # The engine's entry point runs without the cache, with one warning.
    caplog.set_level(logging.WARNING)
    assert open_default_cache() is None
    assert len(_warnings(caplog)) == 1 and str(shared) in _warnings(caplog)[0]
    # The CLI reports the error.
    assert main(["cache", "info"]) == 2
    assert str(shared) in capsys.readouterr().err


def test_open_default_cache_points_inductor_into_the_root_only_when_unset(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cc.ENV_DISABLE, "1")
    assert open_default_cache() is None
    monkeypatch.delenv(cc.ENV_DISABLE)
    assert open_default_cache() is not None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")  # set by the user: kept
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    cache = open_default_cache()
    assert cache is not None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.root / "inductor")
    assert stat.S_IMODE((cache.root / "inductor").stat().st_mode) == 0o700


# --------------------------------------------------------------------------- the key


def test_key_digest_covers_every_part_and_rejects_bad_values(tmp_path: Path) -> None:
    assert len(KEY.digest) == 24 and int(KEY.digest, 16) >= 0
    assert KEY.graph_code == graph_code_digest() and KEY.torch_version == torch.__version__
    same = CacheKey(what="tiny_addmm", model_config={"layers": 1, "hidden_size": 8}, backend="inductor",
                    backend_options={"dynamic": False})
    assert same == KEY and same.digest == KEY.digest
    changes = {"what": "other", "model_config": {"hidden_size": 9}, "backend": "torchair",
               "backend_options": {"dynamic": True}, "graph_code": "0" * 24, "torch_version": "9.9",
               "python_version": "3.99.0"}
    digests = {CacheKey(**{**KEY.__dict__, name: value}).digest for name, value in changes.items()}
    assert len(digests) == len(changes) and KEY.digest not in digests
    with pytest.raises(ValueError, match="what='bad label'"):
        CacheKey(what="bad label", model_config={}, backend="inductor")
    with pytest.raises(ValueError, match="model_config.*not JSON-able"):
        CacheKey(what="x", model_config={"dtype": torch.float32}, backend="inductor")


def test_graph_code_digest_follows_the_sources(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    before = cc.digest_sources(tmp_path)
    assert cc.digest_sources(tmp_path) == before
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert cc.digest_sources(tmp_path) != before
    assert graph_code_digest() == cc.digest_sources(Path(cc.__file__).resolve().parent.parent)


# --------------------------------------------------------------------------- save / load


def test_saved_entry_is_private_and_self_describing(saved_entry: Path) -> None:
    assert stat.S_IMODE(saved_entry.stat().st_mode) == 0o600
    assert saved_entry.name == f"{KEY.digest}.bin"
    blob = saved_entry.read_bytes()
    assert blob.startswith(cc.MAGIC)
    assert len(cc.decode_entry(blob, KEY)) > 0
    [info] = CompileCache(saved_entry.parent).entries()
    assert (info.what, info.problem, info.size) == ("tiny_addmm", None, len(blob))


def test_save_writes_nothing_when_nothing_was_compiled() -> None:
    cache = CompileCache()
    assert cache.save(KEY) is None
    assert cache.entries() == []


def test_warm_load_hits_the_fx_graph_cache(saved_entry: Path, tmp_path: Path) -> None:
    cache = CompileCache()
    shutil.copy(saved_entry, cache.path_for(KEY))
    fresh = tmp_path / "inductor"  # this test's inductor folder: nothing compiled into it yet
    assert not (fresh / "fxgraph").exists()
    assert cache.load(KEY)
    assert any((fresh / "fxgraph").rglob("*")), "load wrote no FX-graph entry into inductor's cache"
    _compile_and_check()
    assert counters["inductor"]["fxgraph_cache_hit"] > 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    # Saving after a warm run keeps a loadable entry.
    assert cache.save(KEY) == cache.path_for(KEY)
    assert len(cc.decode_entry(cache.path_for(KEY).read_bytes(), KEY)) > 0


def test_around_warmup_loads_before_and_saves_after() -> None:
    cache = CompileCache()
    with cache.around_warmup(KEY) as hit:
        assert hit is False
        _compile_and_check()
    assert cache.path_for(KEY).is_file()
    torch._dynamo.reset()
    with cache.around_warmup(KEY) as hit:
        assert hit is True


def _corrupt(path: Path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) - 100] ^= 0xFF  # inside the payload
    path.write_bytes(bytes(blob))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _not_torch(path: Path) -> None:
    path.write_bytes(cc.encode_entry(KEY, b"not torch cache artifacts"))  # checksum fine, payload unloadable


@pytest.mark.parametrize("damage, key, reason", [
    (_corrupt, KEY, "corrupt"),
    (_truncate, KEY, "truncated"),
    (None, OTHER_KEY, "foreign"),  # a valid entry renamed to another key's digest
    (_not_torch, KEY, "torch could not load"),
])
def test_bad_entry_warns_once_is_removed_and_recompiles(saved_entry: Path, damage, key: CacheKey, reason: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    cache = CompileCache()
    path = cache.path_for(key)
    shutil.copy(saved_entry, path)
    if damage is not None:
        damage(path)
    caplog.set_level(logging.WARNING)
    caplog.clear()
    assert cache.load(key) is False
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0] and reason in warnings[0]
    assert not path.exists()
    _compile_and_check()
    assert counters["inductor"]["fxgraph_cache_hit"] == 0  # nothing was loaded: a real compile


def test_missing_entry_is_a_quiet_miss(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert CompileCache().load(KEY) is False
    assert _warnings(caplog) == []


# --------------------------------------------------------------------------- ascend-spec cache info|clear


def test_cli_info_and_clear(saved_entry: Path, capsys) -> None:
    cache = CompileCache()
    shutil.copy(saved_entry, cache.path_for(KEY))
    (cache.root / "inductor").mkdir(mode=0o700)
    (cache.root / "inductor" / "kernel.so").write_bytes(b"\0" * 4096)
    size = saved_entry.stat().st_size

    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert str(cache.root) in out and KEY.digest in out and "tiny_addmm" in out and "total: 1 entries" in out

    assert main(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["root"] == str(cache.root)
    assert [(e["what"], e["size_bytes"], e["problem"]) for e in info["entries"]] == [("tiny_addmm", size, None)]
    assert info["inductor_bytes"] == 4096 and info["total_bytes"] == size + 4096

    shutil.copy(saved_entry, cache.path_for(OTHER_KEY))  # info spots a renamed entry without loading it
    assert main(["cache", "info", "--json"]) == 0
    problems = {e["digest"]: e["problem"] for e in json.loads(capsys.readouterr().out)["entries"]}
    assert problems[KEY.digest] is None and problems[OTHER_KEY.digest].startswith("foreign entry")

    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert f"removed {cache.path_for(KEY)}" in out and f"removed {cache.path_for(OTHER_KEY)}" in out
    assert "inductor working cache" in out
    assert cache.entries() == [] and not (cache.root / "inductor").exists()
    assert main(["cache", "info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_bytes"] == 0
