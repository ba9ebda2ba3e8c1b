"""``gradientflow bench``: every mode side by side in one launch of the ranks, and the launches.

Worker (``python -m gradientflow.bench.runner SPEC.json``, started by torchrun on every rank):
builds one model per *variant* (mode x bucket size θ), all from the same seed, then runs
``steps`` rounds; each round times one step of every variant in turn, after a barrier, so
noise on a shared 2-core machine hits all variants alike.  Rank 0 gathers the per-step times
(the slowest rank of each step counts) and writes them to the JSON file named in the spec.

Orchestration (:func:`run_bench`): one torchrun on loopback, or one torchrun per node of an
:class:`~gradientflow.bench.cluster.EmulatedCluster`.  DDP's PowerSGD hook runs with one bucket
(see :data:`POWERSGD_BUCKET_MB`) and still gets its own launch, with its own ``compute``
reference and a short timeout; a failure there is recorded in the JSON and the other modes are kept.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradientflow.bench import report
from gradientflow.bench.report import ALONE_SUFFIX
from gradientflow.config import auto_chunk_size
from gradientflow.diagnostics.stats import PHASES

logger = logging.getLogger(__name__)

MODES = (
    "gf-fp32",
    "gf-fp16",
    "gf-bf16",
    "gf-fp16-csc",
    "gf-fp16-csc-slice",
    "gf-bf16-csc-slice",
    "ddp",
    "ddp-fp16",
    "ddp-powersgd",
    "compute",
)
ISOLATED = ("ddp-powersgd",)
"""Modes run in their own launch: a failure of torch's PowerSGD hook (see POWERSGD_BUCKET_MB)
must not take the other modes with it."""
DDP_DEFAULT_BUCKET_MB = 25.0  # torch DDP's bucket_cap_mb default
CSC_DENSITY = 0.1
POWERSGD_RANK = 1  # torch's default matrix_approximation_rank
POWERSGD_BUCKET_MB = 1e6
"""torch DDP's bucket cap for ``ddp-powersgd``: the whole model in one bucket.  torch's
``powerSGD_hook`` starts its second allreduce (Q) from the first one's future callback; with
several buckets in flight that callback races the next bucket's allreduce, the two ranks issue
them in different orders, and Gloo aborts ("Received data size doesn't match expected size",
5 of 5 launches of ResNet-50 at the default 25 MB; 0 of 4 with one bucket).  An explicit cap
also sets DDP's first bucket to it, so there is exactly one bucket: no overlap, PowerSGD's
compression runs after backward."""
_CLUSTER_PORTS = itertools.count(29500)
"""Rendezvous ports on an emulated cluster: the node namespaces are ours alone, and each launch takes
the next port, so none waits for a port its predecessor's store may still hold."""
MARK = "[gf] "  # workers prefix lines meant for the user's terminal with this


@dataclass(frozen=True)
class Variant:
    """One configuration timed by the bench: a mode at a bucket size θ (MB; None = the mode's default)."""

    name: str
    mode: str
    theta_mb: float | None = None
    sweep: bool = False
    alone: bool = False
    """Run on a one-rank process group of its own rank: every pass of the mode and of autograd runs,
    and no collective has anyone to wait for.  Its step minus the compute mode's is what the mode
    costs a step apart from the network and the other ranks (the report's "own CPU" share)."""


@dataclass
class BenchSpec:
    """Everything a worker needs; written to JSON by the parent, read by every rank."""

    workload: str
    batch_size: int
    steps: int
    warmup: int
    variants: list[dict[str, Any]]
    out_path: str
    threads: int = 1
    algorithm: str = "native"
    chunk_size: int | None = None  # None: "auto" (32768, the paper's, or less so a small model has ~2000 chunks)
    pg_timeout_s: float = 120.0
    lr: float = 0.01
    extra: dict[str, Any] = field(default_factory=dict)
    input_shape: list[int] | None = None  # a user's model (workload "module:factory"): one sample's shape
    device: str = "cpu"  # "cuda": every rank on GPU (local rank mod the GPU count)


