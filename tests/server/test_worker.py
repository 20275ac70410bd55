"""The server's worker persists T(k) as serving refined it only from a quiet machine's timings."""

from __future__ import annotations

from exactspec import quiet
from exactspec.server.metrics import Metrics
from exactspec.server.worker import Worker


class Since:
    """A window as quiet.Watch.so_far reports it: other processes took `others` CPU-seconds in 1 s."""

    def __init__(self, others: float):
        self.others = others

    def so_far(self) -> quiet.Window:
        return quiet.Window(1.0, self.others, threads=2, cpus=2)


def test_refined_costs_are_persisted_only_from_a_quiet_window(embedded, monkeypatch):
    saved = []
    monkeypatch.setattr(embedded.drafts.learned, "save_costs", lambda: saved.append(True) or True)
    worker = Worker(embedded, Metrics(), 1)
    worker._costs_watch = Since(others=1.5)  # a compile beside the server: its timings price a busy machine
    worker.save_costs()
    assert saved == [] and isinstance(worker._costs_watch, quiet.Watch)  # a new window starts
    worker._costs_watch = Since(others=0.05)
    worker.save_costs()
    assert saved == [True]
