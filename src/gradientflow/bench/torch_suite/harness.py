"""torch's own DDP tests (``distributed_test.py`` from the installed wheel), driven on CPU with Gloo.

Imported in the runner and, by name, in every rank torch's ``MultiProcessTestCase`` spawns.  It
sets up what torch's ``test/distributed/test_distributed_spawn.py`` sets up (BACKEND=gloo,
WORLD_SIZE, TEMP_DIR: these environment variables configure *torch's* test harness, nothing in
gradientflow) and maps CUDA onto the CPU so that the GPU-marked DDP tests run here:

- ``@skip_if_lt_x_gpu(n)`` behaves as torch's own ``allow_cpu=True``; ``@skip_if_no_gpu`` passes;
- ``init_multigpu_helper`` gives rank r the device index r (every index means the CPU);
- a ``TorchFunctionMode`` rewrites ``device=`` / ``.to(...)`` / ``.cuda()`` to the CPU;
- ``torch.cuda.set_device`` / ``synchronize`` are no-ops;
- ``device_ids`` / ``output_device`` are dropped at construction (both DDPs refuse them for a
  CPU module), by a thin subclass of the DDP under test.

Two test classes, one per implementation: :class:`TorchDDP` runs the tests on torch's
``DistributedDataParallel``, :class:`Gradientflow` substitutes ``gradientflow.DistributedDataParallel``
under every name the test module reaches DDP by.  The substitution happens in the spawned
ranks (``_run``), so the runner process itself stays unpatched.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
import traceback
import unittest
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

WORLD_SIZE = 2
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", str(WORLD_SIZE))
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "150")
if "TEMP_DIR" not in os.environ:  # set by the runner; the module-level reads in distributed_test need one
    import tempfile

    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="gf-torch-suite-")

from torch.testing._internal import common_distributed as _cd  # noqa: E402

from .cuda_on_cpu import allow_cpu_skips, map_cuda_to_cpu, patch  # noqa: E402

allow_cpu_skips()
_cd.TIMEOUT_OVERRIDE.update({k: 150 for k in _cd.TIMEOUT_OVERRIDE})

from torch.testing._internal import common_utils as _cu  # noqa: E402
from torch.testing._internal.distributed import distributed_test as _dt  # noqa: E402


def _multigpu_helper(world_size: int, backend: str) -> dict[int, list[int]]:
    return {r: [r] for r in range(world_size)}


_dt.init_multigpu_helper = _multigpu_helper
_barrier_sync = _dt.Barrier.__dict__["sync"].__func__  # the classmethod's function, called with our cls


def _patient_barrier(cls: type, wait_for: int | None = None, timeout: float = 10) -> None:
    # torch's file barrier gives ranks 10 s to arrive; two ranks importing torch on a loaded 2-core
    # machine can be further apart than that, which is the machine's slowness, not a test result.
    _barrier_sync(cls, wait_for, max(timeout, 120))


patch(_dt.Barrier, "sync", classmethod(_patient_barrier))


class TorchDDPOnCpu(torch.nn.parallel.DistributedDataParallel):
    """torch DDP with ``device_ids`` / ``output_device`` dropped (the module is on the CPU)."""

    def __init__(self, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None, *a, **k) -> None:
        super().__init__(module, None, None, *a, **k)


def _substitute(cls: type) -> None:
    patch(_dt, "DistributedDataParallel", cls)
    patch(torch.nn.parallel, "DistributedDataParallel", cls)


class _Base(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    """What test_distributed_spawn.py's ``TestDistBackendWithSpawn`` is, plus the CPU mapping."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _prepare_rank(cls) -> None:
        map_cuda_to_cpu()
        _substitute(TorchDDPOnCpu)

    @classmethod
    def _run(cls, *args: Any, **kwargs: Any) -> None:
        """A spawned rank: ``(rank, test_name, file_name, pipe)`` as torch passes them (its two bases name the
        pipe differently), after the CPU mapping."""
        cls._prepare_rank()
        super()._run(*args, **kwargs)


class TorchDDP(_Base):
    """The oracle: torch's DistributedDataParallel."""


class Gradientflow(_Base):
    """gradientflow.DistributedDataParallel under torch DDP's names."""

    @classmethod
    def _prepare_rank(cls) -> None:
        map_cuda_to_cpu()
        from .gf_on_cpu import GradientflowOnCpu

        _substitute(GradientflowOnCpu)


IMPLEMENTATIONS = {"torch": TorchDDP, "gradientflow": Gradientflow}


def all_ddp_tests() -> list[str]:
    """The DDP tests: ``test_DistributedDataParallel*``, ``test_ddp_*`` and the other tests that construct
    DDP, in their body or through the class's helper methods (followed to any depth)."""
    base = _dt.DistributedTest._DistTestBase
    sources = {}
    for name in dir(base):
        try:
            sources[name] = inspect.getsource(inspect.unwrap(getattr(base, name)))
        except (OSError, TypeError):
            continue
    builds = {n for n, src in sources.items() if "DistributedDataParallel(" in src}
    while True:
        more = {n for n, src in sources.items() if n not in builds and any(f"self.{h}(" in src for h in builds)}
        if not more:
            break
        builds |= more
    names = sorted(n for n in dir(base) if n.startswith("test_"))
    return [n for n in names if n.startswith(("test_DistributedDataParallel", "test_ddp_")) or n in builds]


_SKIP_CODES = {s.exit_code for s in _cd.TEST_SKIPS.values()}


def run_one(cls: type, rank: int, name: str, workdir: str, pg_timeout: float) -> tuple[str, str]:
    """One test on this rank, as ``TestDistBackend._run`` runs it: ("pass" | "skip" | "fail", detail)."""
    os.makedirs(os.path.join(workdir, "barrier"), exist_ok=True)
    os.makedirs(os.path.join(workdir, "test_dir"), exist_ok=True)
    os.environ["TEMP_DIR"] = workdir
    _dt.Barrier.barrier_id = 0
    test = cls(name)
    test.rank = rank
    test.file_name = os.path.join(workdir, "init")
    timeout = _dt.CUSTOM_PG_TIMEOUT.get(name, pg_timeout)
    outcome, detail = "pass", ""
    try:
        dist.init_process_group(
            init_method=test.init_method,
            backend="gloo",
            world_size=WORLD_SIZE,
            rank=rank,
            timeout=timedelta(seconds=timeout),
        )
        test._barrier()
        _cu.set_rng_seed()
        getattr(test, name)()
    except unittest.SkipTest as e:
        outcome, detail = "skip", str(e)
    except SystemExit as e:
        outcome, detail = ("skip", f"exit {e.code}") if e.code in _SKIP_CODES else ("fail", f"exit {e.code}")
    except BaseException:  # noqa: BLE001 - a test's failure is a result, whatever it raised
        outcome, detail = "fail", traceback.format_exc()
    with contextlib.suppress(BaseException):
        test._barrier(timeout=2 * timeout)
    with contextlib.suppress(BaseException):
        if dist.is_initialized():
            dist.destroy_process_group()
    return outcome, detail


def worker(impl: str, rank: int, names: list[str], workdir: str, pg_timeout: float, results: Any) -> None:
    """A rank that runs ``names`` one after another (one process per rank for the whole list)."""
    cls = IMPLEMENTATIONS[impl]
    cls._prepare_rank()
    for k, name in enumerate(names):
        t0 = time.perf_counter()
        outcome, detail = run_one(cls, rank, name, os.path.join(workdir, f"{k:03d}"), pg_timeout)
        results.put((rank, name, outcome, detail[-4000:], time.perf_counter() - t0))
