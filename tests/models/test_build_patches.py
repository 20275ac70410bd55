"""The llama.cpp engine's patches (scripts/llama_cpp_patches/) read and check as patches: each applies
cleanly, in name order, to the pinned sdist (`git apply --check`, then applied, as the build does); the
result carries the version label of the engine `make setup` installed; and each says what it changes,
why the bits stay the same, and where it was measured."""

from __future__ import annotations

import importlib.util
import re
import tarfile
from pathlib import Path

import pytest

from ..conftest import need

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_llama_cpp.py"


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build_llama_cpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_patches_apply_cleanly_in_order_to_the_pinned_sdist(build, tmp_path):
    patches = build.patch_files()
    assert len(patches) >= 8 and [p.name[:2] for p in patches] == [f"{i:02d}" for i in range(1, len(patches) + 1)]
    touched = sorted({m for p in patches for m in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M)})
    with tarfile.open(build.fetch_sdist()) as tar:  # only the files the patches touch
        top = tar.getnames()[0].split("/")[0]
        members = [tar.getmember(f"{top}/{name}") for name in touched]
        tar.extractall(tmp_path, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    tree = tmp_path / top
    build.apply_patches(tree)  # each checked (git apply --check), then applied; one that fails stops it
    version = f"{build.VERSION}+{build.LABEL}"
    assert f'__version__ = "{version}"' in (tree / "llama_cpp" / "__init__.py").read_text()
    assert need("llama_cpp").__version__ == version  # the engine make setup built is this patch set


def test_each_patch_says_what_it_changes_why_the_bits_hold_and_where_it_was_measured(build):
    for patch in build.patch_files():
        header = patch.read_text().split("\n--- a/", 1)[0]
        assert "What:" in header, patch.name
        if "version-label" not in patch.name:
            assert "Why the bits hold:" in header and "Measured:" in header, patch.name