def rank_device(kind: str, local_rank: int) -> torch.device:
    """The device a rank trains on: the CPU, or GPU ``local_rank mod count`` (ranks may share one GPU)."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def process_group_backend(device: torch.device, ranks_per_node: int) -> str:
    """NCCL when every rank of a node has a GPU of its own, else Gloo (which also carries CUDA tensors)."""
    if device.type == "cuda" and torch.cuda.device_count() >= ranks_per_node:
        return "nccl"
    return "gloo"


def make_model(workload: str) -> nn.Module:
    """A built-in model by name, or the user's: ``"package.module:factory"`` (a zero-argument callable)."""
    from gradientflow.bench.models import build_model, resolve_model

    if ":" in workload:
        return resolve_model(workload)[1]()
    return build_model(workload)


def make_batch(spec: BenchSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's fixed batch: the built-in workload's, or N(0, 1) inputs of ``input_shape`` for a
    user's model, which is then trained on :func:`_loss`'s synthetic objective (no labels)."""
    from gradientflow.bench.models import synthetic_batch

    if ":" not in spec.workload:
        return synthetic_batch(spec.workload, spec.batch_size, seed=rank)
    assert spec.input_shape is not None
    gen = torch.Generator().manual_seed(rank)
    return torch.randn((spec.batch_size, *spec.input_shape), generator=gen), None


def plan_variants(modes: list[str], fusion_mb: float, theta_sweep: list[float], alone: bool = True) -> list[Variant]:
    """``compute`` first (the reference), then the modes, then (``alone``) each mode but PowerSGD again
    on a one-rank group (see :attr:`Variant.alone`), then the θ sweep (gf-fp32 and ddp at each θ).

    A sweep point identical to a requested mode (gf-fp32 at ``fusion_mb``, ddp at 25 MB) is not
    run twice: the report points at the mode.
    """
    out = [Variant("compute", "compute")]
    for m in modes:
        if m == "compute":
            continue
        theta = fusion_mb if m.startswith("gf-") else None
        out.append(Variant(m, m, theta))
    if alone:  # not for torch's PowerSGD hook, kept out of shared launches (ISOLATED)
        out += [
            Variant(v.name + ALONE_SUFFIX, v.mode, v.theta_mb, alone=True) for v in out[1:] if v.mode not in ISOLATED
        ]
    for theta in theta_sweep:
        if not ("gf-fp32" in modes and theta == fusion_mb):
            out.append(Variant(f"gf-fp32 θ={theta:g}", "gf-fp32", theta, sweep=True))
        if not ("ddp" in modes and theta == DDP_DEFAULT_BUCKET_MB):
            out.append(Variant(f"ddp θ={theta:g}", "ddp", theta, sweep=True))
    return out


# ==== worker ==================================================================================
def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _PeakRss:
    """Samples this process's resident set every 2 ms while active; ``peak`` in MB."""

    def __enter__(self) -> _PeakRss:
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def powersgd_wire_bytes(params: list[torch.Tensor], rank: int = POWERSGD_RANK, min_rate: float = 2.0) -> int:
    """Bytes torch's ``powerSGD_hook`` hands to allreduce per step, from its own rule.

    Each gradient is viewed as (shape[0], -1); it is compressed to P (n x r) and Q (m x r) when
    n*m > (n+m)*r*min_compression_rate, else allreduced as is; all in fp32.
    """
    total = 0
    for p in params:
        n = p.shape[0] if p.dim() > 0 else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        total += (n + m) * r if n * m > (n + m) * r * min_rate else n * m
    return 4 * total


def _build(
    v: Variant, spec: BenchSpec, chunk_size: int, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[nn.Module, torch.optim.Optimizer, int | None]:
    """Model + wrapper + optimizer of one variant (its collectives on ``group``, None = the default
    one); also the computed wire bytes (None = measured)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import gradientflow as gf

    torch.manual_seed(0)
    model = make_model(spec.workload).to(device)
    ids = None if device.type == "cpu" else [device.index]
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    momentum = 0.9
    wire: int | None = None
    if v.mode == "compute":
        wrapped: nn.Module = model
        wire = 0
    elif v.mode.startswith("gf-"):
        csc = "-csc" in v.mode
        wrapped = gf.DistributedDataParallel(
            model,
            device_ids=ids,
            process_group=group,
            fusion_threshold_mb=v.theta_mb,
            comm_dtype="fp32" if v.mode == "gf-fp32" else "bf16" if v.mode.startswith("gf-bf16") else "fp16",
            algorithm=spec.algorithm,
            density=CSC_DENSITY if csc else None,
            chunk_size=chunk_size,
            warmup_steps=0,  # the bench's own warm-up steps are dense-free: we time sparse steps
            csc_scope="slice" if v.mode.endswith("-slice") else "global",
        )  # CSC keeps the optimizer's momentum (the recommended recipe): no momentum correction
    else:
        cap = v.theta_mb if v.theta_mb is not None else DDP_DEFAULT_BUCKET_MB
        if v.mode == "ddp-powersgd":
            cap = POWERSGD_BUCKET_MB
        wrapped = TorchDDP(model, device_ids=ids, bucket_cap_mb=cap, process_group=group)
        wire = 4 * n
        if v.mode == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # the hook's state is its process group (None: the default one)
            wrapped.register_comm_hook(group, default_hooks.fp16_compress_hook)
            wire = 2 * n
        elif v.mode == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            # start_powerSGD_iter=2 is the earliest torch allows; the bench's warm-up covers it
            state = psgd.PowerSGDState(
                process_group=group, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2
            )
            wrapped.register_comm_hook(state, psgd.powerSGD_hook)
            wire = powersgd_wire_bytes(params)
    opt = torch.optim.SGD(wrapped.parameters(), lr=spec.lr, momentum=momentum)
    return wrapped, opt, wire


def _loss(out: Any, y: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy on the built-in workloads; for a user's model (no labels, ``y`` None) the mean
    square of every floating-point tensor it returns (in tuples, lists, dicts): a synthetic objective
    that reaches every parameter the output depends on, which is all a timing needs."""
    if y is not None:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    leaves: list[torch.Tensor] = []

    def collect(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            if o.is_floating_point():
                leaves.append(o.float().square().mean())
        elif isinstance(o, dict):
            for v in o.values():
                collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(out)
    if not leaves:
        raise ValueError(f"the model returned no floating-point tensor to train on ({type(out).__name__})")
    return torch.stack(leaves).sum()


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor | None) -> None:
    opt.zero_grad(set_to_none=True)
    _loss(model(x), y).backward()
    opt.step()
    if x.is_cuda:  # a step ends when the GPU has run it, not when it was queued
        torch.cuda.synchronize(x.device)


STAT_KEYS = ("payload_bytes", "exposed_seconds", "comm_seconds", "collectives", "host_syncs")


def _stats_of(model: nn.Module) -> dict[str, float]:
    """The counters the report uses, with every ``phase_*_s`` (0 for phases a step did not run)."""
    if not hasattr(model, "comm_stats"):
        return {}
    s = model.comm_stats()
    out = {k: float(s[k]) for k in STAT_KEYS}
    out.update({f"phase_{p}_s": 0.0 for p in PHASES})
    out.update({k: float(v) for k, v in s.items() if k.startswith("phase_")})
    return out


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_STEADY_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def timing_allocator() -> bool:
    """Give malloc back its steady-state behaviour before anything is timed.

    Workers start with ``MALLOC_MMAP_THRESHOLD_=131072`` (see :func:`launch_workers`): every
    tensor over 128 KB is mmapped and unmapped on free, so the RSS each mode adds while it is
    built is exact.  Timed like that, every step page-faults its activations (and a fresh
    ``.grad`` per parameter where ``zero_grad(set_to_none=True)`` dropped them): on ResNet-50,
    2 ranks, the compute-only step took 339 ms instead of 206, which dilutes every
    communication overhead.  A long-running process with glibc's default (dynamic) threshold
    reuses those blocks from its heap; 32 MB (the dynamic threshold's ceiling) and a trim
    threshold twice that are that steady state.  A no-op where glibc's ``mallopt`` is absent;
    returns whether the thresholds were set.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD) and libc.mallopt(
            _M_TRIM_THRESHOLD, 2 * _STEADY_MMAP_THRESHOLD
        )
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.warning("bench: could not set malloc's thresholds; timing with the launcher's")
    return bool(ok)


def worker_main(spec_path: str) -> None:
    """One rank of the bench (run under torchrun): time every variant, rank 0 writes the results."""
    spec = BenchSpec(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(spec.threads)
    device = rank_device(spec.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = process_group_backend(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    dist.init_process_group(backend, timeout=timedelta(seconds=spec.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda msg: print(MARK + msg, file=sys.stderr, flush=True)) if rank == 0 else (lambda msg: None)
    say(f"{world} ranks on {device.type} ({backend})")
    x, y = make_batch(spec, rank)
    x, y = x.to(device), (None if y is None else y.to(device))
    probe = make_model(spec.workload).to(device)
    n_params = sum(p.numel() for p in probe.parameters())
    chunk = spec.chunk_size or auto_chunk_size(n_params)
    # one untimed local step first, so one-off costs (kernels, autograd threads) are not charged to a mode
    _loss(probe(x), y).backward()
    del probe
    base_rss = _rss_mb()
    # every rank creates every group (new_group's contract); each keeps the one holding only itself
    alone = [dist.new_group([r]) for r in range(world)][rank] if any(vd.get("alone") for vd in spec.variants) else None
    runs: list[dict[str, Any]] = []
    for vd in spec.variants:
        v = Variant(**vd)
        rec: dict[str, Any] = {
            **vd,
            "status": "ok",
            "error": None,
            "step_s": [],
            "cpu_s": [],
            "stats": [],
            "computed_wire_bytes": None,
            "mem_added_mb": None,
        }
        before = _rss_mb()
        if device.type == "cuda":  # on a GPU the memory a mode adds is device memory, not host RSS
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device) / 2**20
        try:
            # on a GPU the memory a mode adds is the device's (below): no RSS sampler thread there
            with _PeakRss() if device.type == "cpu" else contextlib.nullcontext() as peak:
                model, opt, rec["computed_wire_bytes"] = _build(v, spec, chunk, device, alone if v.alone else None)
                for _ in range(spec.warmup):
                    _step(model, opt, x, y)
            top = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak.peak
            rec["mem_added_mb"] = top - before
            rec["_obj"] = (model, opt)
        except Exception as exc:  # noqa: BLE001 — recorded per mode; the other modes go on
            rec["status"], rec["error"] = "error", f"{type(exc).__name__}: {exc}"
            say(f"{v.name}: {rec['error']}")
        runs.append(rec)
        say(f"built {v.name} (+{rec['mem_added_mb'] or 0:.0f} MB after {spec.warmup} warm-up steps)")
    model = opt = None  # only `runs` holds the models (they are freed before the exit, below)
    timing_allocator()
    for rec in runs:  # one untimed round in that allocator: the heap grows once, here
        if rec["status"] == "ok":
            dist.barrier()
            _step(*rec["_obj"], x, y)
    say(f"timing {spec.steps} rounds of {sum(r['status'] == 'ok' for r in runs)} variants")
    for step in range(spec.steps):
        for rec in runs:
            if rec["status"] != "ok":
                continue
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                _step(*rec["_obj"], x, y)
            except Exception as exc:  # noqa: BLE001
                rec["status"], rec["error"] = "error", f"{type(exc).__name__}: {exc}"
                say(f"{rec['name']}: {rec['error']}")
                continue
            cpu = time.thread_time() - c0  # read first: the CPU interval lies inside the wall interval
            rec["step_s"].append(time.perf_counter() - t0)
            rec["cpu_s"].append(cpu)  # this thread runs forward, backward (on CPU) and the optimizer
            rec["stats"].append(_stats_of(rec["_obj"][0]))
        say(f"round {step + 1}/{spec.steps} done")
    # Free every model while the process group still exists: a wrapper destroyed after
    # destroy_process_group (torch DDP with the PowerSGD hook) can hang the exit (1 in ~5 launches).
    for rec in runs:
        rec.pop("_obj", None)
    gc.collect()
    maxrss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    mine = {"runs": runs, "base_rss_mb": base_rss, "maxrss_mb": maxrss_mb}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(spec.out_path).write_text(json.dumps(_merge(gathered, spec, n_params, chunk, world)))
    dist.barrier()
    dist.destroy_process_group()


def _merge(per_rank: list[dict[str, Any]], spec: BenchSpec, n_params: int, chunk: int, world: int) -> dict[str, Any]:
    """One record per variant: per step the slowest rank's time; stats per step, max over ranks."""
    variants = []
    for i, rec in enumerate(per_rank[0]["runs"]):
        ranks = [r["runs"][i] for r in per_rank]
        n = min(len(r["step_s"]) for r in ranks)
        out = {k: v for k, v in rec.items() if k not in ("step_s", "cpu_s", "stats")}
        errors = [r["error"] for r in ranks if r["error"]]
        out["status"] = "error" if errors else "ok"
        out["error"] = errors[0] if errors else None
        out["step_s"] = [max(r["step_s"][s] for r in ranks) for s in range(n)]
        out["cpu_s"] = [max(r["cpu_s"][s] for r in ranks) for s in range(n)]
        keys = ranks[0]["stats"][0].keys() if n and ranks[0]["stats"] else []
        out["stats"] = {k: [max(r["stats"][s].get(k, 0.0) for r in ranks) for s in range(n)] for k in keys}
        out["mem_added_mb"] = max((r["mem_added_mb"] or 0.0) for r in ranks)
        variants.append(out)
    return {
        "world_size": world,
        "n_params": n_params,
        "chunk_size": chunk,
        "threads_per_rank": spec.threads,
        "base_rss_mb": max(r["base_rss_mb"] for r in per_rank),
        "maxrss_mb": [r["maxrss_mb"] for r in per_rank],
        "variants": variants,
    }


# ==== launching ===============================================================================
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_argv(
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    args: list[str],
    module: str = "gradientflow.bench.runner",
) -> list[str]:
    """``python -m torch.distributed.run`` (torchrun) of ``module``, static rendezvous at the master."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc_per_node),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
        "--max-restarts",
        "0",
        "-m",
        module,
        *args,
    ]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop ``proc`` and its whole tree: torchrun starts workers in their own sessions, so a
    process-group kill would miss them; every pid of the tree is signalled by id."""
    if proc.poll() is not None:
        return
    tree = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace if sig == signal.SIGTERM else 5)
        if sig == signal.SIGTERM and proc.poll() is not None and not any(_alive(p) for p in tree[1:]):
            return


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pump(stream: IO[str], log: IO[str], lock: threading.Lock) -> threading.Thread:
    """Copy every line into ``log``; lines carrying :data:`MARK` also go to our stderr."""

    def run() -> None:
        for line in stream:
            with lock:
                log.write(line)
                log.flush()
            if MARK in line:
                sys.stderr.write("  " + line[line.index(MARK) + len(MARK) :])
                sys.stderr.flush()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_all(procs: list[subprocess.Popen], timeout: float, grace_after_failure: float = 20.0) -> str | None:
    """Wait for every process; None if all exited 0, else a one-line reason.  Always stops them all.

    When one fails, the others get ``grace_after_failure`` s before being stopped: a torchrun on
    another node can otherwise wait for its peer until its own (long) timeout.
    """
    deadline = time.monotonic() + timeout
    reason: str | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed and reason is None:
                reason = "; ".join(f"launcher {i} exited with code {c}" for i, c in failed)
                deadline = min(deadline, time.monotonic() + grace_after_failure)
            if all(c is not None for c in codes):
                return reason
            if time.monotonic() > deadline:
                return reason or f"timed out after {timeout:.0f} s"
            time.sleep(0.2)
    finally:
        for p in procs:
            stop(p)


_ERROR_LINE = re.compile(r"(what\(\)|Error:|enforce fail|Received data size|Traceback)")


def error_from_log(path: Path) -> str | None:
    """The most telling error line of a launch log (C++ ``what()``, a Python exception), if any."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    hits = [ln.strip() for ln in lines if _ERROR_LINE.search(ln) and "Traceback" not in ln]
    if not hits:
        return None
    # Gloo prefixes its message with the build path of the check; the message is what helps
    return re.sub(r"\[enforce fail at [^\]]*\]\s*", "", hits[0])[:400]


@dataclass
class BenchOptions:
    """Options of ``gradientflow bench`` (see ``gradientflow bench --help``)."""

    workload: str = "resnet50"  # a built-in model, or "package.module:factory" with input_shape
    input_shape: tuple[int, ...] | None = None
    nproc: int = 2
    steps: int = 20
    warmup: int = 3
    modes: list[str] = field(default_factory=lambda: list(MODES))
    alone: bool = True  # each mode also on a one-rank group: its cost apart from the network (Variant.alone)
    bandwidth: str = "1gbit"
    batch_size: int = 8
    fusion_mb: float = 25.0
    theta_sweep: list[float] = field(default_factory=list)
    algorithm: str = "native"
    chunk_size: int | None = None
    threads: int | None = None
    timeout_s: float = 1800.0
    prefix: str = "gfb"
    out: str = "benchmarks/results"
    device: str = "cpu"


def launch_workers(
    name: str,
    spec_path: Path,
    out: Path,
    nproc: int,
    cluster: Any,
    timeout: float,
    threads: int,
    module: str = "gradientflow.bench.runner",
) -> tuple[str | None, Path, float]:
    """Run ``python -m module SPEC`` on ``nproc`` ranks: one torchrun on loopback (``cluster`` None) or one
    torchrun per node of an emulated cluster; every line goes to ``out/launch-{name}.log``.

    Returns (None if every launcher exited 0, else a one-line reason; the log's path; seconds).
    Everything started is stopped before returning, also on timeout.
    """
    # fixed mmap threshold: big tensors are mmapped and returned on free, so RSS deltas per mode are
    # exact; workers switch to malloc's steady state before timing (timing_allocator)
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    log_path = out / f"launch-{name}.log"
    lock = threading.Lock()
    args = [str(spec_path.resolve())]
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        procs: list[subprocess.Popen] = []
        pumps = []
        try:
            io = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
            if cluster is None:
                argv = torchrun_argv(
                    nnodes=1,
                    node_rank=0,
                    nproc_per_node=nproc,
                    master_addr="127.0.0.1",
                    master_port=free_port(),
                    args=args,
                    module=module,
                )
                procs.append(subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True, **io))
            else:
                port = next(_CLUSTER_PORTS)
                for i in range(nproc):
                    argv = torchrun_argv(
                        nnodes=nproc,
                        node_rank=i,
                        nproc_per_node=1,
                        master_addr=cluster.master_addr,
                        master_port=port,
                        args=args,
                        module=module,
                    )
                    procs.append(cluster.popen(i, argv, env=env, **io))
            pumps = [_pump(p.stdout, log, lock) for p in procs]
            reason = wait_all(procs, timeout)
        finally:
            for p in procs:
                stop(p)
            for t in pumps:
                t.join(timeout=5)
    return reason, log_path, time.monotonic() - t0


def _launch(
    name: str, variants: list[Variant], opts: BenchOptions, out: Path, cluster: Any, timeout: float
) -> tuple[dict[str, Any] | None, str | None, float]:
    """Run one torchrun launch of ``variants``; returns (merged results or None, error, seconds)."""
    threads = opts.threads or max(1, (os.cpu_count() or 1) // opts.nproc)  # ranks share this machine
    raw_path = out / f"raw-{name}.json"
    raw_path.unlink(missing_ok=True)
    spec = BenchSpec(
        workload=opts.workload,
        batch_size=opts.batch_size,
        steps=opts.steps,
        warmup=opts.warmup,
        variants=[asdict(v) for v in variants],
        out_path=str(raw_path.resolve()),
        threads=threads,
        algorithm=opts.algorithm,
        chunk_size=opts.chunk_size,
        input_shape=list(opts.input_shape) if opts.input_shape else None,
        device=opts.device,
    )
    spec_path = out / f"spec-{name}.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    reason, log_path, seconds = launch_workers(name, spec_path, out, opts.nproc, cluster, timeout, threads)
    if reason is None and raw_path.exists():
        return json.loads(raw_path.read_text()), None, seconds
    detail = error_from_log(log_path)
    why = (reason or "no results written") + (f": {detail}" if detail else "")
    return None, f"{why} (log: {log_path})", seconds


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run the bench, write ``results.json``, ``table.md`` and ``bench.png`` to ``opts.out``; return the summary."""
    from gradientflow.bench.cluster import EmulatedCluster, can_emulate

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = plan_variants(opts.modes, opts.fusion_mb, opts.theta_sweep, opts.alone)
    main = [v for v in variants if v.mode not in ISOLATED and not v.alone]
    # Extra launches, each with its own compute reference: torch's PowerSGD hook (kept apart in case it
    # fails) and the alone twins (own launch: twice the models in one process would not fit AlexNet's
    # 2 x ~9 GB in this machine's memory; a twin is compared with the compute mode of its own launch).
    extra = [("isolated", [v for v in variants if v.mode in ISOLATED]), ("alone", [v for v in variants if v.alone])]
    emulate = opts.bandwidth != "none"
    if emulate:
        ok, why = can_emulate()
        if not ok:
            print(
                f"gradientflow bench: cannot emulate a {opts.bandwidth} cluster ({why}); running on loopback",
                file=sys.stderr,
            )
            emulate = False
    launches: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        cluster = None
        if emulate:
            cluster = stack.enter_context(EmulatedCluster(nodes=opts.nproc, rate=opts.bandwidth, prefix=opts.prefix))
        where = f"{opts.nproc} emulated nodes at {opts.bandwidth}" if cluster else f"{opts.nproc} ranks on loopback"
        logger.info(
            "bench %s: %s; %d variants, %d warm-up + %d timed steps each",
            opts.workload,
            where,
            len(variants),
            opts.warmup,
            opts.steps,
        )
        raw, err, secs = _launch("main", main, opts, out, cluster, opts.timeout_s)
        if raw is None:
            raise RuntimeError(f"bench launch failed: {err}")
        launches.append({"name": "main", "seconds": secs, **raw})
        per_variant = secs / max(1, len(main))
        for name, vs in extra:
            if not vs:
                continue
            # healthy, it takes about as long per variant as the main launch; a hang must not take forever
            limit = min(opts.timeout_s, 90 + 3 * per_variant * (len(vs) + 1))
            logger.info("bench: %s in launch '%s' (timeout %.0f s)", ", ".join(v.name for v in vs), name, limit)
            raw, err, secs = _launch(name, [Variant("compute", "compute"), *vs], opts, out, cluster, limit)
            if raw is None:
                raw = {
                    "variants": [{**asdict(v), "status": "error", "error": err, "step_s": [], "stats": {}} for v in vs]
                }
                logger.warning("bench: %s failed: %s", ", ".join(v.name for v in vs), err)
            launches.append({"name": name, "seconds": secs, **raw})
    summary = report.summarize(launches, opts, emulated=cluster is not None)
    report.write_all(summary, out)
    for warning in summary["reference_warnings"]:
        logger.warning("bench: %s", warning)
    return summary


if __name__ == "__main__":
    worker_main(sys.argv[1])
