"""MkDocs hooks of the documentation site (``hooks:`` in mkdocs.yml).

The root folders are the subpackages of ``geoloco`` only through the install's package-dir
mapping, which mkdocstrings' static reader (griffe) cannot follow: like ``.ci/lint``, lay the same
folders out under ``build/docs-api/geoloco/`` as symlinks before the API reference is read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

PACKAGES = ("protos", "compression", "algorithms", "coordinator", "site_agent", "relay", "scenarios")
ROOT = Path(__file__).resolve().parents[1]
API_TREE = ROOT / "build" / "docs-api"
"""mkdocs.yml's mkdocstrings ``paths`` names it (relative to the repository root)."""


def on_startup(command: str, dirty: bool) -> None:
    """Before any plugin reads its config: mkdocstrings fixes its search paths there."""
    tree = API_TREE
    shutil.rmtree(tree, ignore_errors=True)
    package = tree / "geoloco"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""geoloco, laid out for the API reference by docs/hooks.py."""\n')
    for name in PACKAGES:
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
