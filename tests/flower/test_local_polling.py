"""How `fedsight flower local` waits for its run (``LocalDeployment.wait_run``), on a simulated clock: every
``flwr ls`` is a process importing Flower, so the status is asked every ``poll`` s only while no ServerApp runs
and every ``busy_poll`` s while one does; the end of the ServerApp is noticed at the next tick."""

from __future__ import annotations

import pytest

from fedsight.flower import local as L

pytestmark = pytest.mark.flower


class Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class Scripted(L.LocalDeployment):
    """A deployment whose ServerApp runs from ``start`` to ``end`` (simulated seconds) and whose Flower status
    turns finished ``lag`` s after that; every status request is recorded with its time."""

    def __init__(self, tmp_path, clock: Clock, start: float, end: float, lag: float = 0.0):
        super().__init__(tmp_path)
        self.clock, self.start, self.end, self.lag = clock, start, end, lag
        self.asked: list[float] = []

    def serverapps(self) -> list[int]:
        return [1234] if self.start <= self.clock.now < self.end else []

    def run_status(self, run_id: int) -> dict:
        self.asked.append(self.clock.now)
        done = self.clock.now >= self.end + self.lag
        return {"status": "finished:completed" if done else ("running" if self.serverapps() else "pending")}


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(L.time, "monotonic", c.monotonic)
    monkeypatch.setattr(L.time, "sleep", c.sleep)
    return c


@pytest.mark.parametrize("lag", [0.0, 4.0])
def test_status_is_asked_rarely_while_the_serverapp_runs_and_at_once_when_it_ends(tmp_path, clock, lag):
    dep = Scripted(tmp_path, clock, start=5.0, end=590.0, lag=lag)  # busy polls at 6, 36, ..., 576, 606
    ticks = []
    final = dep.wait_run(7, timeout=10_000, on_poll=lambda: ticks.append(clock.now), poll=3.0, busy_poll=30.0, tick=0.5)
    assert final["status"] == "finished:completed"
    gaps = [b - a for a, b in zip(dep.asked, dep.asked[1:])]
    before = [t for t in dep.asked if t < 5.0]
    during = [t for t in dep.asked if 5.0 <= t < 590.0]
    assert before == [0.0, 3.0]  # every `poll` s before the ServerApp starts
    assert all(g >= 3.0 for g in gaps) and all(b - a >= 30.0 for a, b in zip(during, during[1:]))
    assert len(during) == 20  # 3-second polling would have asked 195 times
    assert dep.asked[len(before) + len(during)] == 590.0  # the first tick after the ServerApp ended asks
    assert dep.asked[-1] - 590.0 <= lag + 3.0  # and every `poll` s after that until Flower says finished
    assert ticks == sorted(ticks) and all(b - a == 0.5 for a, b in zip(ticks, ticks[1:]))  # on_poll every tick


def test_without_proc_the_status_is_asked_every_poll_seconds(tmp_path, clock, monkeypatch):
    """Where the ServerApp process cannot be seen (no /proc), nothing is assumed: every `poll` s."""
    dep = Scripted(tmp_path, clock, start=5.0, end=60.0)
    monkeypatch.setattr(dep, "serverapps", lambda: [])
    dep.wait_run(7, timeout=10_000, poll=3.0, busy_poll=30.0, tick=0.5)
    assert [b - a for a, b in zip(dep.asked, dep.asked[1:])] == [3.0] * (len(dep.asked) - 1)
    assert dep.asked[-1] == 60.0


def test_a_run_that_never_finishes_is_stopped_at_the_timeout(tmp_path, clock, monkeypatch):
    dep = Scripted(tmp_path, clock, start=0.0, end=1e9)
    stopped = []
    monkeypatch.setattr(dep, "flwr", lambda *a, **k: stopped.append(a))
    with pytest.raises(L.FlowerRunError, match="did not finish within 100 s"):
        dep.wait_run(7, timeout=100, poll=3.0, busy_poll=30.0, tick=0.5)
    assert stopped == [("stop", "7", L.CONNECTION)] and clock.now <= 101
