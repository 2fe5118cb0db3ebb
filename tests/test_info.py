"""`wsarena info`: PyTorch's version and the settings in force, each with where it comes from."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

import wsarena
from wsarena._config import _ENV, Config, unknown_variables
from wsarena.info import collect_info, render_info

from .cli_helpers import run_cli


def _setting_lines(text: str) -> dict[str, str]:
    """The settings block of ``wsarena info``'s text: each setting's name and what its line shows."""
    lines = text.splitlines()
    start = lines.index("settings (and where each comes from):")
    block = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return dict(line.split(None, 1) for line in block)


def _unknown_lines(text: str) -> list[str]:
    """The block of ``wsarena info``'s text that names the variables no setting reads, each line stripped."""
    lines = text.splitlines()
    start = lines.index("environment variables not read by the wsarena package:")
    return [line.strip() for line in lines[start + 1:]]


def test_info_shows_every_setting_its_value_and_where_it_comes_from(monkeypatch, tmp_path):
    """It showed none of them: the cap, the allocator or the API path in force could not be told from it."""
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "256MiB")
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path))
    wsarena.configure(allocator="cupy", cudnn_api="legacy")
    settings = collect_info()["settings"]
    assert list(settings) == [f.name for f in dataclasses.fields(Config)]
    assert settings["cap_workspace"] == {"value": 256 << 20, "source": "environment", "error": None}
    assert settings["cache_dir"] == {"value": str(tmp_path), "source": "environment", "error": None}
    assert settings["allocator"] == {"value": "cupy", "source": "configure", "error": None}
    assert settings["cudnn_api"] == {"value": "legacy", "source": "configure", "error": None}
    defaults = Config()
    for name in ("algo_search", "backend", "cudnn_heuristic", "plan_cache_size", "debug", "search_cache_max_size"):
        assert settings[name] == {"value": getattr(defaults, name), "source": "default", "error": None}, name
    shown = _setting_lines(render_info(collect_info()))
    assert shown["cap_workspace"] == "256 MiB (environment)"
    assert shown["allocator"] == "cupy (configure)" and shown["cudnn_api"] == "legacy (configure)"
    assert shown["search_cache_max_size"] == "64 MiB (default)" and shown["debug"] == "off (default)"
    assert shown["cache_dir"] == f"{tmp_path} (environment)"
    with wsarena.config(cap_workspace=0, cache_dir=None):
        shown = _setting_lines(render_info(collect_info()))
    assert shown["cap_workspace"] == "0 B (config)" and shown["cache_dir"] == "off (config)"
    assert shown["allocator"] == "cupy (configure)"


def test_info_shows_the_sizes_in_force_as_the_settings_take_them_back(monkeypatch):
    """Exactly: format_size's "3.91 KiB" for 4000 bytes is no whole number of bytes, which the settings refuse, and
    its "1 MiB" for 1048575 is another size."""
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "4000")
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "1048575")
    shown = _setting_lines(render_info(collect_info()))
    assert shown["cap_workspace"] == "4000 B (environment)"
    assert shown["search_cache_max_size"] == "1048575 B (environment)"
    for name, value in (("cap_workspace", 4000), ("search_cache_max_size", (1 << 20) - 1)):
        assert wsarena.parse_size(shown[name].removesuffix(" (environment)")) == value


