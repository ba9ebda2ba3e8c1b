"""Named assumptions, each with its source, and the paper's figures to compare against.

PAPER.md (the project's notes on Sun et al. 2019) lists what the paper states; everything else
here is an assumption and says so.  Nothing below was tuned to bring a prediction nearer to a
target: each value was written down from its source before the model was run.
"""

from __future__ import annotations

from dataclasses import dataclass

IMAGENET_IMAGES = 1_281_167


@dataclass(frozen=True)
class Assumption:
    name: str  # SimConfig field (or a note)
    value: float | int | str
    shown: str  # the value as a reader wants it
    source: str


MEASURED_LATENCY_1GBIT = Assumption(
    "latency",
    423e-6,
    "423 µs per collective",
    "measured: Gloo's allreduce between 2 ranks on an emulated 1 Gbit/s Ethernet link, fitted α + x/B "
    "(benchmarks/sim_validation/alpha_beta.json, docs/cost-model.md; re-runs gave 0.47-2.7 ms)",
)
"""The measured α beside the default's assumed one (``simulate --latency``; the paper's InfiniBand)."""


def _one_gpu(epochs: int, seconds: float, speedup: float) -> float:
    """One V100's compute-only img/s implied by the paper: (epochs·images/s / 512) / (speedup/512)."""
    return epochs * IMAGENET_IMAGES / seconds / speedup


PAPER_COMMON: tuple[Assumption, ...] = (
    Assumption(
        "bandwidth",
        56e9 / 8,
        "56 Gbit/s per node",
        "stated (abstract): 56 Gbps network; line rate, no protocol overhead deducted",
    ),
    Assumption(
        "latency",
        50e-6,
        "50 µs per inter-node collective",
        "assumed: order of a small-message NCCL 2 allreduce across InfiniBand nodes; not measured",
    ),
    Assumption("gpus_per_node", 8, "8 V100 per node", "assumed: the common V100 server (DGX-1 class); not stated"),
    Assumption(
        "intra_bandwidth",
        15.75e9,
        "15.75 GB/s (PCIe 3.0 x16)",
        "assumed: PCIe 3.0 x16 line rate (8 GT/s x 16 lanes, 128b/130b; PCI-SIG); NVLink would be faster",
    ),
    Assumption("intra_latency", 10e-6, "10 µs per intra-node collective", "assumed: order of a CUDA/NCCL launch"),
    Assumption(
        "batch",
        128,
        "128 images per GPU (64K at 512 GPUs)",
        "assumed: the 64K batch of Jia et al. 2018 (arXiv 1807.11205), the record the paper compares with",
    ),
    Assumption(
        "backward_fraction",
        2 / 3,
        "backward = 2/3 of compute",
        "assumed: backward costs about 2x the forward FLOPs (the usual 2N vs 4N per-sample count)",
    ),
    Assumption("theta_mb", 25.0, "θ = 25 MiB", "assumed: gradientflow's default fusion_threshold_mb (θ not stated)"),
    Assumption("density", 0.1, "10% of chunks", "stated (seed 001): ~10% of chunks sent"),
    Assumption("chunk_size", 32768, "32K gradients per chunk", "stated (seed 001)"),
    Assumption(
        "pass_bytes_per_s",
        450e9,
        "450 GB/s of pool per pass",
        "assumed: V100 HBM2 900 GB/s (NVIDIA V100 datasheet), each pass reads and writes the pool",
    ),
)

PAPER_MODEL: dict[str, tuple[Assumption, ...]] = {
    "alexnet": (
        Assumption(
            "gpu_images_per_s",
            _one_gpu(95, 90.0, 410.2),
            "3,297 img/s per V100",
            "derived (PAPER.md): 95 epochs in 90 s on 512 GPUs = 2,641 img/s/GPU, / 80.1% efficiency",
        ),
    ),
    "resnet50": (
        Assumption(
            "gpu_images_per_s",
            _one_gpu(90, 438.0, 434.1),
            "606 img/s per V100",
            "derived (PAPER.md): 90 epochs in 438 s on 512 GPUs = 514 img/s/GPU, / 84.8% efficiency",
        ),
    ),
}

PAPER_TARGETS: tuple[tuple[str, int, str, float, str], ...] = (
    ("alexnet", 64, "baseline", 2.5, "abstract: popular open-source systems, 64 GPUs, 56 Gbps (model not named)"),
    ("resnet50", 64, "baseline", 2.5, "abstract: popular open-source systems, 64 GPUs, 56 Gbps (model not named)"),
    ("alexnet", 512, "csc", 410.2, "abstract, seed 000"),
    ("resnet50", 512, "csc", 434.1, "seed 000"),
)

SENSITIVITY: tuple[tuple[str, str, float], ...] = (
    ("latency", "α x10", 10.0),
    ("latency", "α x0.1", 0.1),
    ("bandwidth", "B x0.5", 0.5),
    ("bandwidth", "B x2", 2.0),
    ("gpu_images_per_s", "per-GPU img/s x0.8 (the 512-GPU rate)", 0.8),
    ("gpu_images_per_s", "per-GPU img/s x2", 2.0),
    ("batch", "batch x0.5", 0.5),
    ("batch", "batch x2", 2.0),
    ("intra_bandwidth", "intra x8 (NVLink-class)", 8.0),
    ("pass_bytes_per_s", "passes free", float("inf")),
    ("pass_bytes_per_s", "passes x0.25 speed", 0.25),
    ("theta_mb", "θ x0.25", 0.25),
    ("theta_mb", "θ x4", 4.0),
)
"""(field, label, factor): one assumption moved at a time, the others at their preset value."""


def paper_values(model: str) -> dict[str, float | int]:
    """SimConfig keyword arguments of ``--preset paper`` for a built-in model."""
    if model not in PAPER_MODEL:
        raise ValueError(
            f"--preset paper knows alexnet and resnet50, not {model!r}; give --gpu-images-per-s "
            "and --batch for your own model instead"
        )
    return {a.name: a.value for a in (*PAPER_COMMON, *PAPER_MODEL[model])}  # type: ignore[misc]


IMAGENET_SHAPE = (3, 224, 224)
