"""Every guarantee tested where it is claimed (issue #41): the torch layout self-test's identity scopes
(a row alone == batched beside a longer prompt == after a prefix-cache hit, models/layouts.py
`identity_diffs`), the embedded model's greedy text in each scope on the layout `dtype auto` picks
(asserted where the self-test says bit-exact, skipped naming its verdict where it does not), planted-
difference controls that the self-test catches, and `speculative.identity` in responses == `/v1/models`."""

from __future__ import annotations

import pytest
import torch

import exactspec
from exactspec import loading
from exactspec.models import layouts
from exactspec.models.fast_llama import FastLlamaLM

from ..helpers import device_checks
from ..conftest import prefix_cached

PROMPT = "The three primary colours of light are"
LONGER = ("Write a short list of the planets of the solar system, from the closest to the sun to the "
          "farthest, with one fact about each:")  # longer, and another first token: no common prefix
FOLLOW_UP = " Now name the three primary colours of paint."
NEW = 20


@pytest.fixture(scope="module")
def auto_torch():
    """The embedded model on the torch backend with `dtype auto`: the layout the self-test picks (read
    from the cache entry a user's load reads; measured now if this machine has none)."""
    return exactspec.load(backend="torch", device="cpu", draft="prompt-lookup", gamma=4)


def _verdict(engine, scope: str) -> None:
    """Skip unless the self-test found `scope` bit-exact for the layout this engine runs, naming the verdict."""
    trial = engine.layout.trial() if engine.layout is not None else None
    if trial is None or trial.identity is None or trial.identity.get(scope) != 0.0:
        pytest.skip(f"the self-test did not find {scope} bit-exact on this CPU: {engine.runtime()['greedy_identity']}")


def _greedy(engine, prompt: str, **kw):
    return engine.generate(prompt, max_new_tokens=NEW, temperature=0, chat_template=False, **kw)


def test_runtime_names_what_held(auto_torch):
    """`identity` labels follow the self-test's choice: greedy from blocks vs steps, reproducible from the
    identity scopes; the words say which scope differed when one did."""
    choice, info = auto_torch.layout, auto_torch.runtime()
    assert choice is not None and choice.trial() is not None
    assert info["identity"]["greedy"] == (loading.BIT_EXACT if choice.exact else loading.TOLERANCE)
    if choice.exact:
        assert set(choice.trial().identity) == set(layouts.IDENTITY_SCOPES)
        assert info["identity"]["reproducible"] == (loading.BIT_EXACT if choice.reproducible else loading.TOLERANCE)
        if not choice.reproducible:
            failed = [k for k, v in choice.trial().identity.items() if v != 0.0]
            assert failed and all(k in info["greedy_identity"] for k in failed), info
    assert getattr(auto_torch.target, "cache_generated_kv", True) == choice.generated_kv


def test_text_alone_equals_batched_beside_a_longer_prompt_joined(auto_torch):
    """The rows_joined scope: with a prefix cache (as `serve` runs), rows join a batch after a lone
    prefill; the row's greedy text beside a longer prompt == its text alone."""
    _verdict(auto_torch, "rows_joined")
    alone = _greedy(auto_torch, PROMPT)
    with prefix_cached(auto_torch):
        (_, batched), _ = auto_torch.generate_batch([LONGER, PROMPT], max_new_tokens=NEW, temperature=0,
                                                    chat_template=False)
    assert batched.token_ids == alone.token_ids


def test_text_alone_equals_batched_beside_a_longer_prompt_prefilled_together(auto_torch):
    """The rows_prefilled scope: without a prefix cache a batch's prompts are prefilled together,
    right-padded (loop.start)."""
    _verdict(auto_torch, "rows_prefilled")
    alone = _greedy(auto_torch, PROMPT)
    (_, batched), _ = auto_torch.generate_batch([LONGER, PROMPT], max_new_tokens=NEW, temperature=0,
                                                chat_template=False)
    assert batched.token_ids == alone.token_ids


def test_text_after_a_cached_agent_step_equals_a_fresh_run(auto_torch):
    """The prefix and generated scopes: an agent's second step (its first prompt + answer + a follow-up)
    run after the first step filled the prefix cache == the same prompt run fresh."""
    _verdict(auto_torch, "prefix")
    if auto_torch.layout.generated_kv:
        _verdict(auto_torch, "generated")
    first = _greedy(auto_torch, PROMPT)
    second = PROMPT + first.text + FOLLOW_UP
    fresh = _greedy(auto_torch, second)
    with prefix_cached(auto_torch):
        _greedy(auto_torch, PROMPT)
        cached = _greedy(auto_torch, second)
    assert cached.stats.cached_tokens > 0 and cached.token_ids == fresh.token_ids


# --- the self-test catches what it claims to ------------------------------------------------------

def _plant(monkeypatch, when) -> None:
    """Logits 2^-20 off wherever `when(lm, new_ids)` holds: a planted difference."""
    real = FastLlamaLM.forward_rows

    def planted(self, new_ids, logits=True):
        out = real(self, new_ids, logits)
        return out + 2.0 ** -20 if out is not None and when(self, new_ids) else out

    monkeypatch.setattr(FastLlamaLM, "forward_rows", planted)


