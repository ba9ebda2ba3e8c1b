"""Link profiles: the networks ``gradientflow bench --links`` measures every mode on.

A profile says how each port of the emulated cluster is shaped (the rate, the shaper and its
queue), how the nodes are joined (a routed switch namespace, or one Linux bridge) and, where the
bench's model would not fit more ranks on this machine's CPUs, which model to run instead.
Users' networks differ in token-bucket depth, queueing discipline, rate and fan-in; a result that
holds on one shaper setting is not a result, so the matrix takes one of each:

==============  =====================================================================================
``1g-burst``    tbf at 1 Gbit/s, bucket rate/HZ (>= one 64 KB GSO packet), 20 ms queue: today's bench
``1g-small``    tbf at 1 Gbit/s, 32 KB bucket, 400 ms queue: a shaper that lets no burst through
``1g-small-warm`` the same, with TCP's slow start after idle off on every node (a host setting:
                ``sysctl net.ipv4.tcp_slow_start_after_idle=0``), to show what that restart costs
``1g-small-jumbo`` the same shaper with 9000-byte frames on every veth: the bucket still holds under four
                frames, but tbf cuts each 64 KB GSO packet into 8 frames instead of 45, so the
                emulated network takes far less of the CPUs the ranks train on (docs/networks.md)
``1g-htb``      HTB class at 1 Gbit/s with an fq_codel child (pfifo where the kernel has no fq_codel)
``10g``         tbf at 10 Gbit/s (bucket rate/HZ)
``100m``        tbf at 100 Mbit/s (bucket one GSO packet)
``1g-bridge4``  4 nodes on one L2 bridge, tbf 1 Gbit/s per port; a smaller model (4 ranks on 2 cores)
==============  =====================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from gradientflow.bench.cluster_net import parse_rate, tbf_burst_bytes

SHAPERS = ("tbf", "htb")
TOPOLOGIES = ("star", "bridge")
SMALL_BURST_BYTES = 32 * 1024
"""The small bucket: half a GSO packet, so tbf segments every 64 KB skb and sends at line rate only."""


@dataclass(frozen=True)
class LinkProfile:
    """One network of the matrix.  ``burst``: tbf bucket in bytes (None: :func:`tbf_burst_bytes`);
    ``latency``: tbf's queue bound; ``nodes``/``workload``/``batch_size``: None = the bench's own."""

    name: str
    rate: str
    shaper: str = "tbf"
    burst: int | None = None
    latency: str = "20ms"
    topology: str = "star"
    nodes: int | None = None
    workload: str | None = None
    batch_size: int | None = None
    leaf: str = "fq_codel"
    """HTB's leaf qdisc; where this kernel lacks it the cluster falls back to ``pfifo`` and says so."""
    slow_start_after_idle: bool = True
    """Linux's default: a TCP connection idle for longer than its retransmission timeout starts again
    from a small congestion window.  False sets ``net.ipv4.tcp_slow_start_after_idle=0`` in every node."""
    mtu: int | None = None
    """Frame size on every veth of the cluster (None: the kernel's 1500).  With a bucket smaller than a
    64 KB GSO packet tbf segments every packet into frames, and each frame then costs the emulated
    network's CPU (veth, forwarding, the receiver's TCP): on this machine's two cores that CPU is the
    training ranks'.  Larger frames are fewer frames for the same shaper."""
    about: str = ""

    def __post_init__(self) -> None:
        if self.shaper not in SHAPERS:
            raise ValueError(f"shaper must be one of {SHAPERS}, got {self.shaper!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
        if parse_rate(self.rate) is None:
            raise ValueError(f"a link profile needs a rate, got {self.rate!r}")
        if self.burst is not None and self.burst <= 0:
            raise ValueError(f"burst must be a positive number of bytes, got {self.burst}")
        if self.mtu is not None and not 68 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be a frame size in 68..65535 bytes, got {self.mtu}")
        if self.mtu is not None and self.shaper == "tbf" and self.bucket_bytes() < self.mtu:
            raise ValueError(
                f"a tbf bucket of {self.bucket_bytes()} bytes cannot pass a {self.mtu}-byte frame: raise burst"
            )

    @property
    def rate_bps(self) -> int:
        bps = parse_rate(self.rate)
        assert bps is not None  # checked in __post_init__
        return bps

    def bucket_bytes(self) -> int:
        """tbf's bucket: the profile's, or the smallest that reaches the rate (:func:`tbf_burst_bytes`)."""
        return self.burst if self.burst is not None else tbf_burst_bytes(self.rate_bps)

    def shape_commands(self, ns: str, dev: str, leaf: str | None = None) -> list[list[str]]:
        """The ``tc`` commands that shape ``dev`` (egress) in namespace ``ns`` to this profile
        (``leaf``: HTB's leaf qdisc instead of the profile's, e.g. where the kernel lacks it)."""
        tc = ["tc", "-n", ns]
        if self.shaper == "tbf":
            return [
                [
                    *tc,
                    *("qdisc", "add", "dev", dev, "root", "tbf"),
                    *("rate", f"{self.rate_bps}bit", "burst", str(self.bucket_bytes()), "latency", self.latency),
                ]
            ]
        # HTB: one class at the rate, everything classified into it, fq_codel as its leaf qdisc
        # (flow queueing and CoDel's ~5 ms target instead of tbf's single FIFO)
        return [
            [*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
            [
                *tc,
                *("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb"),
                *("rate", f"{self.rate_bps}bit", "ceil", f"{self.rate_bps}bit"),
            ],
            [*tc, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", leaf or self.leaf],
        ]

    def node_sysctls(self) -> list[str]:
        """``key=value`` settings for every node's namespace (each namespace has its own TCP settings)."""
        return [] if self.slow_start_after_idle else ["net.ipv4.tcp_slow_start_after_idle=0"]

    def describe(self, leaf: str | None = None) -> str:
        """One line for tables: shaper, rate, bucket, topology (``leaf``: the HTB leaf actually used)."""
        if self.shaper == "tbf":
            shaper = f"tbf {self.rate}, bucket {self.bucket_bytes() / 1024:.0f} KB, queue {self.latency}"
        else:
            used = leaf or self.leaf
            shaper = f"htb {self.rate} + {used}" + ("" if used == self.leaf else f" (no {self.leaf} in this kernel)")
        where = f"{self.nodes} nodes on one bridge" if self.topology == "bridge" else "routed star"
        tcp = "" if self.slow_start_after_idle else ", TCP without slow start after idle"
        mtu = "" if self.mtu is None else f", MTU {self.mtu}"
        return f"{shaper}, {where}{mtu}{tcp}"


PROFILES: dict[str, LinkProfile] = {
    p.name: p
    for p in (
        LinkProfile("1g-burst", "1gbit", about="today's bench: tbf bucket rate/HZ"),
        LinkProfile("1g-small", "1gbit", burst=SMALL_BURST_BYTES, latency="400ms", about="tbf with a 32 KB bucket"),
        LinkProfile(
            "1g-small-warm",
            "1gbit",
            burst=SMALL_BURST_BYTES,
            latency="400ms",
            slow_start_after_idle=False,
            about="1g-small, TCP's slow start after idle off (net.ipv4.tcp_slow_start_after_idle=0)",
        ),
        LinkProfile(
            "1g-small-jumbo",
            "1gbit",
            burst=SMALL_BURST_BYTES,
            latency="400ms",
            mtu=9000,
            about="1g-small with 9000-byte frames: the same bucket, a sixth of the frames to emulate",
        ),
        LinkProfile("1g-htb", "1gbit", shaper="htb", about="HTB with an fq_codel child"),
        LinkProfile("10g", "10gbit", about="tbf at 10 Gbit/s"),
        LinkProfile("100m", "100mbit", about="tbf at 100 Mbit/s"),
        LinkProfile(
            "1g-bridge4",
            "1gbit",
            topology="bridge",
            nodes=4,
            workload="tiny_transformer",
            about="4 ranks through one bridge; a model 4 ranks fit on 2 cores",
        ),
    )
}
ALL = "all"


def parse_links(text: str) -> list[LinkProfile]:
    """``"all"`` or a comma-separated list of profile names -> the profiles, in the order given."""
    names = list(PROFILES) if text.strip().lower() == ALL else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if unknown or not names:
        raise ValueError(f"unknown link profile(s) {unknown or [text]}: choose from {ALL}, {', '.join(PROFILES)}")
    return [PROFILES[n] for n in dict.fromkeys(names)]
