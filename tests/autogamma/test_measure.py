"""The timed forwards that start auto γ's prices (autogamma/measure.py): T(k) measured once per machine
and model, the depths it is measured at, and what a change of pass shape is charged."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")


def test_target_costs_are_measured_once_per_machine_and_model(tiny_target, tmp_path, monkeypatch):
    """auto γ's T(k) for an adapter whose loader keyed it (`cost_key`) is measured once, then read back from
    the cache (a new engine, a new process: the same file); an unkeyed adapter is measured every time;
    a corrupt entry is measured again. The tiny target's 128-token context holds no deeper depth."""
    from exactspec.autogamma import measure

    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    calls = []
    real = measure.measure_target
    monkeypatch.setattr(measure, "measure_target", lambda target, max_k: calls.append(max_k) or real(target, max_k=max_k))
    depths, curves = measure.target_costs(tiny_target, 5)  # unkeyed: measured
    assert depths == [100] and len(curves) == 1 and len(curves[0]) == 5 and calls == [5]
    tiny_target.cost_key = "test|tiny"
    try:
        keyed = measure.target_costs(tiny_target, 5)
        assert measure.target_costs(tiny_target, 5) == keyed and calls == [5, 5]  # read back
        for entry in (tmp_path / "target-costs").iterdir():
            entry.write_text("[not json")
        assert len(measure.target_costs(tiny_target, 5)[1][0]) == 5 and calls == [5, 5, 5]
    finally:
        del tiny_target.cost_key


def test_depths_measured_are_capped_by_the_context(tiny_target, monkeypatch):
    """T(k) is measured at ~100, ~1000 and ~3000 tokens where the target's context holds them (each at
    least twice the one before); the deeper curves come from one cache prefilled in turn."""
    from types import SimpleNamespace

    from exactspec.autogamma import measure
    from exactspec.autogamma.measure import deeper_depths, fitting_depth, measure_deeper

    assert deeper_depths(SimpleNamespace(max_length=8192), 33, 100) == [1000, 3000]
    assert deeper_depths(SimpleNamespace(max_length=2048), 33, 100) == [1000, 2014]
    assert deeper_depths(SimpleNamespace(max_length=1200), 33, 100) == [1000]  # 1166: too close to 1000
    assert deeper_depths(SimpleNamespace(max_length=700), 33, 100) == [666]
    assert deeper_depths(SimpleNamespace(max_length=128), 5, 100) == []
    assert fitting_depth(SimpleNamespace(max_length=128), 5, 100) == 100
    depths, curves = measure_deeper(tiny_target, 3, [20, 60], reps=1, base=10)
    assert depths == [20, 60] and len(curves) == 2 and all(len(c) == 3 and min(c) > 0 for c in curves)
    # a prefill that takes too long: the depth reached is the last measured, if deep enough
    assert measure_deeper(tiny_target, 3, [20, 60], reps=1, base=10, budget_s=1e-9)[0] == [20]
    monkeypatch.setattr(measure, "DEEP_PREFILL_CHUNK", 16)
    assert measure_deeper(tiny_target, 3, [40], reps=1, base=5, budget_s=1e-9)[0] == [16]
    assert measure_deeper(tiny_target, 3, [40], reps=1, base=10, budget_s=1e-9) == ([], [])


def test_measured_costs_charge_a_change_of_shape(tiny_target, monkeypatch):
    """`measure_target`: T(1) is a one-token step after one-token steps; a wider pass is charged the change
    of shape it pays and the one the next one-token step pays (llama.cpp builds a graph per new shape), the
    latter at most CHANGE_CAP of a step. On the real tiny target wrapped to take `step` seconds more per
    pass, and `change` more on a pass whose width differs from the last one's -- on an injected clock that
    only those passes advance: the charges are asserted exactly, whatever else the machine runs."""
    from types import SimpleNamespace

    from exactspec.autogamma import measure
    from exactspec.autogamma.measure import CHANGE_CAP, measure_target

    clock = [0.0]
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    class ShapeChanges:
        def __init__(self, model, step: float, change: float):
            self.model, self.step, self.change, self.last = model, step, change, None

        def __getattr__(self, name):
            return getattr(self.model, name)

        def forward(self, ids, *args, **kwargs):
            clock[0] += self.step + (self.change if ids.shape[1] != self.last else 0.0)
            self.last = ids.shape[1]
            return self.model.forward(ids, *args, **kwargs)

    plain = measure_target(ShapeChanges(tiny_target, 0.04, 0.0), max_k=4, context=8, reps=3)
    small = measure_target(ShapeChanges(tiny_target, 0.04, 0.008), max_k=4, context=8, reps=3)
    large = measure_target(ShapeChanges(tiny_target, 0.04, 0.05), max_k=4, context=8, reps=3)
    assert small[0] == pytest.approx(plain[0], abs=1e-9) and large[0] == pytest.approx(plain[0], abs=1e-9)
    assert 0.008 < CHANGE_CAP * plain[0]  # the small change is under the cap
    for k in range(2, 5):  # each wider pass: its own change of shape, and the next step's (capped)
        assert small[k - 1] - plain[k - 1] == pytest.approx(2 * 0.008, abs=1e-9)
        assert large[k - 1] - plain[k - 1] == pytest.approx(0.05 + CHANGE_CAP * large[0], abs=1e-9)
