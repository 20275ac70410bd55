"""The agent workload: shipped transcripts, replayed step by step; rows carry per-step latency fields."""

from __future__ import annotations

import pytest

from exactspec.bench import agent
from exactspec.bench.agent import build_agent_methods, load_agent_workload, replay, run_agent_bench
from exactspec.errors import ExactSpecError
from exactspec.server.cli import add_serve_subcommand, cmd_serve


def test_workload_is_shipped_data():
    workload = load_agent_workload()
    assert workload["system"] and len(workload["transcripts"]) >= 3
    assert all(len(t["steps"]) >= 3 and t["task"] for t in workload["transcripts"])


def test_agent_rows(embedded, monkeypatch):
    """The bench's rows, and the texts its replays produced (recorded on the way, not replayed again)."""
    methods = build_agent_methods(embedded, ["prompt-lookup"], [4], 64, hf=False)
    assert [m.method for m in methods] == ["exactspec-plain-nocache", "exactspec-plain", "exactspec-spec"]
    texts = {m.method: [] for m in methods}

    def recording(method, *args, **kwargs):
        steps = replay(method, *args, **kwargs)
        texts[method.method] += [s.text for s in steps]
        return steps

    monkeypatch.setattr(agent, "replay", recording)
    rows = run_agent_bench(embedded, methods, 0.0, transcripts=1, steps=2, max_new_tokens=8)
    first, *others = texts.values()
    assert len(first) == 2 and all(t == first for t in others)  # greedy identity, with and without cache and speculation
    assert embedded.prefix_cache is None  # the bench leaves the engine as it found it
    by = {r["method"]: r for r in rows}
    for r in rows:
        assert r["workload"] == "agent" and r["steps"] == 2
        for key in ("tokens_per_s", "speedup_vs_plain", "step_latency_s", "step_latency_p90_s", "ttft_s",
                    "ttft_p90_s", "cached_tokens", "cached_tokens_p90", "prefill_tokens_avoided",
                    "tokens_per_target_call", "gamma", "drafter", "temperature"):
            assert key in r
        assert 0 < r["ttft_s"] <= r["step_latency_s"] <= r["step_latency_p90_s"]
    assert by["exactspec-plain-nocache"]["prefill_tokens_avoided"] == 0
    assert by["exactspec-plain"]["prefill_tokens_avoided"] > 0 and by["exactspec-spec"]["cached_tokens_p90"] > 0


def test_serve_refuses_a_negative_cache_budget():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_subcommand(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).prefix_cache_mb > 0  # on by default
    with pytest.raises(ExactSpecError, match="prefix-cache-mb"):
        cmd_serve(parser.parse_args(["serve", "--prefix-cache-mb", "-1"]))


def test_agent_repeat_interleaves_sessions_and_keeps_the_store(embedded):
    """agent-repeat: every kind's first session, then every kind's second...; a method keeps its store
    from session to session (a later session drafts from an earlier one's answers), and the bench
    leaves the engine's own store as it was."""
    from exactspec.bench.agent import load_agent_repeat

    work = load_agent_repeat()
    kinds = [t["kind"] for t in work["transcripts"]]
    n = len(set(kinds))
    assert n >= 3 and kinds[:n] == kinds[n:2 * n] and len(set(kinds[:n])) == n
    assert all("{" not in t["task"] for t in work["transcripts"])  # every placeholder filled
    store = embedded.drafts.store
    methods = build_agent_methods(embedded, ["suffix"], [4], 64, hf=False, store_mb=8)
    assert methods[-1].store_mb == 8 and methods[-1].drafter == "suffix"
    rows = run_agent_bench(embedded, methods, 0.0, transcripts=2, steps=1, max_new_tokens=6, name="agent-repeat")
    assert embedded.drafts.store is store
    by = {r["method"]: r for r in rows}
    assert by["exactspec-spec"]["workload"] == "agent-repeat" and by["exactspec-spec"]["store_mb"] == 8
    assert by["exactspec-spec"]["steps"] == 2


def test_repeat_steps_feeds_each_answer_back_into_its_session(embedded_llamacpp, monkeypatch):
    """agent-repeat's first steps, as the scripts serve them: `steps` results, each step's messages its
    session's history with the answers before it, a new session opening with its own task."""
    seen = []
    generate = embedded_llamacpp.generate
    monkeypatch.setattr(embedded_llamacpp, "generate",
                        lambda messages, **kw: seen.append([dict(m) for m in messages]) or generate(messages, **kw))
    work = agent.load_agent_repeat()
    first = len(work["transcripts"][0]["steps"])
    out = list(agent.repeat_steps(embedded_llamacpp, first + 1))
    assert len(out) == len(seen) == first + 1
    assert seen[1][:-2] == seen[0] and seen[1][-2] == {"role": "assistant", "content": out[0].text}
    assert seen[first][:3] == agent.opening(work, work["transcripts"][1]) and len(seen[first]) == 4
