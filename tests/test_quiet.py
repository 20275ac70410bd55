"""Measurements that know when they were disturbed (quiet.py, cachedir.measured_once(timed=...)): a timed
cache entry taken while other processes computed is provisional, a later quiet start measures it again,
and `exactspec tune --remeasure` measures it on demand."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from exactspec import cachedir, quiet
from exactspec.cachedir import cache_dir, measured_once, provisional, remeasure, write_atomic


HOG = "import time\nt = time.time() + {s}\nwhile time.time() < t: pass\n"


def test_a_window_is_disturbed_when_others_take_more_than_the_idle_cores():
    assert quiet.Window(1.0, 1.0, threads=2, cpus=2).disturbed  # a hog on one of our two cores
    assert not quiet.Window(1.0, 0.1, threads=2, cpus=2).disturbed  # a daemon's tick
    assert not quiet.Window(1.0, 3.0, threads=2, cpus=8).disturbed  # six idle cores took it
    assert quiet.Window(1.0, 6.5, threads=2, cpus=8).disturbed
    assert not quiet.Window(1.0, None, threads=2).disturbed  # unknown (no /proc/stat): as before the check
    assert "1.00 of 2 CPUs" in quiet.Window(2.0, 2.0, threads=2, cpus=2).describe()


def test_a_cpu_hog_is_seen():
    """Two processes spinning beside a window this process sleeps through: others took most of the
    machine (a real hog, read from /proc/stat, not a simulated one)."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG.format(s=3.0)]) for _ in range(2)]
    try:
        time.sleep(0.3)  # the interpreters start
        window = quiet.busy_now(threads=2, seconds=1.0)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert window.others is not None, "/proc/stat unreadable on Linux"
    assert window.disturbed and window.others_cores > 1.0, window


@pytest.fixture
def entry(tmp_path, monkeypatch):
    """A timed cache entry in a fresh cache, this process having decided about nothing yet."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("EXACTSPEC_REMEASURE_ATTEMPTS", "3")
    monkeypatch.setattr(cachedir, "_looked", set())
    monkeypatch.setattr(cachedir, "_force", set())
    path = cache_dir("target-costs") / "entry.json"
    measured = []

    def get(value: int) -> int:
        def measure() -> int:
            measured.append(value)
            return value
        return measured_once(path, lambda: json.loads(path.read_text()) if path.exists() else None, measure,
                             lambda v: write_atomic(path, json.dumps(v)), timed=2)
    return path, get, measured


def machine(monkeypatch, busy: bool) -> None:
    """The machine as quiet.py will see it, during a measurement and at a start: busy or quiet."""
    window = quiet.Window(1.0, 1.5 if busy else 0.0, threads=2, cpus=2)

    class Watch(quiet.Watch):
        def __exit__(self, *exc) -> None:
            self.window = window
    monkeypatch.setattr(quiet, "Watch", Watch)
    monkeypatch.setattr(quiet, "busy_now", lambda threads, seconds=0.0: window)


def next_start(monkeypatch) -> None:
    monkeypatch.setattr(cachedir, "_looked", set())


def test_a_busy_measurement_is_provisional_and_a_quiet_start_measures_it_again(entry, monkeypatch):
    path, get, measured = entry
    machine(monkeypatch, busy=True)
    assert get(1) == 1 and "1.50 of 2 CPUs" in provisional(path)
    assert get(2) == 1 and measured == [1]  # the same process: decided once
    next_start(monkeypatch)
    assert get(3) == 1 and measured == [1]  # still busy at the next start: no second measurement beside it
    machine(monkeypatch, busy=False)
    next_start(monkeypatch)
    assert get(4) == 4 and measured == [1, 4] and provisional(path) is None  # quiet: measured again, final
    next_start(monkeypatch)
    assert get(5) == 4 and measured == [1, 4]  # final: read back


def test_a_quiet_first_measurement_is_final(entry, monkeypatch):
    path, get, measured = entry
    machine(monkeypatch, busy=False)
    assert get(1) == 1 and provisional(path) is None
    next_start(monkeypatch)
    assert get(2) == 1 and measured == [1]


def test_re_measuring_stops_after_its_attempts_until_asked(entry, monkeypatch):
    """A start that finds the machine quiet, then measures while it is busy again, counts an attempt; after
    REMEASURE_ATTEMPTS the entry waits for `exactspec tune --remeasure` (`remeasure`), which measures it
    whatever the cache holds."""
    path, get, measured = entry
    machine(monkeypatch, busy=True)
    get(0)
    for attempt in range(1, 5):
        monkeypatch.setattr(quiet, "busy_now", lambda threads, seconds=0.0: quiet.Window(1.0, 0.0, 2, 2))
        next_start(monkeypatch)
        get(attempt)
    assert measured == [0, 1, 2, 3] and provisional(path)  # three attempts, then no more
    next_start(monkeypatch)
    machine(monkeypatch, busy=False)
    remeasure("target-costs")
    assert get(9) == 9 and measured == [0, 1, 2, 3, 9] and provisional(path) is None
    assert get(10) == 9  # once per process


def test_tune_offers_remeasure():
    """`exactspec tune --remeasure` (what `remeasure` above serves; one run measures the self-test and T(k)
    of the embedded model, ~70 s here: too long for the suite, run by hand in docs/cli.md)."""
    out = subprocess.run([sys.executable, "-m", "exactspec.cli", "tune", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--remeasure" in out.stdout and "provisional" in out.stdout


def test_t_k_refined_by_real_iterations_is_persisted_within_bounds(tiny_target, tmp_path, monkeypatch):
    """A wrong T(k) table heals by itself: what real iterations refined is written back to the cache entry
    (`Learned.save_costs`), so the next start begins from it; never more than REFINE_BOUND x away from the
    table as measured, however far the evidence pulls, and only after MIN_REFINED new iterations."""
    from exactspec.autogamma.learned import MIN_REFINED
    from exactspec.autogamma.measure import REFINE_BOUND
    from exactspec.drafting import Drafting

    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    tiny_target.cost_key = "test|refined"
    try:
        drafts = Drafting(tiny_target)
        cost = drafts.cost_model("prompt-lookup", max_gamma=4)
        measured = list(cost.target_s)
        for _ in range(MIN_REFINED):
            cost.observe_target(1, 1.5 * measured[0])  # serving finds steps 1.5x the measurement
        assert drafts.learned.save_costs() and not drafts.learned.save_costs()  # nothing new: not written again
        first = Drafting(tiny_target).cost_model("prompt-lookup", max_gamma=4).target_s  # the next start
        assert 1.4 * measured[0] < first[0] <= 1.5 * measured[0] + 1e-12
        assert first[3] - first[0] == pytest.approx(measured[3] - measured[0])  # a wider pass: what it adds kept
        for _ in range(200):
            cost.observe_target(1, 1000.0)  # absurd evidence
        assert drafts.learned.save_costs()
        bounded = Drafting(tiny_target).cost_model("prompt-lookup", max_gamma=4).target_s
        assert bounded[0] == pytest.approx(REFINE_BOUND * measured[0])
    finally:
        del tiny_target.cost_key
