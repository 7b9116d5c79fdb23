"""Style is a machine's job: ruff (lint and format, configured in pyproject.toml) and
clang-format (.clang-format) on every tracked source report no violation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO


def _tracked(*patterns: str) -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", *patterns], cwd=REPO, capture_output=True, check=True, timeout=30
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [p for p in out.stdout.decode().split("\0") if p]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_lint_is_clean():
    proc = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "."])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format_is_clean():
    proc = _run([sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_clang_format_is_clean():
    # The test extra's clang-format, beside this Python; else one on PATH.
    exe = shutil.which("clang-format", path=os.path.dirname(sys.executable)) or shutil.which("clang-format")
    assert exe, "clang-format is missing: it comes with the test extra (pip install -e '.[test]')"
    files = _tracked("*.h", "*.cu", "*.cpp")
    assert files
    proc = _run([exe, "--dry-run", "-Werror", *files])
    assert proc.returncode == 0, proc.stderr[-4000:]
