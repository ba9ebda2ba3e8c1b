"""One frozen, validated dataclass holding every assumption of the cost model.

Units are SI throughout: seconds, bytes, bytes per second.  Bandwidths given on the command
line in bits (``56gbit``) are converted once, by :func:`parse_bandwidth`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

CONFIGS = ("baseline", "ring", "overlap", "fp16", "lazy", "csc")
"""The cumulative configurations: each adds one technique to the one before it."""

MIB = 1024 * 1024  # θ is in MiB, as gradientflow's fusion_threshold_mb (config.threshold_bytes)


def parse_bandwidth(text: str) -> float:
    """``"56gbit"`` -> 7e9 bytes/s; also ``mbit``, ``kbit``, ``bit`` and ``GB/s``/``MB/s`` (bytes)."""
    t = text.strip().lower().replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?(?:e[+-]?\d+)?)(bit|kbit|mbit|gbit|b/s|kb/s|mb/s|gb/s)", t)
    if not m:
        raise ValueError(f"bandwidth must look like '56gbit', '100mbit' or '12gb/s' (bytes), got {text!r}")
    v = float(m.group(1))
    unit = m.group(2)
    scale = {
        "bit": 1 / 8,
        "kbit": 1e3 / 8,
        "mbit": 1e6 / 8,
        "gbit": 1e9 / 8,
        "b/s": 1.0,
        "kb/s": 1e3,
        "mb/s": 1e6,
        "gb/s": 1e9,
    }[unit]
    if v <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return v * scale


@dataclass(frozen=True)
class SimConfig:
    """A cluster and a training setup, as the cost model sees them.

    bandwidth: inter-node link of one node, bytes/s, per direction (B).
    latency: α, seconds charged once per inter-node collective.
    gpus_per_node: GPUs sharing one node's link; > 1 gives the two-level allreduce.
    intra_bandwidth / intra_latency: the link between GPUs of one node (B_intra, α_intra).
    batch: images per GPU per iteration.
    gpu_images_per_s: one GPU's compute-only throughput (forward + backward + update).
    backward_fraction: share of the compute time spent in backward (the rest is forward and
        update); only used when layer times come from FLOP shares, not from ``--profile``.
    theta_mb: θ of lazy allreduce, MiB of fp32 gradient (as ``fusion_threshold_mb``).
    density: CSC, fraction of chunks sent; chunk_size: gradients per chunk.
    pass_bytes_per_s: how fast one elementwise pass over the fp32 gradient pool runs on a GPU
        (fp16 casts, CSC accumulate/score/zero); the model charges these passes serially.
    """

    bandwidth: float
    latency: float
    batch: int
    gpu_images_per_s: float
    gpus_per_node: int = 1
    intra_bandwidth: float | None = None
    intra_latency: float = 0.0
    backward_fraction: float = 2.0 / 3.0
    theta_mb: float = 32.0
    density: float = 0.1
    chunk_size: int = 32768
    pass_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        def positive(name: str, hint: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isnan(v):
                raise ValueError(f"{name} must be a number > 0 ({hint}), got {v!r}")

        positive("bandwidth", "bytes/s of one node's link; on the command line e.g. --bandwidth 56gbit")
        positive("gpu_images_per_s", "one GPU's compute-only images/s, e.g. --gpu-images-per-s 600")
        positive("pass_bytes_per_s", "bytes/s of one pass over the gradient pool; inf = free")
        for name in ("latency", "intra_latency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds >= 0 (e.g. --latency 50us), got {v!r}")
        for name in ("batch", "gpus_per_node", "chunk_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.gpus_per_node > 1 and self.intra_bandwidth is None:
            raise ValueError("gpus_per_node > 1 needs intra_bandwidth (e.g. --intra-bandwidth 15.75gb/s, PCIe 3 x16)")
        if self.intra_bandwidth is not None:
            positive("intra_bandwidth", "bytes/s between GPUs of one node")
        if not 0 < self.backward_fraction <= 1:
            raise ValueError(f"backward_fraction must be in (0, 1], got {self.backward_fraction!r}")
        if isinstance(self.theta_mb, bool) or not isinstance(self.theta_mb, (int, float)) or not self.theta_mb >= 0:
            raise ValueError(
                f"theta_mb must be >= 0 (0 = one collective per tensor, inf = one per step), got {self.theta_mb!r}"
            )
        d = self.density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValueError(f"density must be in (0, 1] (fraction of CSC chunks sent; 1 = dense), got {d!r}")

    @property
    def iteration_compute_s(self) -> float:
        """One GPU's compute time per iteration: batch / throughput."""
        return self.batch / self.gpu_images_per_s

    def as_dict(self) -> dict[str, float | int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
