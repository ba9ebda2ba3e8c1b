"""The bench's launches on loopback: a port taken between ``free_port`` and torchrun's bind (``EADDRINUSE``, a
parallel test or another program) costs one more try, not the run; any other failure is reported as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradientflow.bench import runner_launch


def _fake(out: Path, logs: list[str]):
    tries: list[int] = []

    def once(name, spec_path, out_, nproc, cluster, timeout, threads, module, nproc_per_node):
        tries.append(1)
        log = out / f"launch-{name}.log"
        text = logs[len(tries) - 1]
        log.write_text(text)
        return (None if text == "ok" else "launcher 0 exited with code 1"), log, 1.0

    return once, tries


@pytest.mark.parametrize(
    ("logs", "reason", "tries"),
    [
        (["DistNetworkError: ... EADDRINUSE, message: address already in use", "ok"], None, 2),
        (["RuntimeError: a rank failed", "ok"], "launcher 0 exited with code 1", 1),
        (["... EADDRINUSE ...", "... EADDRINUSE ..."], "launcher 0 exited with code 1", 2),  # once more, not forever
    ],
)
def test_a_port_taken_before_torchrun_binds_it_is_tried_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: list[str], reason: str | None, tries: int
) -> None:
    once, calls = _fake(tmp_path, logs)
    monkeypatch.setattr(runner_launch, "_launch_once", once)
    got, log, seconds = runner_launch.launch_workers("main", tmp_path / "spec.json", tmp_path, 2, None, 60.0, 1)
    assert (got, len(calls), seconds) == (reason, tries, float(tries))
    assert log == tmp_path / "launch-main.log"
    assert (tmp_path / "launch-main.port-taken.log").exists() == (tries == 2)
