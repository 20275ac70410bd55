"""`exactspec.__version__`: the installed package's version (its metadata), else pyproject.toml's (a
source checkout run from PYTHONPATH without installing), else "0+unknown"."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path


def _version() -> str:
    try:
        return metadata.version("exactspec")
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.exists():
        match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"), re.MULTILINE)
        if match:
            return match.group(1)
    return "0+unknown"


__version__ = _version()
