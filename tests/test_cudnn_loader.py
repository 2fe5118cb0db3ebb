"""Finding and loading libcudnn: lazy import, the search order, failures that list what was tried."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import traceback
import types
from pathlib import Path

import pytest

from wsarena import cudnn
from wsarena.cudnn import _library, _prototypes
from wsarena.errors import BackendUnavailableError

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


def test_import_pulls_in_no_array_library_but_numpy():
    """NumPy comes with ``import wsarena`` (the CPU path); the bindings themselves need no array library."""
    result = _run("import sys, wsarena.cudnn; print(sorted(m for m in ('cupy', 'torch', 'jax') if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@needs_cudnn
def test_loaded_library_is_cached_and_described():
    loaded = _library.load_library()
    assert _library.load_library() is loaded
    assert loaded.version // 10000 == 9
    assert Path(loaded.path).name == "libcudnn.so.9" and Path(loaded.path).is_file()
    assert loaded.found_via == "CUDNN_PATH" or loaded.found_via.startswith("cuda.pathfinder (")
    info = cudnn.library_info()
    assert info["found"] and info["error"] is None
    assert info["version"] == loaded.version and info["path"] == loaded.path
    assert info["version_string"] == loaded.version_string == cudnn._library._version_string(loaded.version)
    assert info["cudart_version"] and info["cudart_version"] >= 12000


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
    fresh_search.setenv("CUDNN_PATH", str(tmp_path / "cudnn_root"))
    with pytest.raises(cudnn.CudnnNotFoundError) as info:
        _library.load_library()
    err = info.value
    assert isinstance(err, BackendUnavailableError)
    places = [place for place, _ in err.tried]
    assert len(err.tried) == 2
    assert str(tmp_path / "cudnn_root" / "lib") in places[0] and str(tmp_path / "cudnn_root" / "lib64") in places[0]
    assert err.tried[0][1] == "no such file"
    assert "cuda.pathfinder" in places[1] and "pretend cudnn is not installed" in err.tried[1][1]
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
    assert len(info_dict["tried"]) == 2


def _lone_shim_expectation() -> str:
    """What library_info() of a shim copied without its sub-libraries reports: a miss naming the sub-library,
    unless this machine's library path has libcudnn_graph.so.9 (a system cuDNN, as on some GPU machines): then
    the lone shim loads its sub-libraries from there and is found."""
    probe_graph = "import ctypes\ntry:\n    ctypes.CDLL('libcudnn_graph.so.9')\nexcept OSError:\n    print('no')\n"
    result = subprocess.run([sys.executable, "-c", probe_graph], capture_output=True, text=True, check=True,
                            timeout=60)
    if result.stdout.strip() == "no":
        return "False loaded, but its sub-library libcudnn_graph.so.9 cannot be loaded"
    return "True"


def _assert_the_lone_shim_is_a_miss(step: str, setup: str) -> None:
    """In a fresh process that runs ``setup`` and keeps the search step ``step`` alone, library_info() finds a
    lone shim: the process goes on, and reports what :func:`_lone_shim_expectation` says."""
    code = (
        "import ctypes, os, wsarena.cudnn as c\n"
        "from wsarena.cudnn import _library\n"
        + setup
        + f"_library.SEARCH_STEPS[:] = [s for s in _library.SEARCH_STEPS if s[0] == {step!r}]\n"
        "info = c.library_info()\n"
        "print(info['found'], *(info['tried'][0][1:] if not info['found'] else []))\n"
    )
    result = _run(code)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.startswith(_lone_shim_expectation())


@needs_cudnn
def test_a_shim_without_its_sub_libraries_is_a_miss_not_an_abort(tmp_path):
    # A copy of the shim alone (a broken install): cuDNN itself would abort() the process in cudnnGetVersion.
    (tmp_path / "lib").mkdir()
    shutil.copy(_info["path"], tmp_path / "lib" / "libcudnn.so.9")
    _assert_the_lone_shim_is_a_miss("CUDNN_PATH", f"os.environ['CUDNN_PATH'] = {str(tmp_path)!r}\n")


@needs_cudnn
def test_a_lone_shim_loaded_by_someone_else_is_a_miss_too(tmp_path):
    # Another package loaded a shim by its versioned file name; cuda.pathfinder returns that copy as already loaded.
    shutil.copy(_info["path"], tmp_path / "libcudnn.so.9.99.0")
    _assert_the_lone_shim_is_a_miss("cuda.pathfinder", f"ctypes.CDLL({str(tmp_path / 'libcudnn.so.9.99.0')!r})\n")


@needs_cudnn
def test_cudnn_path_comes_before_cuda_pathfinder(tmp_path):
    # A fresh process where both would work: $CUDNN_PATH/lib holds the wheel's libraries (as links), and the
    # wheel itself is what cuda.pathfinder would find.
    (tmp_path / "lib").mkdir()
    for lib in Path(_info["path"]).parent.glob("libcudnn*.so.9"):
        (tmp_path / "lib" / lib.name).symlink_to(lib)
    code = ("import wsarena.cudnn as c\ninfo = c.library_info()\n"
            "print(info['found_via'], info['path'], info['version'])\n")
    env = {**os.environ, "CUDNN_PATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                            check=False, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.split() == ["CUDNN_PATH", str(tmp_path / "lib" / "libcudnn.so.9"), str(_info["version"])]


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
def test_an_empty_cudnn_path_falls_through_to_cuda_pathfinder(fresh_search, tmp_path):
    fresh_search.setenv("CUDNN_PATH", str(tmp_path))
    loaded = _library.load_library()
    assert loaded.found_via.startswith("cuda.pathfinder (") and loaded.version // 10000 == 9
    assert loaded.path == _info["path"]


@needs_cudnn
def test_cudnn_path_defers_to_the_copy_already_loaded(fresh_search, tmp_path):
    # This process has loaded the wheel's libcudnn; a second copy from $CUDNN_PATH would bind its sub-libraries.
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libcudnn.so.9").symlink_to(_info["path"])
    fresh_search.setenv("CUDNN_PATH", str(tmp_path))
    with pytest.raises(_library._Miss, match="already loaded in this process"):
        _library._via_cudnn_path()
    loaded = _library.load_library()
    assert loaded.found_via.startswith("cuda.pathfinder (") and loaded.path == _info["path"]


@needs_cudnn
def test_a_cuda_pathfinder_result_without_a_path_uses_the_loaded_copy(fresh_search):
    import cuda.pathfinder

    unnamed = cuda.pathfinder.LoadedDL(None, True, 0, "was-already-loaded-from-elsewhere")
    fresh_search.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", lambda name: unnamed)
    fresh_search.setattr(_library, "SEARCH_STEPS", [("cuda.pathfinder", _library._via_pathfinder)])
    loaded = _library.load_library()
    assert loaded.found_via == "cuda.pathfinder (was-already-loaded-from-elsewhere)"
    assert loaded.path == "libcudnn.so.9" and loaded.version == _info["version"]
    assert loaded.cdll._handle == ctypes.CDLL(_info["path"])._handle  # the very copy this process has


def test_a_cuda_pathfinder_result_without_a_path_or_a_loaded_copy_is_a_miss(fresh_search):
    import cuda.pathfinder

    unnamed = cuda.pathfinder.LoadedDL(None, True, 0, "was-already-loaded-from-elsewhere")
    fresh_search.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", lambda name: unnamed)
    fresh_search.setattr(_library, "LIBRARY_NAME", "libcudnn_wsarena_test_absent.so.9")
    fresh_search.setattr(_library, "SEARCH_STEPS", [("cuda.pathfinder", _library._via_pathfinder)])
    with pytest.raises(cudnn.CudnnNotFoundError, match="without a path, and no libcudnn_wsarena_test_absent"):
        _library.load_library()


@needs_cudnn
def test_missing_symbol_is_a_typed_error_naming_it(fresh_search):
    fresh_search.setitem(_prototypes.PROTOTYPES, "cudnnWsarenaNoSuchFunction", (ctypes.c_int, ()))
    with pytest.raises(cudnn.CudnnSymbolError, match="cudnnWsarenaNoSuchFunction") as info:
        _prototypes.function("cudnnWsarenaNoSuchFunction")
    assert isinstance(info.value, BackendUnavailableError) and isinstance(info.value, AttributeError)
    with pytest.raises(cudnn.CudnnSymbolError, match="cudnnWsarenaNoSuchFunction"):
        cudnn.bind_all()
    _prototypes.function("cudnnGetVersion")  # the others still bind
