"""The shell scripts of tools/ that build a virtual environment and run the tests in it (floors.sh, pythons.sh)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("script", "variable"), [("floors.sh", "FLOORS_VENV"), ("pythons.sh", "PYTHONS_VENV")])
def test_a_venv_path_naming_a_folder_that_is_no_virtual_environment_is_refused_and_left_alone(
    tmp_path, script, variable
):
    """Each removes its virtual environment before building it again: a folder named in its place by mistake (one
    holding others, a home) is refused with exit status 2, and what it holds is left. Once, it was removed whole."""
    folder = tmp_path / "venvs"
    folder.mkdir()
    kept = folder / "kept.txt"
    kept.write_text("mine")
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / script)], check=False, capture_output=True, text=True, timeout=60,
        env={**os.environ, variable: str(folder), "PYTHON": "false"},
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"{script}: {variable} {folder} is there and is no virtual environment: it is not removed\n"
    assert kept.read_text() == "mine"


@pytest.mark.parametrize(("script", "variable"), [("floors.sh", "FLOORS_VENV"), ("pythons.sh", "PYTHONS_VENV")])
@pytest.mark.parametrize("inside", ["", "build/venv"])
def test_a_venv_path_inside_the_checkout_is_refused(script, variable, inside):
    """A virtual environment in the checkout would be in the tests' way (pytest collects, ruff checks it): refused
    with exit status 2, before anything is removed or built."""
    venv = ROOT / inside if inside else ROOT
    result = subprocess.run(
        ["bash", str(ROOT / "tools" / script)], check=False, capture_output=True, text=True, timeout=60,
        env={**os.environ, variable: str(venv), "PYTHON": "false"},
    )
    assert (result.returncode, result.stderr) == (2, f"{script}: {variable} must be outside the checkout\n")
