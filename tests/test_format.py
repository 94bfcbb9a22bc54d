"""The code is formatted by ``ruff format`` and clean under ``ruff check`` (the settings in ``pyproject.toml``)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["src", "tests", "benchmarks", "docs/_ext"]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(command):
    out = subprocess.run([sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff {' '.join(command)} (run it without --check to fix):\n{out.stdout}{out.stderr}"