def test_info_shows_an_invalid_variable_with_its_error_and_still_exits_0():
    """Reading the settings raises for it: info says so in place of a value, and goes on."""
    r = run_cli("info", env={"WSARENA_ALGO_SEARCH": "fastest", "WSARENA_DEBUG": "1"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    shown = _setting_lines(r.stdout)
    assert shown["algo_search"].startswith("invalid: environment variable WSARENA_ALGO_SEARCH='fastest': ")
    assert shown["debug"] == "on (environment)" and shown["backend"] == "auto (default)"
    r = run_cli("info", "--format", "json", env={"WSARENA_ALGO_SEARCH": "fastest", "WSARENA_DEBUG": "1"})
    settings = json.loads(r.stdout)["settings"]
    assert settings["algo_search"]["value"] is None and settings["algo_search"]["source"] == "environment"
    assert settings["algo_search"]["error"].startswith("environment variable WSARENA_ALGO_SEARCH='fastest': ")
    assert settings["debug"] == {"value": True, "source": "environment", "error": None}


def test_info_shows_pytorchs_version_and_build():
    """It named no PyTorch at all, which wsarena.torch needs."""
    torch = pytest.importorskip("torch")
    found = collect_info()["torch"]
    assert found == {"installed": True, "version": torch.__version__, "cuda": torch.version.cuda, "error": None}
    build = "CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    assert f"  torch            {torch.__version__} ({build})" in render_info(collect_info()).splitlines()
    r = run_cli("info", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["torch"] == found


class Broken:
    """A finder whose ``torch`` fails to import as a build missing a CUDA library does."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise OSError("libcudnn.so.9: cannot open shared object file\nmore lines of the loader")


def test_info_says_when_pytorch_is_missing_or_cannot_be_imported(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    data = collect_info()
    assert data["torch"] == {"installed": False, "version": None, "cuda": None, "error": None}
    assert "  torch            not installed" in render_info(data).splitlines()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch" else real(name, *a))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    data = collect_info()
    assert data["torch"] == {"installed": True, "version": None, "cuda": None,
                             "error": "cannot be imported: OSError: libcudnn.so.9: cannot open shared object file"}
    assert f"  torch            {data['torch']['error']}" in render_info(data).splitlines()


def test_info_writes_what_stdout_cannot_show_as_escapes_and_exits_0(tmp_path):
    """A cache folder under a home of a name the encoding has no character for, or a variable holding one, gave exit 3
    and no output at all, where info showed neither before: its settings lines are read, not parsed."""
    folder = tmp_path / "caf\xe9"
    env = {"PYTHONIOENCODING": "ascii", "WSARENA_CACHE_DIR": str(folder), "WSARENA_BACKEND": "cudnn\u2019"}
    r = run_cli("info", env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    shown = _setting_lines(r.stdout)
    assert shown["cache_dir"] == f"{tmp_path}/caf\\xe9 (environment)"
    assert shown["backend"].startswith("invalid: environment variable WSARENA_BACKEND='cudnn\\u2019': ")
    r = run_cli("info", "--format", "json", env=env)  # JSON escapes them itself
    assert r.returncode == 0 and json.loads(r.stdout)["settings"]["cache_dir"]["value"] == str(folder)


class Garbled:
    """A finder whose ``torch`` fails to import with control characters in its message."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise ImportError("libc10.so:\tundefined symbol \x1b[31m_ZN3c10\r")


def test_info_shows_control_characters_of_pytorchs_error_as_escapes(monkeypatch):
    """The line of a torch that fails to import is written as the cache folder's is: a tab or an escape sequence of
    the error's text broke the column or drove the terminal."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "torch" else real(name, *a))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Garbled(), *sys.meta_path])
    data = collect_info()
    assert data["torch"]["error"] == "cannot be imported: ImportError: libc10.so:\tundefined symbol \x1b[31m_ZN3c10"
    assert ("  torch            cannot be imported: ImportError: libc10.so:\\tundefined symbol \\x1b[31m_ZN3c10"
            in render_info(data).splitlines())


def test_info_names_a_misspelled_variable_with_the_setting_it_is_closest_to():
    """WSARENA_CAP_WORKSPCE=1GiB was ignored without a word: the user believed a cap was in force that was not, and
    info showed the cap as none (default) with nothing to say why. A variable of bench/ or the tests, which the package
    does not read either, is named too, with no setting where none is close."""
    env = {"WSARENA_CAP_WORKSPCE": "1GiB", "WSARENA_COMMIT": "abc", "Wsarena_Debug": "1",
           "WSARENA_ALGO_SEARCH": "exhaustive"}
    r = run_cli("info", env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert _setting_lines(r.stdout)["cap_workspace"] == "none (default)"
    assert _setting_lines(r.stdout)["algo_search"] == "exhaustive (environment)"
    assert _unknown_lines(r.stdout) == ["WSARENA_CAP_WORKSPCE  (did you mean WSARENA_CAP_WORKSPACE?)",
                                        "WSARENA_COMMIT", "Wsarena_Debug  (did you mean WSARENA_DEBUG?)"]
    r = run_cli("info", "--format", "json", env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout)["unknown_variables"] == [
        {"name": "WSARENA_CAP_WORKSPCE", "closest": "WSARENA_CAP_WORKSPACE"},
        {"name": "WSARENA_COMMIT", "closest": None},
        {"name": "Wsarena_Debug", "closest": "WSARENA_DEBUG"},
    ]


def test_info_cuts_a_long_unknown_variable_name_in_the_middle():
    """A variable of a 100 kB name gave a 100 kB line, where every value wsarena quotes is cut in the middle past
    some 60 characters; the JSON keeps the name whole."""
    long = "WSARENA_" + "X" * 100_000 + "_END"
    r = run_cli("info", env={long: "1", "WSARENA_CAP_WORKSPCE": "1"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    shown = _unknown_lines(r.stdout)
    assert shown[0] == "WSARENA_CAP_WORKSPCE  (did you mean WSARENA_CAP_WORKSPACE?)"
    assert len(shown[1]) < 100 and shown[1].startswith("WSARENA_XXX") and "..." in shown[1]
    assert shown[1].endswith("XXX_END") and len(r.stdout) < 10_000
    # a short name is shown as it is set, where repr()'s escapes doubled a backslash and escaped a quote
    r = run_cli("info", env={"WSARENA_A\\B": "1", "WSARENA_IT'S\"": "1", "WSARENA_TAB\t": "1"})
    assert sorted(_unknown_lines(r.stdout)) == ["WSARENA_A\\B", "WSARENA_IT'S\"", "WSARENA_TAB\\t"]
    r = run_cli("info", "--format", "json", env={long: "1"})
    assert [var["name"] for var in json.loads(r.stdout)["unknown_variables"]] == [long]


def test_info_names_no_variable_a_setting_reads():
    """Every setting's variable set, none of them is named; the text has no such block then, and the JSON an empty
    list."""
    env = dict.fromkeys(_ENV.values(), "")
    r = run_cli("info", env=env)
    assert r.returncode == 0 and "not read by the wsarena package" not in r.stdout
    r = run_cli("info", "--format", "json", env=env)
    assert json.loads(r.stdout)["unknown_variables"] == []
    assert unknown_variables({**env, "PATH": "/bin", "XWSARENA_DEBUG": "1", "WSARENA": "1"}) == {}


def test_unknown_variables_suggest_only_a_close_setting():
    """The closeness is of the names after the prefix, which every variable shares: on the whole names difflib found
    WSARENA_FUZZ_TALLY close to WSARENA_CUDNN_API."""
    found = unknown_variables({
        "WSARENA_CACHEDIR": "", "WSARENA_SEARCH": "", "WSARENA_PLAN_CACHE": "", "WSARENA_FUZZ_TALLY": "",
        "WSARENA_WHEELS": "", "WSARENA_": "", "WSARENA_CAP_WORKSPACE": "0",
    })
    assert found == {"WSARENA_": None, "WSARENA_CACHEDIR": "WSARENA_CACHE_DIR", "WSARENA_FUZZ_TALLY": None,
                     "WSARENA_PLAN_CACHE": "WSARENA_PLAN_CACHE_SIZE", "WSARENA_SEARCH": "WSARENA_ALGO_SEARCH",
                     "WSARENA_WHEELS": None}


def test_unknown_variables_suggest_the_setting_a_short_form_abbreviates():
    """WSARENA_CAP, for WSARENA_CAP_WORKSPACE, got no suggestion: difflib asks for more than half of a name. A short
    form whose words each begin the words of one setting's variable, in order, is that variable's (CUDNN_H the
    heuristic's, where difflib found CUDNN_API closer); one of fewer than three letters, or that begins several
    names alike, is none's (CUDNN kept difflib's CUDNN_API, of CUDNN_API and CUDNN_HEURISTIC), and names of other
    words stay without a suggestion."""
    found = unknown_variables({f"WSARENA_{short}": "" for short in (
        "CAP", "Cap_Work", "ALLOC", "PLAN", "CUDNN_H", "SEARCH_C_MAX", "S_C_M", "DEB",  # abbreviations
        "C", "CA", "CUD", "CUDN", "CUDNN", "cudnn_", "S_C",  # too short, or of several
        "COMMIT", "FUZZ_TALLY", "WHEELS", "CAPTURE", "DEVICE", "API_KEY", "MAX_THREADS", "HOME", "LOG_LEVEL",
    )})
    assert found == {
        "WSARENA_ALLOC": "WSARENA_ALLOCATOR", "WSARENA_CAP": "WSARENA_CAP_WORKSPACE",
        "WSARENA_CUDNN_H": "WSARENA_CUDNN_HEURISTIC", "WSARENA_Cap_Work": "WSARENA_CAP_WORKSPACE",
        "WSARENA_DEB": "WSARENA_DEBUG", "WSARENA_PLAN": "WSARENA_PLAN_CACHE_SIZE",
        "WSARENA_SEARCH_C_MAX": "WSARENA_SEARCH_CACHE_MAX_SIZE", "WSARENA_S_C_M": "WSARENA_SEARCH_CACHE_MAX_SIZE",
        "WSARENA_C": None, "WSARENA_CA": None, "WSARENA_CUD": None, "WSARENA_CUDN": None, "WSARENA_CUDNN": None,
        "WSARENA_cudnn_": None, "WSARENA_S_C": None,
        "WSARENA_API_KEY": None, "WSARENA_CAPTURE": None, "WSARENA_COMMIT": None, "WSARENA_DEVICE": None,
        "WSARENA_FUZZ_TALLY": None, "WSARENA_HOME": None, "WSARENA_LOG_LEVEL": None, "WSARENA_MAX_THREADS": None,
        "WSARENA_WHEELS": None,
    }
    r = run_cli("info", env={"WSARENA_CAP": "1GiB"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert _unknown_lines(r.stdout) == ["WSARENA_CAP  (did you mean WSARENA_CAP_WORKSPACE?)"]


def test_every_variable_the_package_names_is_one_a_setting_reads():
    """info names as unknown each WSARENA_* variable that is no setting's (_config._ENV): a variable the package read
    elsewhere, not listed there, would be named as one it does not read."""
    package = Path(wsarena.__file__).parent
    named = {m for f in package.rglob("*.py") for m in re.findall(r"WSARENA_[A-Z0-9_]*[A-Z0-9]", f.read_text())}
    assert named and named <= set(_ENV.values()), sorted(named - set(_ENV.values()))
