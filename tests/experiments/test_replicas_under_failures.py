"""experiments/replicas_under_failures.py: its failure schedule and the figures it reports, from lines written by
hand (the run itself needs root, namespaces and most of an hour: its record is docs/results/fault-tolerance.md)."""

from __future__ import annotations

from collections import Counter

import pytest
from replicas_under_failures import KINDS, schedule, summarize, table


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_schedule_spreads_every_kind_over_the_run(seed: int) -> None:
    faults = schedule(12, 4000, 30, 3, seed)
    assert len(faults) == 12 and [f["id"] for f in faults] == list(range(12))
    # each of the four kinds 3 times: kills and stops, mid-interval and inside a sync
    assert Counter((f["kind"], f["where"]) for f in faults) == {kind: 3 for kind in KINDS}
    steps = [f["step"] for f in faults]
    assert steps == sorted(steps) and 400 <= steps[0] and steps[-1] <= 3600  # not in the first or last tenth
    assert min(b - a for a, b in zip(steps, steps[1:])) >= 30  # one fault a stretch: never two in one interval
    for f in faults:
        assert 0 <= f["node"] < 3
        # a sync's fault on a sync's step (a multiple of H), a mid-interval one halfway between two
        assert f["step"] % 30 == (0 if f["where"] == "sync" else 15)
    assert schedule(12, 4000, 30, 3, seed) == faults  # seeded: the two systems meet the same schedule


def _lines(final_t: float, lives: dict[int, int], digests: dict[int, str]) -> list[dict]:
    """Three replicas start at t = 10; node 0 syncs once (2 s); each node in ``lives`` starts again (its last life);
    each node in ``digests`` ends at ``final_t`` at step 120 with that digest."""
    lines = [{"node": n, "life": 0, "t": 10.0, "event": "start", "progress": 0} for n in range(3)]
    lines += [{"node": 0, "life": 0, "t": 40.0, "event": "sync", "progress": 30, "dt": 2.0}]
    lines += [{"node": n, "life": life, "t": 50.0, "event": "start", "progress": 30} for n, life in lives.items()]
    lines += [
        {"node": n, "life": lives.get(n, 0), "t": final_t, "event": "final", "progress": 120, "val": 2.0, "digest": d}
        for n, d in digests.items()
    ]
    return lines


def test_summary_goodput_restarts_and_identical_anchors() -> None:
    base = summarize("gradientflow-unfailed", _lines(70.0, {}, {0: "a", 1: "a", 2: "a"}), [], False, 0.0)
    lines = _lines(130.0, {2: 2}, {0: "a", 1: "a", 2: "a"})
    # node 2 killed at t = 20 and back in a sync at t = 62 (its last life); node 1 stopped at t = 45, never back
    lines += [
        {"node": 2, "life": 0, "t": 20.0, "event": "fault", "id": 0, "step": 15, "kind": "kill", "where": "mid"},
        {"node": 2, "life": 2, "t": 62.0, "event": "sync", "progress": 60, "dt": 7.0},
        {"node": 1, "life": 0, "t": 45.0, "event": "fault", "id": 1, "step": 45, "kind": "stop", "where": "mid"},
    ]
    failed = summarize("gradientflow-failed", lines, [{}, {}], False, 0.0)
    # from the last first-life start (t = 10) to the last end: 120 steps in 60 s, then in 120 s
    assert base["seconds"] == pytest.approx(60.0) and base["steps_per_second"] == pytest.approx(2.0)
    assert failed["seconds"] == pytest.approx(120.0)
    assert failed["restarts"] == {"0": 0, "1": 0, "2": 2}  # the lives of the one node that failed
    assert failed["sync_seconds"] == {"0": pytest.approx(2.0), "1": 0, "2": pytest.approx(7.0)}
    # out: node 2 from 20 to its sync at 62; node 1 from 45 to the run's end (its last final, t = 130)
    assert failed["out_seconds"] == [pytest.approx(42.0), pytest.approx(85.0)]
    text = table({"gradientflow-unfailed": base, "gradientflow-failed": failed})
    row = [r for r in text.splitlines() if "| failed |" in r][0]
    # goodput 1 / 2; median out (42 + 85) / 2; every node's extra sync seconds (9 - 2) over 2 faults; the same
    # digest on every replica that ended
    assert "| 0.50 | 63.5 | 3.5 |" in row and "| 0 0 2 | yes | yes |" in row


def test_a_replica_that_ends_apart_from_the_others_is_reported() -> None:
    res = summarize("torchft-failed", _lines(130.0, {1: 1}, {0: "a", 1: "b"}), [{}], True, 0.0)
    assert res["ended"] == [0, 1] and res["hang"]
    row = [r for r in table({"torchft-failed": res}).splitlines() if "| failed |" in r][0]
    assert "| no | no: hang |" in row
