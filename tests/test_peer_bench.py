"""The peer bench's harness (bench/peer.py): its client against our real server, its table's ratios and
exactness column, and its refusals. (llama-server itself is built for the bench only, never here.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from exactspec.bench import peer
from exactspec.errors import ExactSpecError
from exactspec.server.app import create_app

from .test_server import _running


@pytest.fixture(scope="module")
def api(embedded_llamacpp):
    yield from _running(create_app(embedded_llamacpp, model_name="peer-test"), None)


def test_the_client_reads_our_server(api, monkeypatch):
    monkeypatch.setitem(peer.MAX_TOKENS, "chat", 8)
    monkeypatch.setitem(peer.MAX_TOKENS, "concurrent", 8)
    seconds, tokens, texts = peer.run_workload(api.base, "chat", {"gamma": 0}, 1)
    assert seconds > 0 and len(texts) == len(peer.load_workload("chat")) and 0 < tokens <= 8 * len(texts)
    together = peer.run_workload(api.base, "concurrent", {}, 4)  # gamma auto, 4 requests at a time
    assert together[2] == texts  # greedy: the same texts, batched or not, speculative or not
    with pytest.raises(ExactSpecError, match="answered 400: .*max_tokens"):  # what the server said, one line
        peer.chat(api.base, [{"role": "user", "content": "hi"}], -1, {})


def test_table_ratios_and_the_exactness_column():
    servers = [peer.Server("llama-server", [], {"llama-server": {}}, "llama-server"),
               peer.Server("llama-server --spec-default", [], {"llama-server --spec-default": {}}, "llama-server"),
               peer.Server("exactspec", [], {"exactspec plain": {"gamma": 0}, "exactspec": {}}, "exactspec plain")]
    results = {("chat", "llama-server"): peer.Result([2.0, 2.0], [100, 100], [["a", "b"], ["a", "b"]]),
               ("chat", "llama-server --spec-default"): peer.Result([1.0, 1.0], [100, 100], [["a", "c"], ["a", "c"]]),
               ("chat", "exactspec plain"): peer.Result([4.0, 4.0], [100, 100], [["x", "y"], ["x", "y"]]),
               ("chat", "exactspec"): peer.Result([1.0, 1.0], [100, 100], [["x", "y"], ["x", "y"]])}
    rows = {r["method"]: r for r in peer.table_rows(servers, ["chat"], results)}
    assert rows["llama-server"]["vs_llama_server_plain"] == 1.0
    assert rows["llama-server --spec-default"]["vs_llama_server_plain"] == 2.0
    assert not rows["llama-server --spec-default"]["same_text_as_own_plain"]  # its output changed
    assert rows["exactspec plain"]["vs_llama_server_plain"] == 0.5
    assert rows["exactspec"]["vs_llama_server_plain"] == 2.0 and rows["exactspec"]["same_text_as_own_plain"]
    assert {"workload", "temperature", "method", "drafter", "gamma", "tokens_per_s"} <= rows["exactspec"].keys()
    assert "| chat | exactspec | 1.00 | 100.0 | 2.00× | yes |" in peer.peer_table(list(rows.values()))


def test_bad_peer_options_are_one_line_errors(tmp_path):
    for argv, fragment in ((["--peer", str(tmp_path / "missing")], "not an executable"),
                           (["--peer", sys.executable, "--peer-workloads", "nope"], "unknown peer workload")):
        done = subprocess.run([sys.executable, "-m", "exactspec.cli", "bench", *argv], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode != 0 and fragment in done.stderr and "Traceback" not in done.stderr
