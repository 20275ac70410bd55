"""Build llama-cpp-python (the llama.cpp engine) from its PyPI sdist with exactspec's patches, once per
machine, and print the wheel's path (make setup installs it).

The patches are files: scripts/llama_cpp_patches/NN-*.patch, applied in name order with `git apply`, each
checked first (`git apply --check`: a patch that does not apply cleanly stops the build, naming it). Each
starts with a header saying what it changes, why the bits stay the same, and where it was measured; their
history and figures are in docs/llama-cpp.md. The load-time self-test (models/llamacpp/numerics.py) still
decides by measuring which settings are bit-exact on the machine at hand.

The wheel is cached under the exactspec cache (`cachedir.cache_dir`), named by the patch level (the
version label the last patch sets), in a folder per build target (`build_key`: the CPU's model,
architecture and flags, the compiler, CMAKE_ARGS -- the build is -march=native, so a home folder shared
by machines of another ISA builds its own), so later set-ups take seconds; the sdist too (`fetch_sdist`:
the suite checks the patches against it). CMAKE_ARGS and CMAKE_BUILD_PARALLEL_LEVEL from the environment reach
the build (the Makefile passes them).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from exactspec.cachedir import cache_dir  # make setup installs exactspec first

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
LABEL = "exactspec.23"  # the version label 09-version-label.patch sets: bump both with any patch change
PATCHES = Path(__file__).with_name("llama_cpp_patches")


def patch_files() -> list[Path]:
    return sorted(PATCHES.glob("*.patch"))


def apply_patches(tree: Path) -> None:
    """Apply every patch, in order, to an unpacked sdist: each checked before it is applied; one that does
    not apply cleanly stops the build."""
    alone = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent)}  # never a repository around the tree
    for patch in patch_files():
        check = subprocess.run(["git", "apply", "--check", str(patch)], cwd=tree, capture_output=True, text=True,
                               env=alone)
        if check.returncode != 0:
            sys.exit(f"build_llama_cpp: {patch.name} does not apply to {PACKAGE} {VERSION}: {check.stderr.strip()}")
        subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True, env=alone)


def fetch_sdist() -> Path:
    """The pinned sdist, downloaded once into the exactspec cache."""
    folder = cache_dir("sdists")
    found = sorted(folder.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", PACKAGE, "-d",
                    str(folder), f"{PACKAGE}=={VERSION}"], check=True, stdout=sys.stderr)
    return folder / f"llama_cpp_python-{VERSION}.tar.gz"


def unpack(sdist: Path, into: Path) -> Path:
    """The sdist unpacked under `into`: its top folder."""
    with tarfile.open(sdist) as tar:
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    tree, = (p for p in into.iterdir() if p.is_dir())
    return tree


def build(out: Path) -> Path:
    """Patch the sdist and build the wheel into `out` (pip's output on stderr: stdout is the path)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = unpack(fetch_sdist(), Path(tmp))
        apply_patches(tree)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(tree)],
                       check=True, stdout=sys.stderr)
    return wheel(out)


def wheel(out: Path) -> Path | None:
    found = sorted(out.glob(f"llama_cpp_python-{VERSION}+{LABEL}-*.whl"))
    return found[-1] if found else None


def build_key() -> str:
    """What the build's machine code depends on beside the sources: the CPU (-march=native), the C
    compiler and CMAKE_ARGS."""
    from exactspec.device import cpu_flags, cpu_name

    cc = os.environ.get("CC") or shutil.which("cc") or "cc"
    try:
        compiler = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    except OSError:
        compiler = cc
    args = " ".join(os.path.basename(a) if os.path.isabs(a) else a  # a clone's own path is not the build's
                    for a in os.environ.get("CMAKE_ARGS", "").replace("=", "= ").split()).replace("= ", "=")
    text = "|".join([cpu_name(), platform.machine(), " ".join(sorted(cpu_flags())), compiler, args])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


if __name__ == "__main__":
    out = cache_dir("wheels") / build_key()
    out.mkdir(exist_ok=True)
    print(wheel(out) or build(out))
