"""TILED PREFILL on the llama.cpp backend (models/llamacpp/adapter.py): how a prompt, a decode block and a row's
leftover tokens are cut into passes, which cached prefixes a prompt may reuse, and -- where the load-time
self-test kept the arrangement -- that a prefix cache hit at any point, or a prefill in chunks, decodes
what a cold prefill does, token for token."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ..conftest import need

need("llama_cpp")

from exactspec.models.llamacpp import prefill_plan  # noqa: E402
from exactspec.models.llamacpp.adapter import LlamaCppLM, _passes  # noqa: E402
from exactspec.models.llamacpp.numerics import CANDIDATES  # noqa: E402
from exactspec.speculative.sampling import SamplingParams  # noqa: E402

from ..conftest import patched_llama_cpp, prefix_cached  # noqa: E402

TILE = 64
GREEDY = SamplingParams(temperature=0)


def pieces(length: int, k: int, prefill: bool, n_batch: int = 512, n_ubatch: int = 512) -> list[int]:
    lm = SimpleNamespace(prefill_tile=TILE, n_batch=n_batch, n_ubatch=n_ubatch, _ids=[[7] * length])
    lm.plan = lambda ids: prefill_plan.kinds(ids, [1, 5], {2}, TILE)
    return LlamaCppLM._pieces(lm, 0, [7] * (k - 3) + [1, 5, 9], prefill)


def test_a_prefill_passes_by_its_plan_and_logits_per_row():
    """A prompt's passes follow its plan (prefill_plan.py: here a run, then an assistant turn of 3); every
    pass with logits stays under a tile (the per-row kernel)."""
    assert pieces(0, 1000, True) == [512, 485, 3]
    assert pieces(100, 200, True) == [197, 3]  # its run began in the cached part
    assert pieces(0, 40, True) == [40]  # a run too short to tile, and the turn: per-row
    assert pieces(0, 1000, True, n_batch=200, n_ubatch=200) == [192] * 4 + [128, 101, 3]  # one compute step each
    assert pieces(0, 130, False) == [63, 63, 4]


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


def test_without_tiled_prefill_every_shared_position_is_reusable():
    assert LlamaCppLM.reusable(SimpleNamespace(prefill_tile=0), 123, None, [7] * 200) == 123


TILED = [c for c in CANDIDATES if c.prefill_tile]  # lone tokens as they are, then padded


@pytest.fixture(scope="module", params=TILED, ids=lambda c: "padded" if c.pad else "unpadded")
def tiled(request, embedded_llamacpp):
    """The embedded GGUF with TILED PREFILL forced (whatever the self-test keeps on this CPU: on some, a
    per-row cache wins the ranking), lone tokens padded or not. On make setup's patched build it must be
    bit-exact (the self-test's own check, here): a difference fails the module; a stock build skips it."""
    from dataclasses import replace

    import llama_cpp

    from exactspec.engine import Engine
    from exactspec.models.llamacpp.adapter import load_llama_cpp
    from exactspec.models.llamacpp.numerics import steps_write_prefill_kv, trial

    def make(setting):
        lm = load_llama_cpp(embedded_llamacpp.target.path, n_ctx=1024, threads=2, **setting.llama_kwargs())
        if setting.single_threads:
            lm.set_single_threads(setting.single_threads)
        return lm

    setting = request.param
    lm = make(setting)
    diff = trial(lm)[0]
    if diff != 0.0 and not setting.pad and patched_llama_cpp():
        if trial(make(replace(setting, pad=True)))[0] == 0.0:  # only the pad makes it exact: the split-KV kernel is still there
            pytest.fail(f"make setup's llama.cpp build (scripts/build_llama_cpp.py) should have no split-KV "
                        f"kernel, yet only padded one-token steps equal blocks (unpadded: {diff})")
    if diff != 0.0 and patched_llama_cpp():  # the patched build makes tiles exact on every CPU
        pytest.fail(f"tiled prefill is not bit-exact on make setup's patched build ({llama_cpp.__version__}): "
                    f"blocks or prefix + rest differ by {diff}")
    if diff != 0.0:
        pytest.skip(f"a stock llama-cpp-python build ({llama_cpp.__version__}): tiled prefill differs by {diff}")
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


def kv_after(lm, ids: list[int], cached: int | None = None, decoded: int = 0, keep: int | None = None) -> bytes:
    """The KV bytes of a prefill of `ids`: cold (cached None), or after a prefill of ids[:cached] and
    `decoded` one-token steps (a prompt and its answer), kept up to `keep` (default: what `reusable`
    allows) and the rest prefilled. The adapter is reset."""
    import torch

    lm.reset()
    if cached is not None:
        lm.prefill(torch.tensor([ids[:cached]]))
        for t in ids[cached:cached + decoded]:
            lm.forward(torch.tensor([[t]]))
        state, _ = lm.snapshot_prefix(cached + decoded)
        keep = lm.reusable(cached + decoded, state, ids) if keep is None else keep
        lm.restore_prefix(state, keep)
    if lm.length < len(ids):
        lm.prefill(torch.tensor([ids[lm.length:]]))
    kv = bytes(lm.snapshot_prefix(len(ids))[0][0])
    lm.reset()
    return kv


def test_a_reusable_prefix_plus_the_rest_writes_a_cold_prefill_byte_for_byte(tiled):
    """The adapter-level law behind the prefix cache: a 300-token prompt prefilled (one tiled run) and 40
    tokens decoded after it (per-row), then a 400-token prompt sharing those 340, with no assistant turn:
    keeping what `reusable` allows (the 300) and prefilling the rest writes the KV a cold prefill of the
    400 writes; keeping all 340 does not (a cold prefill tiles positions 300-339), which shows the check
    can fail."""
    import torch

    lm = tiled.target
    ids = torch.randint(3, lm.vocab_size, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    cold = kv_after(lm, ids)
    assert kv_after(lm, ids, 300, 40) == cold
    assert kv_after(lm, ids, 300, 40, keep=340) != cold, "per-row and tiled positions 300-339 wrote the same bytes: the test is blind here"


def test_an_answer_decoded_after_its_prompt_is_reused_by_the_next_prompt(tiled):
    """An agent's step: a prompt ending in the assistant marker is prefilled, its answer decoded one token
    at a time; the next prompt (that conversation, the end of the turn, a new user turn, the marker)
    keeps all of it -- the plan computes an assistant turn per-row, as decoding did -- and prefilling the
    rest writes the KV a cold prefill writes, byte for byte."""
    import torch

    lm = tiled.target
    rng = torch.Generator().manual_seed(3)
    words = lambda n: torch.randint(10, lm.vocab_size, (n,), generator=rng).tolist()  # noqa: E731
    marker, end = [5, 6, 7], min(lm.eos_token_ids)
    first = words(250) + marker
    answer = words(30)
    following = first + answer + [end] + words(150) + marker
    old, lm.turn_marker = lm.turn_marker, marker
    try:
        state_len = len(first) - 1 + 1 + len(answer) - 1  # the prompt but its last token, then it and the answer decoded (not the last)
        assert lm.reusable(state_len, SimpleNamespace(kinds=lm.plan(first[:-1]) + bytes(len(answer))), following[:-1]) == state_len
        assert kv_after(lm, following[:-1], len(first) - 1, len(answer)) == kv_after(lm, following[:-1])
    finally:
        lm.turn_marker = old