@pytest.mark.usefixtures("one_thread")
def test_a_layout_that_differs_batched_fails_the_identity_self_test(tmp_path, monkeypatch):
    """Negative control: logits that differ only when a row shares its forward with another (blocks vs
    steps untouched) fail both rows scopes; no layout is then reproducible, the fastest blocks qualifier
    is kept, and the engine says reproducibility is by tolerance, naming the scopes."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(layouts, "START", 24)  # tiny model: a short context is enough
    module = device_checks.tiny_llama(0, "cpu", 64, 8.0, 2)
    lm = FastLlamaLM(module, set(), batch_invariant=True, dtype=torch.float32)
    clean = layouts.identity_diffs(lm)
    _plant(monkeypatch, lambda lm, ids: ids.shape[0] > 1)
    planted = layouts.identity_diffs(lm)
    assert planted["rows_joined"] > 0 and planted["rows_prefilled"] > 0, planted
    assert planted["prefix"] == clean["prefix"] and planted["generated"] == clean["generated"]
    choice = layouts.choose_layout(module, None)
    tested = [t for t in choice.trials if t.identity is not None]
    assert all(t.bit_equal for t in tested) and all(not t.reproducible for t in tested)
    assert not choice.reproducible
    labels = loading.identity("cpu", "float32", choice)
    assert labels["reproducible"] == loading.TOLERANCE
    if choice.exact:  # a blocks qualifier on this CPU: greedy identity stays bit-exact, rows by tolerance
        assert tested and labels["greedy"] == loading.BIT_EXACT and "rows_joined" in choice.describe()


@pytest.mark.usefixtures("one_thread")
def test_a_prefix_restore_that_differs_fails_the_identity_self_test(monkeypatch):
    """Negative control: a restored prefix whose last cached key is slightly off (the prefix cache handing
    back other bits) fails the prefix and generated scopes, and only those."""
    module = device_checks.tiny_llama(0, "cpu", 64, 8.0, 2)
    lm = FastLlamaLM(module, set(), batch_invariant=True, dtype=torch.float32)
    clean = layouts.identity_diffs(lm)
    real = FastLlamaLM.restore_prefix

    def off(self, state, length):
        real(self, state, length)
        with torch.inference_mode():
            self.k_cache[:, 0, :, length - 1] *= 1 + 2.0 ** -10

    monkeypatch.setattr(FastLlamaLM, "restore_prefix", off)
    planted = layouts.identity_diffs(lm)
    assert planted["prefix"] > 0 and planted["generated"] > 0, planted
    assert planted["rows_joined"] == clean["rows_joined"] and planted["rows_prefilled"] == clean["rows_prefilled"]


def test_pick_prefers_a_reproducible_qualifier_and_says_what_it_skipped():
    def trial(name, t1, identity):
        return layouts.Trial(name, True, 0.0, t1, t1, identity)

    ok = dict.fromkeys(layouts.IDENTITY_SCOPES, 0.0)
    rows_off = {**ok, "rows_prefilled": 0.5}
    gen_off = {**ok, "generated": 0.5}
    both = layouts.pick([trial("bfloat16-invariant", 40.0, rows_off), trial("float32-invariant", 60.0, ok)])
    assert both.layout == "float32-invariant" and both.reproducible and both.generated_kv
    assert "bfloat16-invariant not used" in both.reason
    fastest = layouts.pick([trial("bfloat16-invariant", 40.0, rows_off), trial("float32-invariant", 60.0, rows_off)])
    assert fastest.layout == "bfloat16-invariant" and fastest.exact and not fastest.reproducible
    assert fastest.generated_kv and "rows_prefilled 0.5" in fastest.identity_words()
    prompts_only = layouts.pick([trial("bfloat16-invariant", 40.0, gen_off)])
    assert prompts_only.reproducible and not prompts_only.generated_kv  # prompts' KV only, then bit-exact
    assert "prompts' KV only" in prompts_only.identity_words()


def test_identity_labels_by_backend_and_device():
    passed = layouts.Choice("bfloat16-invariant", True, "", reproducible=True)
    assert loading.identity("cuda:0", "bfloat16", None) == {"greedy": loading.UNTESTED_CUDA,
                                                             "reproducible": loading.UNTESTED_CUDA}
    assert loading.identity("cpu", "bfloat16", passed) == {"greedy": loading.BIT_EXACT,
                                                           "reproducible": loading.BIT_EXACT}
    assert loading.identity("cpu", "float32", layouts.Choice("float32", False, "")) == {
        "greedy": loading.TOLERANCE, "reproducible": loading.TOLERANCE}
    assert loading.identity("cpu", "gguf", None, "bit-exact (self-test: ...)")["greedy"] == loading.BIT_EXACT
    assert loading.identity("cpu", "float32", None) == {"greedy": loading.NOT_SELF_TESTED,
                                                        "reproducible": loading.NOT_SELF_TESTED}
    assert "untested device (CUDA)" in loading.runtime("cuda:0", "bfloat16", None, "gpu")["greedy_identity"]


def test_responses_carry_the_identity_models_reports(embedded):
    """Every response's `speculative.identity` is `/v1/models`' `exactspec.identity` (the fp32 engine:
    not self-tested), and the existing `exact` / `reproducible` fields stay."""
    from fastapi.testclient import TestClient

    from exactspec.server.app import create_app

    with TestClient(create_app(embedded, model_name="m")) as client:
        models = client.get("/v1/models").json()["data"][0]["exactspec"]
        body = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 4,
                                                     "temperature": 0}).json()
    assert models["identity"] == embedded.runtime()["identity"] == body["speculative"]["identity"]
    assert body["speculative"]["identity"]["greedy"] == loading.NOT_SELF_TESTED
    assert body["speculative"]["exact"] is True and body["speculative"]["reproducible"] is True
