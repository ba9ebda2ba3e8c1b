"""Link profiles (``gradientflow bench --links``): the matrix the issue asks for, how each profile is
shaped, and that nothing the bench creates outlives it: not after a normal exit, not when a rank
fails, not when the run is interrupted.

The netns tests need root, ``ip`` and ``tc`` and are skipped (with the reason) otherwise; each uses
its own prefix so concurrent runs never touch each other.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradientflow.bench import cluster as gfc
from gradientflow.bench.cluster import EmulatedCluster, can_emulate, leftovers
from gradientflow.bench.links import PROFILES, SMALL_BURST_BYTES, LinkProfile, parse_links
from gradientflow.bench.links_report import efficiency_rows

CAN, WHY = can_emulate()
needs_netns = pytest.mark.skipif(not CAN, reason=f"cannot emulate a cluster: {WHY}")
PREFIX = f"gfl{os.getpid() % 100000}"
SRC = str(Path(gfc.__file__).resolve().parents[2])

# A rank that fails: rank 1 exits at once, rank 0 waits for it in a barrier (and times out after 5 s).
FAILING_RANK = r"""
import datetime, sys, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
if dist.get_rank() == 1:
    sys.exit(3)
dist.barrier()
"""
# Ranks that run "forever" (until interrupted); each says when it is up.
LONG_RANKS = r"""
import os, sys, time
print("[gf] rank", os.environ["RANK"], "up", file=sys.stderr, flush=True)
time.sleep(120)
"""


ECHO_SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.sendall(c.recv(100)); c.close()
"""
ECHO_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.sendall(b"ping"); sys.stdout.write(c.recv(100).decode())
"""


def test_matrix_has_the_profiles_of_the_issue():
    names = [p.name for p in parse_links("all")]
    assert names == ["1g-burst", "1g-small", "1g-small-warm", "1g-small-jumbo", "1g-htb", "10g", "100m", "1g-bridge4"]
    rates = {p.name: p.rate_bps for p in PROFILES.values()}
    assert rates["10g"] == 10 * rates["1g-burst"] == 100 * rates["100m"] == 10**10
    assert PROFILES["1g-small"].bucket_bytes() == SMALL_BURST_BYTES <= 64 * 1024
    # the large bucket is today's: rate/HZ, at least one GSO packet, so well above the small one
    assert PROFILES["1g-burst"].bucket_bytes() == gfc.tbf_burst_bytes(10**9) > 64 * 1024
    bridge = PROFILES["1g-bridge4"]
    assert (bridge.nodes, bridge.topology, bridge.workload) == (4, "bridge", "tiny_transformer")
    assert [p.name for p in parse_links(" 10g, 1g-htb ,10g")] == ["10g", "1g-htb"]
    for bad in ("", "1g", "all,10g"):
        with pytest.raises(ValueError, match="choose from"):
            parse_links(bad)
    with pytest.raises(ValueError, match="shaper"):
        LinkProfile("x", "1gbit", shaper="netem")
    with pytest.raises(ValueError, match="rate"):
        LinkProfile("x", "none")


def test_shape_commands():
    tbf = PROFILES["1g-small"].shape_commands("ns", "eth")
    assert tbf == [
        "tc -n ns qdisc add dev eth root tbf rate 1000000000bit burst 32768 latency 400ms".split(),
    ]
    htb = PROFILES["1g-htb"].shape_commands("ns", "eth")
    assert [" ".join(c) for c in htb] == [
        "tc -n ns qdisc add dev eth root handle 1: htb default 10",
        "tc -n ns class add dev eth parent 1: classid 1:10 htb rate 1000000000bit ceil 1000000000bit",
        "tc -n ns qdisc add dev eth parent 1:10 handle 10: fq_codel",
    ]
    assert htb[-1][-1] == "fq_codel" and PROFILES["1g-htb"].shape_commands("ns", "eth", "pfifo")[-1][-1] == "pfifo"


def test_efficiency_is_the_bound_over_the_step():
    # 100 ms compute; at 1e8 B/s a 5e6-byte step takes 50 ms on the wire (bound: compute), a 2e7-byte
    # one 200 ms (bound: wire); a step of 125 ms / 250 ms is then at 0.8 of its bound
    rows = [
        {"name": "compute", "mode": "compute", "status": "ok", "median_s": 0.1, "p10_s": 0.1, "p90_s": 0.1},
        {"name": "a", "mode": "a", "status": "ok", "median_s": 0.125, "wire_bytes": 5e6, "collectives": 4},
        {"name": "b", "mode": "b", "status": "ok", "median_s": 0.25, "wire_bytes": 2e7, "alone_s": 0.13},
        {"name": "c", "mode": "c", "status": "error", "median_s": None},
        {"name": "b alone", "mode": "b", "alone": True, "status": "ok", "median_s": 0.13},
    ]
    for r in rows:
        r.setdefault("ref_compute_s", 0.1)
        r.setdefault("p10_s", r["median_s"])
        r.setdefault("p90_s", r["median_s"])
    rows[2]["alone_ref_compute_s"] = 0.1
    eff = efficiency_rows({"rows": rows}, {"bulk_Bps": 1e8, "small_s": 0.002})
    by = {r["mode"]: r for r in eff}
    assert list(by) == ["compute", "a", "b"]
    assert by["compute"]["efficiency"] == pytest.approx(1.0)
    assert (by["a"]["bound_by"], by["a"]["efficiency"]) == ("compute", pytest.approx(0.8))
    assert (by["b"]["bound_by"], by["b"]["efficiency"]) == ("wire", pytest.approx(0.8))
    assert by["a"]["messages_s"] == pytest.approx(0.008) and by["b"]["own_cpu_s"] == pytest.approx(0.03)


def _qdiscs(ns: str, dev: str) -> str:
    return subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout


def _write_module(tmp_path: Path, name: str, text: str) -> dict[str, str]:
    (tmp_path / f"{name}.py").write_text(text)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC, os.environ.get("PYTHONPATH", "")])}


@needs_netns
def test_bridge_and_htb_profile_is_built_as_said_and_leaves_nothing():
    prefix = PREFIX + "b"
    profile = LinkProfile("t", "1gbit", shaper="htb", topology="bridge", nodes=3)
    with EmulatedCluster(nodes=3, prefix=prefix, profile=profile) as c:
        assert all(a.startswith("169.254.78.") for a in c.addresses)
        links = subprocess.run(["ip", "-n", c.switch, "-o", "link", "show", "master", c.bridge], capture_output=True)
        assert links.stdout.decode().count(f"{prefix}-s") == 3  # every switch port is on the bridge
        for ns, dev in [*zip(c.namespaces, c.ifnames), *((c.switch, s) for s in c.switch_ifnames)]:
            shown = _qdiscs(ns, dev)
            assert "qdisc htb 1:" in shown and f"qdisc {c.leaf} 10:" in shown, shown
        # node 2 reaches node 0 across the bridge (no routes: one L2 segment)
        server = c.popen(0, [sys.executable, "-c", ECHO_SERVER, c.addresses[0]], stdout=subprocess.PIPE, text=True)
        port = server.stdout.readline().strip()
        client = c.popen(2, [sys.executable, "-c", ECHO_CLIENT, c.addresses[0], port], stdout=subprocess.PIPE)
        assert client.communicate(timeout=20)[0] == b"ping" and server.wait(timeout=20) == 0
    assert leftovers(prefix) == []


def test_warm_profile_is_the_small_burst_link_with_tcp_slow_start_after_idle_off():
    small, warm = PROFILES["1g-small"], PROFILES["1g-small-warm"]
    assert warm.shape_commands("ns", "eth") == small.shape_commands("ns", "eth")  # the same shaper
    assert small.node_sysctls() == [] and warm.node_sysctls() == ["net.ipv4.tcp_slow_start_after_idle=0"]
    assert warm.describe().endswith("TCP without slow start after idle")


def test_jumbo_profile_is_the_small_burst_shaper_with_9000_byte_frames():
    small, jumbo = PROFILES["1g-small"], PROFILES["1g-small-jumbo"]
    assert jumbo.shape_commands("ns", "eth") == small.shape_commands("ns", "eth")  # the same shaper
    assert small.mtu is None and jumbo.mtu == 9000
    assert jumbo.bucket_bytes() / jumbo.mtu < 4  # still a bucket of a few frames: a small burst
    assert "MTU 9000" in jumbo.describe() and "MTU" not in small.describe()


def test_a_frame_larger_than_the_bucket_is_refused():
    with pytest.raises(ValueError, match="raise burst"):
        LinkProfile("x", "1gbit", burst=8192, mtu=9000)
    with pytest.raises(ValueError, match="68..65535"):
        LinkProfile("x", "1gbit", mtu=10)


@needs_netns
def test_a_profiles_mtu_is_set_on_both_ends_of_every_veth():
    prefix = PREFIX + "j"
    with EmulatedCluster(nodes=2, prefix=prefix, profile=PROFILES["1g-small-jumbo"]) as c:
        for ns, dev in [*zip(c.namespaces, c.ifnames), *((c.switch, d) for d in c.switch_ifnames)]:
            got = subprocess.run(["ip", "-n", ns, "-o", "link", "show", dev], capture_output=True, text=True)
            assert " mtu 9000 " in got.stdout, (ns, dev, got)
    assert leftovers(prefix) == []


@needs_netns
def test_a_profiles_tcp_setting_is_set_in_its_nodes_only():
    prefix = PREFIX + "w"
    host = subprocess.run(["sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"], capture_output=True, text=True)
    with EmulatedCluster(nodes=2, prefix=prefix, profile=PROFILES["1g-small-warm"]) as c:
        for ns in c.namespaces:
            got = subprocess.run(
                ["ip", "netns", "exec", ns, "sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"],
                capture_output=True,
                text=True,
            )
            assert got.stdout.strip() == "0", (ns, got)
    again = subprocess.run(["sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle"], capture_output=True, text=True)
    assert again.stdout == host.stdout  # the host's own setting is untouched
    assert leftovers(prefix) == []


@needs_netns
def test_bench_launch_tears_down_when_a_rank_fails(tmp_path):
    from gradientflow.bench.runner_launch import launch_workers

    prefix = PREFIX + "f"
    env = _write_module(tmp_path, "gf_failing_rank", FAILING_RANK)
    (tmp_path / "spec.json").write_text("{}")
    old = dict(os.environ)
    os.environ.update(env)  # the launcher passes its environment to torchrun and the ranks
    try:
        with EmulatedCluster(nodes=2, prefix=prefix, profile=PROFILES["1g-small"]) as c:
            reason, log, _ = launch_workers(
                "fail", tmp_path / "spec.json", tmp_path, 2, c, timeout=60, threads=1, module="gf_failing_rank"
            )
            assert reason is not None and "exited with code" in reason, log.read_text()
            assert all(not _netns_pids(ns) for ns in c.namespaces)  # every rank is gone, not just the launchers
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert leftovers(prefix) == []


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@needs_netns
def test_interrupted_bench_stops_its_ranks_and_removes_everything(tmp_path):
    prefix = PREFIX + "i"
    env = _write_module(tmp_path, "gf_long_ranks", LONG_RANKS)
    (tmp_path / "spec.json").write_text("{}")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from gradientflow.bench.cluster import EmulatedCluster\n"
        "from gradientflow.bench.links import PROFILES\n"
        "from gradientflow.bench.runner_launch import launch_workers\n"
        f"out = Path({str(tmp_path)!r})\n"
        f"with EmulatedCluster(nodes=3, prefix={prefix!r}, profile=PROFILES['1g-bridge4']) as c:\n"
        "    launch_workers('long', out / 'spec.json', out, 3, c, timeout=120, threads=1, module='gf_long_ranks')\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, env=env)
    ranks: list[int] = []
    try:
        up = 0
        for line in child.stderr:  # the launcher forwards the ranks' marked lines
            up += "up" in line
            if up == 3:
                break
        namespaces = [f"{prefix}-n{i}" for i in range(3)]
        ranks = [p for ns in namespaces for p in _netns_pids(ns)]
        assert len(ranks) >= 6, ranks  # per node: torchrun (exec'd by ip netns exec) and its rank
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
        EmulatedCluster(3, "none", prefix)._delete_stale()
    assert child.returncode != 0  # it died of the signal, not by finishing
    deadline = time.monotonic() + 5
    while (leftovers(prefix) or any(_alive(p) for p in ranks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(prefix) == []
    assert not [p for p in ranks if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of an exited child of ours is gone for every purpose here
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


def test_matrix_tables_render(tmp_path):
    from gradientflow.bench import links_report

    rows = [
        {"mode": m, "step_s": 0.2, "p10_s": 0.19, "p90_s": 0.21, "bound_s": 0.18, "bound_by": "compute",
         "efficiency": 0.9, "speedup": 1.8, "own_cpu_s": 0.01, "exposed_s": 0.02, "collectives": 3,
         "messages_s": 0.001}
        for m in ("compute", "gf-topk-fp16", "ddp")
    ]  # fmt: skip
    ok = {
        "profile": {"name": "1g-burst"},
        "error": None,
        "network": "n",
        "link": {"bulk_Bps": 1.2e8, "small_s": 1e-4},
        "workload": "resnet50",
        "nproc": 2,
        "batch_size": 8,
        "steps": 5,
        "rows": rows,
        "reference_warnings": [],
    }
    m = {"command": "gradientflow bench --links all", "started": "s", "finished": "f", "definition": "d",
         "target": 0.85, "profiles": [ok, {"profile": {"name": "10g"}, "error": "boom"}]}  # fmt: skip
    md = links_report.markdown(m)
    assert "| gf-topk-fp16 | **0.90 (1.80x)** | failed |" in md
    assert "| 1g-burst | n | resnet50 b8, 2 | 0.960 | — | 0.10 | — |" in md  # no busy probe in this link.json
    ok["link"]["busy_bulk_Bps"] = 6e7  # the probe's rate while every rank computes: half, in Gbit/s
    assert "| 1g-burst | n | resnet50 b8, 2 | 0.960 | 0.480 | 0.10 | — |" in links_report.markdown(m)
    links_report.plot(m, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 0
    json.dumps(m)
