"""The README's set-up leaves nothing tracked that git should ignore.

``pip install -e .`` (the README's first command) writes ``geoloco.egg-info/``; ``.gitignore``
names it, and a copy that was once committed stays tracked anyway (and changes with every
install) until ``git rm --cached`` removes it. No tracked file may match ``.gitignore``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_tracked_file_is_ignored() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(
        ["git", "ls-files", "--cached", "--ignored", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    tracked_but_ignored = proc.stdout.split()
    assert not tracked_but_ignored, (
        f"tracked although .gitignore names them: {tracked_but_ignored}; `git rm -r --cached` them"
    )


@pytest.mark.parametrize("path", [".venv/bin/python", "venv/bin/python", "geoloco.egg-info/PKG-INFO"])
def test_what_the_setup_writes_is_ignored(path: str) -> None:
    """The virtual environment the README creates (``python -m venv .venv``) is not for git."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False)
    assert proc.returncode == 0, f"{path} is not ignored: add it to .gitignore"
