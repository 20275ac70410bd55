"""The peer bench's harness (bench/peer.py): its client against our real server, its table's ratios and
exactness column, and its refusals. (llama-server itself is built for the bench only, never here.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from exactspec.bench import peer
from exactspec.errors import ExactSpecError
from exactspec.server.app import create_app

from ..conftest import prefix_cached
from ..helpers.servers import _running


@pytest.fixture(scope="module")
def api(embedded_llamacpp):
    yield from _running(create_app(embedded_llamacpp, model_name="peer-test"), None)


def test_the_client_reads_our_server(api, embedded_llamacpp, monkeypatch):
    monkeypatch.setitem(peer.MAX_TOKENS, "chat", 8)
    monkeypatch.setitem(peer.MAX_TOKENS, "concurrent", 8)
    alone = peer.run_workload(api.base, "chat", {"gamma": 0})
    texts = [c.text for c in alone.calls]
    assert alone.seconds > 0 and len(texts) == len(peer.load_workload("chat")) and 0 < alone.tokens <= 8 * len(texts)
    together = peer.run_workload(api.base, "concurrent", {})  # gamma auto, 8 requests at a time
    assert [c.text for c in together.calls] == texts  # greedy: the same texts, batched or not, speculative or not
    streamed = peer.chat(api.base, [{"role": "user", "content": peer.load_workload("chat")[0]}], 8, {}, stream=True)
    assert streamed.text == texts[0] and streamed.tokens == alone.calls[0].tokens  # usage read from the last chunk
    assert 0 < streamed.ttft <= streamed.seconds and streamed.max_gap >= 0
    with prefix_cached(embedded_llamacpp):
        for _ in range(2):
            again = peer.chat(api.base, [{"role": "user", "content": peer.load_workload("chat")[0]}], 8, {})
    assert again.cached > 0 and again.text == texts[0]  # the server's own count of prompt tokens from its cache
    short = peer.run_workload(api.base, "short", {})  # the defaults, one short answer at a time
    assert len(short.calls) == len(peer.load_workload("short")) and 0 < short.tokens <= 16 * len(short.calls)
    with pytest.raises(ExactSpecError, match="answered 400: .*max_tokens"):  # what the server said, one line
        peer.chat(api.base, [{"role": "user", "content": "hi"}], -1, {})


def test_join_measures_the_stream_and_the_joiner(api, embedded_llamacpp, monkeypatch):
    """`join`: a chat answer streams while a long prompt joins: the stream's gaps, the joiner's TTFT
    (here a shortened system prompt: the test engine's context is 1,024 tokens)."""
    work = peer.long_agent()
    assert 3000 < len(embedded_llamacpp.encode(work["system"])) < 4000 and len(work["transcripts"]) == 3
    monkeypatch.setattr(peer, "long_agent", lambda: {**work, "system": work["system"][:2000]})
    monkeypatch.setitem(peer.MAX_TOKENS, "join", 24)
    stream, joiner = peer.join(api.base, {}, delay_s=0.0)
    assert stream.tokens > 0 and stream.max_gap is not None and 0 < joiner.ttft <= joiner.seconds
    assert stream.started < joiner.started  # the joiner is sent once the stream has its first token


def rounds(*specs) -> list:
    """Rounds of (seconds, tokens, texts)."""
    return [peer.Round(s, [peer.Call(t, n // len(texts), s) for t in texts]) for s, n, texts in specs]


def test_table_ratios_phases_and_the_exactness_column():
    servers = [peer.Server("llama-server", [], "llama-server"),
               peer.Server("llama-server --spec-default", [], "llama-server"),
               peer.Server("exactspec plain", [], "exactspec plain"),
               peer.Server("exactspec", [], "exactspec plain")]
    results = {"llama-server": rounds((2.0, 100, ["a", "b"]), (2.0, 100, ["a", "b"]), (4.0, 100, ["a", "b"])),
               "llama-server --spec-default": rounds((1.0, 100, ["a", "c"]), (1.0, 100, ["a", "c"]), (1.0, 100, ["a", "c"])),
               "exactspec plain": rounds((4.0, 100, ["x", "y"]), (4.0, 100, ["x", "y"]), (4.0, 100, ["x", "y"])),
               "exactspec": rounds((2.0, 100, ["x", "y"]), (1.0, 100, ["x", "y"]), (1.0, 100, ["x", "y"]))}
    rows = {(r["phase"], r["method"]): r for r in peer.table_rows(servers, "chat", results)}
    assert rows[("cold", "llama-server")]["vs_llama_server_plain"] == 1.0
    assert rows[("cold", "llama-server --spec-default")]["vs_llama_server_plain"] == 2.0
    assert not rows[("cold", "llama-server --spec-default")]["same_text_as_own_plain"]  # its output changed
    assert rows[("cold", "exactspec plain")]["vs_llama_server_plain"] == 0.5
    cold, warm = rows[("cold", "exactspec")], rows[("warm", "exactspec")]
    assert cold["vs_llama_server_plain"] == 1.0 and cold["same_text_as_own_plain"]
    # warm: 200 tokens in 2 s against 200 in 6 s -> 3.0x from the printed figures (per-round ratios 2x and 4x)
    assert warm["tokens_per_s"] == 100.0 and warm["vs_llama_server_plain"] == 3.0 and warm["ratio_range"] == [2.0, 4.0]
    assert {"workload", "temperature", "method", "drafter", "gamma", "tokens_per_s"} <= warm.keys()
    table = peer.peer_table(list(rows.values()))
    assert "| chat | warm | exactspec | 100.0 | 3.00× [2.00–4.00] | 0 | yes |" in table


def test_bad_peer_options_are_one_line_errors(tmp_path):
    for argv, fragment in ((["--peer", str(tmp_path / "missing")], "not an executable"),
                           (["--peer", sys.executable, "--peer-workloads", "nope"], "unknown peer workload")):
        done = subprocess.run([sys.executable, "-m", "exactspec.cli", "bench", *argv], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode != 0 and fragment in done.stderr and "Traceback" not in done.stderr


def test_the_repack_probe_names_a_binary_killed_by_a_signal_and_only_on_amx_cpus(tmp_path, monkeypatch):
    """`repack_crashes` reads the binary's own fate: a process killed by SIGILL is a crash, one that exits
    with an error is not (that surfaces when the bench starts it); on a CPU without AMX it runs nothing."""
    from exactspec.models.llamacpp import runtime

    dies, fails = tmp_path / "dies", tmp_path / "fails"
    dies.write_text("#!/bin/sh\nkill -ILL $$\n")
    fails.write_text("#!/bin/sh\nexit 3\n")
    for script in (dies, fails):
        script.chmod(0o755)
    monkeypatch.setattr(runtime, "cpu_has_amx", lambda: True)
    assert peer.repack_crashes(str(dies), "model.gguf", 2, str(tmp_path))
    assert not peer.repack_crashes(str(fails), "model.gguf", 2, str(tmp_path))
    monkeypatch.setattr(runtime, "cpu_has_amx", lambda: False)
    assert not peer.repack_crashes(str(dies), "model.gguf", 2, str(tmp_path))


def test_cold_rounds_each_follow_a_fresh_start_and_the_warm_ones_the_last(monkeypatch):
    """`cold` = 2, 3 rounds: every server started twice; the first start runs one (cold) round, the
    second a cold round and two warm ones; the rows' order alternates round by round; the cold phase
    sums the two cold rounds."""
    servers = [peer.Server("llama-server", [], "llama-server"), peer.Server("exactspec", [], "exactspec")]
    events = []
    monkeypatch.setattr(peer, "start", lambda server, workload, log_dir: events.append(("start", server.name)))
    monkeypatch.setattr(peer, "stop", lambda server: events.append(("stop", server.name)))

    def run(url, workload, extra):
        name = next(s for s in servers if s.url == url).name
        events.append(("round", name))
        seconds = 1.0 if name == "llama-server" else [4.0, 2.0, 1.0, 1.0][sum(e == ("round", name) for e in events) - 1]
        return peer.Round(seconds, [peer.Call("x", 100, seconds)])

    for i, server in enumerate(servers):
        server.port = 9000 + i
    monkeypatch.setattr(peer, "run_workload", run)
    rows = {(r["phase"], r["method"]): r for r in peer.run_peer_bench(servers, ["chat"], 3, say=lambda _: None, cold=2)}
    assert events == [("start", "llama-server"), ("start", "exactspec"), ("round", "llama-server"), ("round", "exactspec"),
                      ("stop", "llama-server"), ("stop", "exactspec"),
                      ("start", "llama-server"), ("start", "exactspec"), ("round", "exactspec"), ("round", "llama-server"),
                      ("round", "llama-server"), ("round", "exactspec"), ("round", "exactspec"), ("round", "llama-server"),
                      ("stop", "llama-server"), ("stop", "exactspec")]
    assert rows[("cold", "exactspec")]["tokens_per_s"] == 200 / 6.0  # rounds of 4 s and 2 s
    assert rows[("cold", "exactspec")]["ratio_range"] == [0.25, 0.5]
    assert rows[("warm", "exactspec")]["tokens_per_s"] == 100.0
