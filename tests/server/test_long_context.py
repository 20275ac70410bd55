"""Greedy identity at long context with the default `dtype auto`, whatever this CPU is: the embedded model
copies a ~1,000-token list (so prompt lookup proposes long drafts and verification blocks cross the
invariant attention's 1,024-key block boundary while decoding), plain vs speculative greedy, token for
token, through the single-row loop (`generate`), the batched loop (`generate_batch`, what `generate --json`
runs) and the server."""

from __future__ import annotations

import pytest

import exactspec
from exactspec.server.app import create_app

from ..helpers.servers import _running

ITEMS = ["apple", "river", "copper", "lantern", "meadow", "violin", "harbor", "pepper", "glacier", "saddle"]
PROMPT = ("Copy this inventory list exactly, line by line, without comments:\n"
          + "\n".join(f"{i:03d}. {ITEMS[i % 10]} crate {i * 7 % 100} kg, shelf {chr(65 + i % 6)}{i % 9}"
                      for i in range(62)))
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def auto_engine():
    """The embedded model as a user loads it (`backend auto`, `dtype auto`: the self-tested settings), with
    a prefix cache as `serve` has: the plain run prefills the prompt, the others continue from its cache
    (so each is also checked against an uncached run)."""
    return exactspec.load(prefix_cache_mb=64)


@pytest.fixture(scope="module")
def plain(auto_engine):
    result = auto_engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0, gamma=0)
    assert len(result.prompt_token_ids) >= 800 and len(result.prompt_token_ids) + NEW_TOKENS > 1024
    return result


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_single_row_loop_equals_plain(auto_engine, plain, gamma):
    spec = auto_engine.generate(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0, gamma=gamma)
    assert spec.stats.proposed > 0, "prompt lookup should speculate on a copy"
    assert spec.token_ids == plain.token_ids


def test_batched_loop_equals_plain(auto_engine, plain):
    (spec,), stats = auto_engine.generate_batch(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0, gamma=8)
    assert stats.proposed > 0 and spec.token_ids == plain.token_ids


def test_server_equals_plain(auto_engine, plain):
    for server in _running(create_app(auto_engine, model_name="long"), None):
        resp = server.client.chat.completions.create(  # a fixed γ: whether auto drafts is priced by timing
            model="long", messages=[{"role": "user", "content": PROMPT}], max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"gamma": 8})
        assert resp.choices[0].message.content == plain.text
        assert resp.model_extra["speculative"]["proposed"] > 0
        info = server.client.models.list().data[0].model_extra["exactspec"]
        assert info["dtype"] == auto_engine.dtype and info["greedy_identity"] == auto_engine.runtime()["greedy_identity"]
