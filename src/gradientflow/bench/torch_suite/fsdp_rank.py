"""One of torch's FSDP2 tests on one implementation: ``python -m gradientflow.bench.torch_suite.fsdp_rank``.

    python -m gradientflow.bench.torch_suite.fsdp_rank IMPL COMPRESSION FILE Class.test RESULT.json

IMPL is ``torch`` or ``gradientflow`` (:mod:`.fsdp_substitute`, COMPRESSION its recipe).  The test runs as torch's
harness runs it (its ``MultiProcessTestCase`` spawns the ranks; a ``MultiThreadedTestCase`` runs them as threads
here), with CUDA mapped onto the CPU (:mod:`.cuda_on_cpu`) and, for torch's FSDP harness, :data:`DEVICES` CPU
"devices" (its ranks otherwise exit as skipped on a machine without accelerators).  The patches are made when this
module is imported: the ranks torch spawns import it again as their main module (multiprocessing's spawn), with
this command line, so every rank gets the same ones, and the runner process none.  The outcome goes to RESULT.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import unittest

import torch

from .cuda_on_cpu import allow_cpu_skips, map_cuda_to_cpu, patch

DEVICES = 4
"""CPU "devices" torch's FSDP harness sees (``torch.accelerator.device_count()``; its CPU device module's count):
the 2 x 2 HSDP tests' world size."""


def prepare(impl: str, compression: str, test_dir: str) -> None:
    """This process's patches, before the test module is imported (it binds what it imports)."""
    allow_cpu_skips()
    map_cuda_to_cpu()
    patch(torch.accelerator, "device_count", lambda: DEVICES)
    patch(torch.cpu, "device_count", lambda: DEVICES)
    if test_dir not in sys.path:
        sys.path.insert(0, test_dir)
    if impl == "gradientflow":
        from .fsdp_substitute import install

        install(compression)


def run(path: str, test_id: str) -> tuple[str, str]:
    """Run ``test_id`` of the test file ``path``: ("pass" | "fail" | "skip", detail)."""
    module_name = os.path.splitext(os.path.basename(path))[0]
    try:
        module = __import__(module_name)
        suite = unittest.defaultTestLoader.loadTestsFromName(test_id, module)
    except BaseException:  # noqa: BLE001 - a test file torch 2.x cannot import is that test's result
        return "fail", traceback.format_exc()
    result = unittest.TestResult()
    suite.run(result)
    if result.errors or result.failures:
        return "fail", (result.errors + result.failures)[0][1]
    if result.skipped:
        return "skip", result.skipped[0][1]
    if not result.testsRun:
        return "fail", f"no test {test_id} in {path}"
    return "pass", ""


def _argv() -> list[str] | None:
    args = sys.argv[1:]
    return args if len(args) == 5 and args[0] in ("torch", "gradientflow") else None


_ARGS = _argv()
if _ARGS is not None:  # this process and the ranks torch spawns from it (they import this module as their main)
    prepare(_ARGS[0], _ARGS[1], os.path.dirname(os.path.abspath(_ARGS[2])))

if __name__ == "__main__":
    if _ARGS is None:
        sys.exit(__doc__)
    outcome, detail = run(_ARGS[2], _ARGS[3])
    with open(_ARGS[4], "w") as f:
        json.dump({"outcome": outcome, "detail": detail[-4000:]}, f)
