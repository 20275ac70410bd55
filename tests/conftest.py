"""Shared fixtures: tiny random-weight Llamas (small vocab) and the embedded model (torch, llama.cpp), loaded once."""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

# The suite runs servers, clients and CLI subprocesses side by side on two cores: parked OpenMP threads
# keep them from starving one another. (Not the library's default: a single generating process is
# 1.4x (torch) to 3x (llama.cpp) faster with libgomp's default spin-then-park; see docs/benchmarks.md.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# What exactspec measures once and caches (the llama.cpp self-test's choice of cache type, threads and
# tiling; auto γ's T(k)) is timed, and the suite times it on a loaded machine (two workers, servers and
# CLI subprocesses side by side). One test runs `generate` under the user's OpenMP setting, so its verdict
# went under the user's own key, and served the user's later runs: after `make test` here the default
# load kept one-thread steps and no tiled prefill (190 against 637 prefill tokens/s). So the suite keeps
# its own cache (EXACTSPEC_CACHE, unless set).
os.environ.setdefault("EXACTSPEC_CACHE", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      ".cache", "test"))
# Those verdicts are then provisional (timed beside the other worker: quiet.py), and a later start that
# found the machine quiet for a moment would time them again, beside whatever the suite runs next: the
# suite keeps them as first measured (tests of the re-measuring set their own attempts).
os.environ.setdefault("EXACTSPEC_REMEASURE_ATTEMPTS", "0")
# `serve` and `batch` keep prefix-cache snapshots on disk by default; servers started by tests would find
# earlier tests' snapshots (a first request reusing a prompt it never sent). Tests of the disk cache give
# their own folder.
os.environ.setdefault("EXACTSPEC_PREFIX_CACHE_DIR", "none")

import pytest
import torch

from exactspec.models.torch_hf import HFCausalLM

LLAMA_CPP_MISSING = "llama-cpp-python not installed (make setup builds it)"


def patched_llama_cpp() -> bool:
    """Whether the installed llama-cpp-python is `make setup`'s build: its version carries "+exactspec" (the
    patches of scripts/llama_cpp_patches/, with which blocks equal one-token steps where a stock build's do not)."""
    import llama_cpp

    return "+exactspec" in getattr(llama_cpp, "__version__", "")


def need(module: str, reason: str = LLAMA_CPP_MISSING):
    """Import `module` for a test file or fixture, or skip it where it is missing -- except under CI=true,
    where a missing engine fails the run: a CI that skipped the default backend's tests would pass with
    that backend untested (`make setup` prints a failed llama.cpp build and goes on)."""
    if os.environ.get("CI") == "true":
        try:
            return importlib.import_module(module)
        except Exception as e:
            pytest.fail(f"CI=true and {module} does not import ({reason}): {e}", pytrace=False)
    return pytest.importorskip(module, reason=reason)


# The files that take longest start first (`--dist loadfile` hands files out in collection order): the
# two workers then finish together instead of one running the last long file alone.
LONGEST_FIRST = ("test_cli.py", "test_hostile.py", "test_scale.py", "test_llama_cpp_tiled.py", "test_long_context.py",
                 "test_llama_cpp.py", "test_llama_cpp_batched.py", "test_batching.py")


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# Under `pytest -n 2` (the Makefile's suite) each of the two workers owns one core.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

TINY_VOCAB = 8


def tiny_llama(seed: int, vocab: int = TINY_VOCAB, sharpness: float = 8.0, layers: int = 2) -> torch.nn.Module:
    """A random Llama whose next-token laws are far from uniform (so drafts can disagree), on the CPU."""
    from .helpers.device_checks import tiny_llama as tiny_llama_on

    return tiny_llama_on(seed, "cpu", vocab, sharpness, layers)


@pytest.fixture
def one_thread():
    """Tiny models on one torch thread: their ops are too small to split, and with parked OpenMP threads
    (above) every op would wait for a second thread to wake (2-3x slower). Modules that run only tiny
    models take it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextmanager
def prefix_cached(engine, budget_mb: float = 64) -> Iterator[None]:
    """The engine's prefix cache on (as `serve` runs it), off again afterwards: session engines are shared."""
    engine.set_prefix_cache(budget_mb)
    try:
        yield
    finally:
        engine.set_prefix_cache(None)


def surely_reused(engine, n: int) -> int:
    """The reuse a prompt is sure of when n positions it shares with a cached one were computed alike: n,
    or with llama.cpp's TILED PREFILL n less at most a tile but one (where a tiled run goes on past them,
    its last tile is left to compute: prefill_plan.reusable)."""
    tile = getattr(engine.target, "prefill_tile", 0)
    return max(0, n - tile + 1) if tile else n


@pytest.fixture(scope="session")
def tiny_target() -> HFCausalLM:
    return HFCausalLM(tiny_llama(0), eos_token_ids=set())


@pytest.fixture(scope="session")
def tiny_draft() -> HFCausalLM:
    return HFCausalLM(tiny_llama(1, sharpness=4.0, layers=1), eos_token_ids=set())


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2-135M-Instruct engine (fp32), loaded once for the whole session."""
    import exactspec

    return exactspec.load(draft="prompt-lookup", gamma=4, dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def embedded_llamacpp():
    """The embedded GGUF on the llama.cpp backend (2 threads, 1,024-token context), loaded once for the
    session; skips when llama-cpp-python is not installed. Tests that turn its prefix cache on turn it off."""
    need("llama_cpp")
    from exactspec.embedded import embedded_model_path
    from exactspec.engine import llamacpp_engine

    return llamacpp_engine(embedded_model_path(), n_ctx=1024, threads=2)


@pytest.fixture(scope="session")
def llamacpp_rows():
    """The embedded GGUF on llama.cpp as `serve` runs it on a CPU: 16 rows of 1,024 tokens, batched. The
    structured-output, prefix-cache and `exactspec batch` tests decode on it (fewer CPU-seconds than the
    torch fp32 engine there); test_server.py, test_server_stream.py and test_hostile.py serve torch."""
    need("llama_cpp")
    from exactspec.embedded import embedded_model_path
    from exactspec.engine import llamacpp_engine

    return llamacpp_engine(embedded_model_path(), n_ctx=1024, threads=2, rows=16)
