"""Lay out the installed package as files, for tools that cannot follow package-dir.

The repository keeps one folder per stage and pyproject.toml maps them under the
``hebrus_flywheel`` namespace. Python's import system follows that mapping (through
setuptools' editable finder), but import-linter and mypy look for packages on disk. This
script builds ``.lint/hebrus_flywheel/`` from symlinks, read from the same mapping, so
they see exactly the installed package and report the files the links point to.

Usage: python tools/lint_tree.py [OUT_DIR]   (default: .lint)
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(out: Path) -> Path:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    namespace = min(mapping, key=len)
    if out.exists():
        shutil.rmtree(out)
    top = out / namespace
    top.mkdir(parents=True)
    for entry in sorted((ROOT / mapping[namespace]).iterdir()):
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in mapping.items():
        if package != namespace:
            link = out.joinpath(*package.split("."))
            link.symlink_to(ROOT / folder, target_is_directory=True)
    return top


if __name__ == "__main__":
    print(build(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / ".lint").resolve()))
