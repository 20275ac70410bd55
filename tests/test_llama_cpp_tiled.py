"""TILED PREFILL on the llama.cpp backend (models/llama_cpp.py): how a prompt, a decode block and a row's
leftover tokens are cut into passes, which cached prefixes a prompt may reuse, and -- where the load-time
self-test kept the arrangement -- that a prefix cache hit at any point, or a prefill in chunks, decodes
what a cold prefill does, token for token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .conftest import need

need("llama_cpp")

from exactspec.models.llama_cpp import LlamaCppLM, _passes  # noqa: E402
from exactspec.models.llama_cpp_numerics import CANDIDATES  # noqa: E402
from exactspec.speculative.sampling import SamplingParams  # noqa: E402

from .conftest import prefix_cached  # noqa: E402

TILE = 64
GREEDY = SamplingParams(temperature=0)


def pieces(length: int, k: int, prefill: bool, n_batch: int = 512, n_ubatch: int = 512) -> list[int]:
    lm = SimpleNamespace(prefill_tile=TILE, n_batch=n_batch, n_ubatch=n_ubatch)
    return LlamaCppLM._pieces(lm, length, k, prefill)


def test_a_prefill_takes_whole_tiles_then_per_row_passes():
    assert pieces(0, 1000, True) == [512, 448, 40]  # tiles [0, 960): tiled kernel; the last 40: per-row
    assert pieces(128, 200, True) == [192, 8]  # from a tile boundary
    assert pieces(100, 200, True) == [63, 63, 63, 11]  # not from a boundary: nothing is tiled
    assert pieces(0, 40, True) == [40]
    assert pieces(0, 1000, True, n_batch=200, n_ubatch=200) == [192] * 5 + [40]  # one compute step each
    assert pieces(0, 130, False) == [63, 63, 4]  # logits: always under a tile (the per-row kernel)


def test_passes_are_equal_runs_of_consecutive_rows():
    """Each pass: consecutive rows from the first with tokens left, as many each as all have; the
    shapes llama.cpp's own sequential split makes. A lone token in a lone row is a pass of its own
    (the adapter pads it)."""
    assert _passes([8, 1, 3, 2], 63, 512) == [(0, 4, 1), (0, 1, 7), (2, 2, 1), (2, 1, 1)]
    assert _passes([3, 2], 63, 512) == [(0, 2, 2), (0, 1, 1)]
    assert _passes([0, 5, 5], 2, 512) == [(1, 2, 2), (1, 2, 2), (1, 2, 1)]
    assert _passes([100, 100], 63, 64) == [(0, 2, 32)] * 3 + [(0, 2, 4)]  # n_batch tokens per pass
    for widths in ([8, 1, 3, 2], [1, 0, 1], [70, 3, 0, 9]):
        done = [0] * len(widths)
        for first, count, n in _passes(widths, 63, 16):
            assert count * n <= 16 and n <= 63
            for b in range(first, first + count):
                done[b] += n
        assert done == widths


@pytest.mark.parametrize("common, prefilled, total, kept", [
    (300, 300, 400, 256),  # the cached prompt's last 44 tokens were per-row, the new prompt tiles them
    (300, 300, 310, 300),  # both prompts end in the same tile: all of it
    (200, 300, 310, 192),  # a match ending inside a tile: from its start (the rest re-tiled)
    (305, 300, 310, 305),  # generated tokens past a shared last tile: computed per-row by both
    (350, 300, 355, 256),  # ... but a prompt of 355 tiles [256, 320)
    (40, 300, 400, 0),
])
def test_reusable_prefix(common, prefilled, total, kept):
    lm = SimpleNamespace(prefill_tile=TILE)
    assert LlamaCppLM.reusable(lm, common, prefilled, total) == kept
    assert LlamaCppLM.reusable(SimpleNamespace(prefill_tile=0), common, prefilled, total) == common


TILED = [c for c in CANDIDATES if c.prefill_tile]  # lone tokens as they are, then padded


@pytest.fixture(scope="module", params=TILED, ids=lambda c: "padded" if c.pad else "unpadded")
def tiled(request, embedded_llamacpp):
    """The embedded GGUF with TILED PREFILL forced (whatever the self-test keeps on this CPU: on some, a
    per-row cache wins the ranking), lone tokens padded or not, if the self-test's own checks find it
    bit-exact here."""
    from dataclasses import replace

    import llama_cpp

    from exactspec.engine import Engine
    from exactspec.models.llama_cpp import load_llama_cpp
    from exactspec.models.llama_cpp_numerics import steps_write_prefill_kv, trial

    def make(setting):
        lm = load_llama_cpp(embedded_llamacpp.target.path, n_ctx=1024, threads=2, **setting.llama_kwargs())
        if setting.single_threads:
            lm.set_single_threads(setting.single_threads)
        return lm

    setting = request.param
    lm = make(setting)
    diff = trial(lm)[0]
    if diff != 0.0 and not setting.pad and "+exactspec" in llama_cpp.__version__:
        if trial(make(replace(setting, pad=True)))[0] == 0.0:  # only the pad makes it exact: the split-KV kernel is still there
            pytest.fail(f"make setup's llama.cpp build (scripts/build_llama_cpp.py) should have no split-KV "
                        f"kernel, yet only padded one-token steps equal blocks (unpadded: {diff})")
    if diff != 0.0:
        pytest.skip(f"tiled prefill is not bit-exact on this CPU (blocks or prefix + rest differ by {diff})")
    lm.identity, lm.cost_key = "tiled prefill (forced by the test)", f"tiled-test|{lm.path}"
    lm.cache_generated_kv = steps_write_prefill_kv(lm)
    engine = Engine(lm, embedded_llamacpp.tokenizer, "prompt-lookup", 4)
    engine.backend = "llama.cpp"
    yield engine
    lm.close()


def test_prefix_hits_anywhere_decode_what_a_cold_prefill_does(tiled):
    """Prompts sharing 0-300 tokens with a cached one, of lengths that cut tiles differently: greedy text
    with the prefix cache (some reused) equals each prompt decoded cold."""
    words = " ".join(f"item{i} costs {i * 7 % 13} units;" for i in range(120))
    base = tiled.encode(words)
    assert len(base) > 400
    prompts = [base[:n] for n in (330, 257, 300, 390)] + [base[:200] + base[300:380]]
    cold = [list(tiled.stream_ids(p, GREEDY, 12, "auto", 0, None, "prompt-lookup")) for p in prompts]
    with prefix_cached(tiled):
        warm = [list(tiled.stream_ids(p, GREEDY, 12, "auto", 0, None, "prompt-lookup")) for p in prompts]
        assert tiled.target.prefix_cache.reused_tokens > 0
    assert warm == cold


def test_a_reusable_prefix_plus_the_rest_writes_a_cold_prefill_byte_for_byte(tiled):
    """The adapter-level law behind the prefix cache: a 300-token prompt prefilled whole (tiles up to 256,
    its last 44 tokens per-row), then a 400-token prompt sharing those 300 -- keeping what `reusable` allows
    and prefilling the rest writes the KV a cold prefill of the 400 writes; keeping all 300 does not
    (positions 256-299 were computed per-row, a cold prefill tiles them), which shows the check can fail."""
    import torch

    lm = tiled.target
    ids = torch.randint(0, lm.vocab_size, (400,), generator=torch.Generator().manual_seed(1)).tolist()

    def kv_after(keep: int | None) -> bytes:
        lm.reset()
        if keep is None:
            lm.prefill(torch.tensor([ids]))
        else:
            lm.prefill(torch.tensor([ids[:300]]))
            lm.truncate(keep)
            lm.prefill(torch.tensor([ids[keep:]]))
        kv = bytes(lm.snapshot_prefix(len(ids))[0][0])
        lm.reset()
        return kv

    cold, kept = kv_after(None), lm.reusable(300, 300, 400)
    assert kept == 256 and kv_after(kept) == cold
    assert kv_after(300) != cold, "per-row and tiled positions 256-299 wrote the same bytes: the test is blind here"
