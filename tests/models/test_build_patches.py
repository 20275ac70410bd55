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


@pytest.fixture(scope="module")
def patched(build, tmp_path_factory) -> Path:
    """The files the patches touch, from the pinned sdist, patched as the build patches them."""
    patches = build.patch_files()
    touched = sorted({m for p in patches for m in re.findall(r"^\+\+\+ b/(\S+)", p.read_text(), re.M)})
    tmp_path = tmp_path_factory.mktemp("sdist")
    with tarfile.open(build.fetch_sdist()) as tar:  # only the files the patches touch
        top = tar.getnames()[0].split("/")[0]
        members = [tar.getmember(f"{top}/{name}") for name in touched]
        tar.extractall(tmp_path, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    tree = tmp_path / top
    build.apply_patches(tree)  # each checked (git apply --check), then applied; one that fails stops it
    return tree


def test_the_patches_apply_cleanly_in_order_to_the_pinned_sdist(build, patched):
    patches = build.patch_files()
    assert len(patches) >= 8 and [p.name[:2] for p in patches] == [f"{i:02d}" for i in range(1, len(patches) + 1)]
    version = f"{build.VERSION}+{build.LABEL}"
    assert f'__version__ = "{version}"' in (patched / "llama_cpp" / "__init__.py").read_text()
    assert need("llama_cpp").__version__ == version  # the engine make setup built is this patch set


_APART = re.compile(r"_mm(256|512)_add_ps\([^;]*_mm\1_mul_ps\(|\bsumm\w* \+=")  # a multiply, then an add


def _function(source: str, signature: str) -> str:
    start = source.index(signature)
    return source[start:source.index("\n}\n", start)]


def test_the_kernels_that_must_agree_fuse_their_multiply_adds_explicitly(patched):
    """Kernels whose sums must equal each other's bit for bit (a pass of many rows and a one-token step)
    write each float multiply-add as one fused operation (an FMA intrinsic or fmaf), in upstream's
    kernel too: a multiply then an add is fused or not at the compiler's choice, loop by loop."""
    cpu = patched / "vendor/llama.cpp/ggml/src/ggml-cpu"
    q4_1 = _function((cpu / "arch/x86/quants.c").read_text(), "void ggml_vec_dot_q4_1_q8_1(")
    no_fma = "#else\n        acc = _mm256_add_ps( _mm256_mul_ps( d0d1, xy ), acc );"  # AVX without AVX2: no 2x2 kernel
    assert q4_1.count(no_fma) == 1
    q4_1 = q4_1.replace(no_fma, "")
    assert q4_1.count("fmaf(") == 5 and not _APART.search(q4_1)  # the 2x2 kernel's four, the one-output loop's one
    tiled = (cpu / "tiled/tiled-kernel.cpp").read_text()
    vnni = tiled[tiled.index("#if defined(__AVX512VNNI__) && defined(__AVX512VL__)"):tiled.index("#endif // __AVX512VNNI__ && __AVX512VL__")]
    assert "_mm512_fmadd_ps(result, d1_vec" in vnni and not _APART.search(vnni)


def test_each_patch_says_what_it_changes_why_the_bits_hold_and_where_it_was_measured(build):
    for patch in build.patch_files():
        header = patch.read_text().split("\n--- a/", 1)[0]
        assert "What:" in header, patch.name
        if "version-label" not in patch.name:
            assert "Why the bits hold:" in header and "Measured:" in header, patch.name
