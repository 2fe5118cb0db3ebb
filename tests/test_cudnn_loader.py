"""Finding and loading libcudnn: lazy import, the search order, failures that list what was tried."""

from __future__ import annotations

import ctypes
import subprocess
import os
import shutil
import sys
import traceback
import types
from pathlib import Path

import pytest

import wsarena.cudnn as cudnn
from wsarena.errors import BackendUnavailableError
from wsarena.cudnn import _library, _prototypes

_info = cudnn.library_info()
needs_cudnn = pytest.mark.skipif(not _info["found"], reason=f"libcudnn not loadable: {_info['error']}")
REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False, timeout=120
    )


@needs_cudnn
def test_import_does_not_load_libcudnn():
    code = (
        "import wsarena, wsarena.cudnn, wsarena.cudnn.conv, wsarena.cudnn.descriptors, wsarena.cudnn.handle\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert 'libcudnn' not in maps, 'loaded at import'\n"
        "info = wsarena.cudnn.library_info()\n"
        "assert info['found'], info\n"
        "assert 'libcudnn' in open('/proc/self/maps').read(), 'the check itself is blind'\n"
        "print('ok')\n"
    )
    result = _run(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_import_pulls_in_no_array_library():
    result = _run("import sys, wsarena.cudnn; print(sorted(m for m in ('numpy', 'cupy') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@needs_cudnn
def test_loaded_library_is_cached_and_described():
    loaded = _library.load_library()
    assert _library.load_library() is loaded
    assert loaded.version // 10000 == 9
    assert Path(loaded.path).name == "libcudnn.so.9" and Path(loaded.path).is_file()
    assert loaded.found_via.startswith("cuda.pathfinder") or loaded.found_via in (
        "site-packages", "system loader", "CUDNN_PATH"
    )
    info = cudnn.library_info()
    assert info["found"] and info["error"] is None
    assert info["version"] == loaded.version and info["path"] == loaded.path
    assert info["version_string"] == loaded.version_string == cudnn._library._version_string(loaded.version)
    assert info["cudart_version"] and info["cudart_version"] >= 12000
    assert cudnn.cudnn_info is cudnn.library_info


@needs_cudnn
def test_get_property_agrees_with_the_version():
    loaded = _library.load_library()
    parts = [cudnn.get_property(p) for p in cudnn.LibraryProperty]
    assert parts[0] * 10000 + parts[1] * 100 + parts[2] == loaded.version


def test_version_strings():
    assert _library._version_string(92800) == "9.28.0"
    assert _library._version_string(90100) == "9.1.0"
    assert _library._version_string(8907) == "8.9.7"


@pytest.fixture
def fresh_search(monkeypatch):
    """A loader that has found nothing yet; the real state comes back afterwards."""
    saved = (_library._loaded, _library._failure)
    saved_bound = dict(_prototypes._bound)
    _library._reset()
    yield monkeypatch
    monkeypatch.undo()
    with _library._lock:
        _library._loaded, _library._failure = saved
    _prototypes._bound.clear()
    _prototypes._bound.update(saved_bound)


def test_not_found_lists_every_place_tried(fresh_search, tmp_path):
    import cuda.pathfinder

    def not_found(name):
        raise RuntimeError(f"pretend {name} is not installed")

    fresh_search.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", not_found)
    fresh_search.setattr(_library, "_wheel_lib_dirs", lambda: [tmp_path / "wheel" / "lib"])
    fresh_search.setattr(_library, "LIBRARY_NAME", "libcudnn_wsarena_test_absent.so.9")
    fresh_search.setenv("CUDNN_PATH", str(tmp_path / "cudnn_root"))
    with pytest.raises(cudnn.CudnnNotFoundError) as info:
        _library.load_library()
    err = info.value
    assert isinstance(err, BackendUnavailableError)
    places = [place for place, _ in err.tried]
    assert len(err.tried) == 4
    assert "cuda.pathfinder" in places[0] and "pretend cudnn is not installed" in err.tried[0][1]
    assert str(tmp_path / "wheel" / "lib") in err.tried[1][1]
    assert "libcudnn_wsarena_test_absent.so.9" in places[2]
    assert str(tmp_path / "cudnn_root") in places[3] and "no such file" in err.tried[3][1]
    message = str(err)
    for place, why in err.tried:
        assert place in message and why in message
    # The failure is cached: the same error again, without searching.
    fresh_search.setattr(_library, "SEARCH_STEPS", [])
    depths = []
    for _ in range(3):
        with pytest.raises(cudnn.CudnnNotFoundError) as again:
            _library.load_library()
        assert again.value is err
        depths.append(len(traceback.extract_tb(again.value.__traceback__)))
    assert depths[0] == depths[1] == depths[2]  # raising it again does not pile up tracebacks
    # Everything that needs the library reports the same error; library_info() reports it without raising.
    with pytest.raises(cudnn.CudnnNotFoundError):
        cudnn.bind_all()
    info_dict = cudnn.library_info()
    assert info_dict["found"] is False and "libcudnn.so.9 could not be loaded" in info_dict["error"]
    assert len(info_dict["tried"]) == 4


def _lone_shim_expectation(env: dict | None = None) -> str:
    """What library_info() of a shim copied without its sub-libraries reports: a miss naming the sub-library,
    unless this machine's library path has libcudnn_graph.so.9 (a system cuDNN, as on some GPU machines): then
    the lone shim loads its sub-libraries from there and is found."""
    probe_graph = "import ctypes\ntry:\n    ctypes.CDLL('libcudnn_graph.so.9')\nexcept OSError:\n    print('no')\n"
    result = subprocess.run([sys.executable, "-c", probe_graph], capture_output=True, text=True, env=env,
                            check=True, timeout=60)
    if result.stdout.strip() == "no":
        return "False loaded, but its sub-library libcudnn_graph.so.9 cannot be loaded"
    return "True"


_PRINT_OUTCOME = "print(info['found'], *(info['tried'][0][1:] if not info['found'] else []))\n"


@needs_cudnn
def test_a_shim_without_its_sub_libraries_is_a_miss_not_an_abort(tmp_path):
    # A copy of the shim alone (a broken install): cuDNN itself would abort() the process in cudnnGetVersion.
    (tmp_path / "lib").mkdir()
    shutil.copy(_info["path"], tmp_path / "lib" / "libcudnn.so.9")
    code = (
        "import os, wsarena.cudnn as c\n"
        "from wsarena.cudnn import _library\n"
        "_library.SEARCH_STEPS[:] = [s for s in _library.SEARCH_STEPS if s[0] == 'CUDNN_PATH']\n"
        f"os.environ['CUDNN_PATH'] = {str(tmp_path)!r}\n"
        "info = c.library_info()\n" + _PRINT_OUTCOME
    )
    result = _run(code)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.startswith(_lone_shim_expectation())


@needs_cudnn
def test_a_symlinked_shim_without_its_sub_libraries_is_a_miss_too(tmp_path):
    # The usual system install: libcudnn.so.9 -> libcudnn.so.9.x.y, found by the loader's own search.
    shutil.copy(_info["path"], tmp_path / "libcudnn.so.9.99.0")
    (tmp_path / "libcudnn.so.9").symlink_to("libcudnn.so.9.99.0")
    code = (
        "import wsarena.cudnn as c\n"
        "from wsarena.cudnn import _library\n"
        "_library.SEARCH_STEPS[:] = [s for s in _library.SEARCH_STEPS if s[0] == 'system loader']\n"
        "info = c.library_info()\n" + _PRINT_OUTCOME
    )
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                            check=False, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.startswith(_lone_shim_expectation(env))


def test_unset_cudnn_path_is_reported(fresh_search):
    fresh_search.delenv("CUDNN_PATH", raising=False)
    fresh_search.setattr(_library, "SEARCH_STEPS", [("CUDNN_PATH", _library._via_cudnn_path)])
    with pytest.raises(cudnn.CudnnNotFoundError, match="CUDNN_PATH is not set"):
        _library.load_library()


def test_wrong_major_version(fresh_search):
    old = types.SimpleNamespace(cudnnGetVersion=lambda: 8907)
    fresh_search.setattr(_library, "SEARCH_STEPS", [("fake", lambda: (old, "/opt/fake/libcudnn.so.8", "fake"))])
    with pytest.raises(cudnn.CudnnVersionError, match=r"8\.9\.7.*needs cuDNN 9"):
        _library.load_library()


@needs_cudnn
def test_search_falls_through_to_a_later_step(fresh_search):
    def broken():
        raise _library._Miss("first place", "nothing here")

    fresh_search.setattr(_library, "SEARCH_STEPS", [("first", broken), ("site-packages", _library._via_wheel)])
    loaded = _library.load_library()
    assert loaded.found_via == "site-packages" and loaded.version // 10000 == 9


@needs_cudnn
def test_system_loader_reports_the_real_path(fresh_search):
    lib = ctypes.CDLL(_info["path"])
    assert _library._path_of(lib, "fallback") == str(Path(_info["path"]).resolve())


@needs_cudnn
def test_missing_symbol_is_a_typed_error_naming_it(fresh_search):
    fresh_search.setitem(_prototypes.PROTOTYPES, "cudnnWsarenaNoSuchFunction", (ctypes.c_int, ()))
    with pytest.raises(cudnn.CudnnSymbolError, match="cudnnWsarenaNoSuchFunction") as info:
        _prototypes.function("cudnnWsarenaNoSuchFunction")
    assert isinstance(info.value, BackendUnavailableError) and isinstance(info.value, AttributeError)
    with pytest.raises(cudnn.CudnnSymbolError, match="cudnnWsarenaNoSuchFunction"):
        cudnn.bind_all()
    _prototypes.function("cudnnGetVersion")  # the others still bind
