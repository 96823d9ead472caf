"""ruff over the whole tree with the project's settings (pyproject.toml): lines within 110 characters among
its rules, so that the line counts other tests bound are counts of lines a reader sees."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_line_length_is_enforced(tmp_path):
    """The rule bites: a line of 111 characters in a file of the tree's settings is a finding."""
    long_line = tmp_path / "long.py"
    long_line.write_text("x = " + repr("a" * 105) + "\n")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--config", str(ROOT / "pyproject.toml"),
                           str(long_line)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and "E501" in proc.stdout, proc.stdout
