"""docs/multi-node.md's two-machine launch, run as written between two network namespaces of this machine.

The page's torchrun command for machines whose hostname resolves to none of their addresses on the network
between them (the namespaces share this machine's hostname, so they are such machines) is read from the page,
its placeholders filled in (G = 2 ranks a machine, nodeA = machine A's address, ADDR / IFACE = each machine's
own, machine B's ``is_host=0``), and run in each namespace with the page's confirmation script as ``train.py``.
What it must show: both torchruns exit 0, and every one of the 4 ranks prints the two-level layout the page
says it prints (``2x2 2 2`` and a positive count of bytes sent between machines).  Needs root and ``ip``
(the bench's :class:`~gradientflow.bench.cluster.EmulatedCluster`, unshaped: two node namespaces behind a
routing one, link-local addresses, all deleted on the way out, also on failure).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradientflow.bench.cluster import EmulatedCluster, can_emulate, leftovers

CAN, WHY = can_emulate()
PREFIX = f"gfl{os.getpid() % 100000}"  # our own: never touches a concurrent run's namespaces
PAGE = Path(__file__).resolve().parents[1] / "docs" / "multi-node.md"
SECTION = "## Launching on two real machines"


def _blocks(lang: str) -> list[str]:
    """The ``lang`` code blocks of the page's launch section, in order."""
    text = PAGE.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def test_the_page_holds_the_command_and_the_script() -> None:
    """The command the launch test runs is the page's one with both flags, the script its confirmation."""
    (command,) = [b for b in _blocks("bash") if "--local-addr" in b]
    assert "--rdzv-conf is_host=1" in command and "GLOO_SOCKET_IFNAME=IFACE" in command
    (script,) = [b for b in _blocks("python") if "comm_stats()" in b]
    assert "model.config.topology" in script


def _fill(command: str, values: dict[str, str]) -> str:
    for placeholder, value in values.items():
        command = re.sub(rf"(?<![\w.-]){re.escape(placeholder)}(?![\w-])", value, command)
    return command


@pytest.mark.skipif(not CAN, reason=f"cannot make network namespaces: {WHY}")
def test_the_pages_command_launches_two_level_between_two_namespaces(tmp_path: Path) -> None:
    (command,) = [b for b in _blocks("bash") if "--local-addr" in b]
    (script,) = [b for b in _blocks("python") if "comm_stats()" in b]
    train = tmp_path / "train.py"
    train.write_text(script)
    # torchrun from this interpreter's environment, as `torchrun` on a machine's PATH
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs, logs = [], []
    with EmulatedCluster(nodes=2, rate="none", prefix=PREFIX) as cluster:
        for node in range(2):
            filled = _fill(
                command,
                {
                    "G": "2",
                    "nodeA": cluster.addresses[0],
                    "JOB": f"{PREFIX}job",
                    "IFACE": cluster.ifnames[node],
                    "ADDR": cluster.addresses[node],
                    "train.py": str(train),
                    "is_host=1": f"is_host={int(node == 0)}",
                },
            )
            log = tmp_path / f"machine{node}.log"
            logs.append(log)
            # the page's command sets GLOO_SOCKET_IFNAME itself: the cluster's own default is taken away first
            argv = ["bash", "-c", f"unset GLOO_SOCKET_IFNAME\n{filled}"]
            procs.append(cluster.popen(node, argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT))
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=240))
            except subprocess.TimeoutExpired:
                codes.append(None)  # the cluster's teardown stops it
    assert leftovers(PREFIX) == []
    out = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(o[-3000:] for o in out)
    printed = {}
    for machine, text in enumerate(out):
        for rank, topology, nodes, per_node, inter in re.findall(r"^(\d) (\S+) (\d+) (\d+) (\S+)$", text, re.M):
            printed[int(rank)] = (machine, topology, int(nodes), int(per_node), inter)
    assert sorted(printed) == [0, 1, 2, 3], out
    for _machine, topology, nodes, per_node, inter in printed.values():
        assert (topology, nodes, per_node) == ("2x2", 2, 2), printed
        assert inter != "None" and int(inter) > 0, printed
    # each machine is one node of torchrun's: two consecutive ranks (which machine is node 0 is the join order's)
    assert printed[0][0] == printed[1][0] != printed[2][0] == printed[3][0], printed
