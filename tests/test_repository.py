"""The repository speaks to its users: no tracker numbers (readers cannot see the
tracker) and no paths to files that are not in it, in any tracked file."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import REPO

# Built from parts so that this file does not match itself.
TRACKER = re.compile(r"\b" + "iss" + r"ues? #?\d+", re.I)
MISSING = ("plugins/" + "base.py", "DESIGN" + ".md")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_tracker_numbers_or_missing_files_are_named():
    hits = []
    for path in tracked_files():
        full = os.path.join(REPO, path)
        try:
            with open(full, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if TRACKER.search(line) or any(m in line for m in MISSING):
                hits.append(f"{path}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)
