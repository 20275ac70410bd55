"""The cache of what is measured once per machine and model (cachedir.py): one process at a time measures
an entry, and whoever waited reads what the first one wrote."""

from __future__ import annotations

import json
import threading
import time

import pytest

from exactspec.cachedir import cache_dir, machine_key, measured_once, write_atomic


def test_an_entry_is_measured_once_while_others_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    path = cache_dir("things") / "entry.json"
    measured, results = [], []

    def read():
        return json.loads(path.read_text()) if path.exists() else None

    def measure():
        measured.append(threading.get_ident())
        time.sleep(0.3)  # the others arrive meanwhile (separate lock files opened: flock holds between them)
        return {"value": 42}

    def one():
        results.append(measured_once(path, read, measure, lambda v: write_atomic(path, json.dumps(v))))

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == [{"value": 42}] * 3 and len(measured) == 1
    path.write_text("not json")  # unreadable: measured again, once
    assert measured_once(path, lambda: None if path.read_text() == "not json" else read(), measure,
                         lambda v: write_atomic(path, json.dumps(v))) == {"value": 42} and len(measured) == 2


def test_what_is_measured_under_another_openmp_waiting_policy_is_another_entry(monkeypatch):
    """A verdict ranked by speed under PASSIVE waiting (the suite's) is not the default's (a user's)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    default = machine_key(1, "model")
    assert machine_key(1, "model") == default
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    passive = machine_key(1, "model")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert len({default, passive, machine_key(1, "model")}) == 3


def test_a_measurement_runs_in_a_thread_of_its_own_that_exits(tmp_path):
    """`measured_once` measures in a thread that then exits (`in_own_thread`): OpenMP keeps a team of threads
    per thread that computed, and a self-test's team left on the caller's thread made a server's worker
    decode at half speed (libgomp's throttled waiting). Its value comes back; its exception is raised."""
    from exactspec.cachedir import in_own_thread

    seen = []

    def measure() -> int:
        seen.append(threading.current_thread())
        return 7

    path = tmp_path / "entry.json"
    assert measured_once(path, lambda: None, measure, lambda value: None) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fails() -> int:
        raise ValueError("measured badly")

    with pytest.raises(ValueError, match="measured badly"):
        in_own_thread(fails)


def test_a_measurement_inside_an_own_thread_runs_there():
    """`engine.load` loads and measures in one thread of its own: a measurement started from there in a
    thread of its own would compute beside the loading thread's team (libgomp's throttled mode: T(1)
    measured at 26 ms instead of 4 on a Xeon VM), so it runs in the thread it was called from."""
    from exactspec.cachedir import in_own_thread

    outer, inner = in_own_thread(lambda: (threading.current_thread(), in_own_thread(threading.current_thread)))
    assert outer is inner and outer is not threading.current_thread() and not outer.is_alive()
    assert in_own_thread(threading.current_thread) is not outer  # the flag left with its thread


def test_load_loads_and_measures_in_a_thread_that_exits(monkeypatch, tmp_path):
    """`exactspec.load`: the models are loaded and a cached T(k) measured off the caller's thread, in one
    thread: a team libgomp kept on the caller's thread made a server's worker decode 5x slower."""
    import exactspec
    from exactspec import engine
    from exactspec.autogamma import measure

    threads = {}
    load_models = engine.load_models

    def loading(*args, **kwargs):
        threads["load"] = threading.current_thread()
        return load_models(*args, **kwargs)

    def measuring(target, max_k):  # a table, without timing (this test times nothing)
        threads["measure"] = threading.current_thread()
        return [100], [[0.001 * (k + 1) for k in range(max_k)]]

    monkeypatch.setattr(engine, "load_models", loading)
    monkeypatch.setattr(measure, "measure_depths", measuring)
    monkeypatch.setattr(measure, "costs_path", lambda target, max_k: tmp_path / "costs.json")  # not yet measured
    loaded = exactspec.load(backend="llama.cpp", rows=1, ctx_size=512)
    assert threads["load"] is threads["measure"] is not threading.current_thread(), threads
    assert not threads["load"].is_alive() and loaded.drafts.target_measured
