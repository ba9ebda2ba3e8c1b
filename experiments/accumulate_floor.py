"""The floor under CSC's step on this CPU: one pass of error feedback's ``v += g`` over the whole pool.

Issue 28, item 4.  Every synchronised CSC step adds each fresh gradient into the residual v: a pass
that reads g and v and writes v (12 bytes per parameter, 306 MB on ResNet-50).  No schedule can
skip it, so its time is a floor under CSC's cost over compute.  Timed here in one process, on one
thread, with nothing else running, per parameter as the engine does it (ResNet-50's parameter
sizes, each parameter's gradient a tensor of its own):

- ``add_l1``: gradientflow's kernel (``v += g`` with the chunks' L1 summed in the same pass);
- ``torch_add``: ``v.add_(g)``, what torch's autograd does to accumulate into a bound ``.grad``;
- ``copy``: ``v.copy_(g)`` (8 bytes per parameter), what torch DDP pays to copy gradients into its buckets.

    python experiments/accumulate_floor.py --out benchmarks/accumulate_floor
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from gradientflow.bench.models import build_model  # noqa: E402
from gradientflow.strategies import csc_native  # noqa: E402


def _time(fn: Callable[[], None], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--chunk", type=int, default=32768, help="CSC's chunk (ResNet-50's under chunk_size='auto')")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/accumulate_floor"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = [p.shape for p in build_model(args.model).parameters()]
    n = sum(s.numel() for s in shapes)
    v = torch.zeros(n)
    grads = [torch.randn(s).view(-1) for s in shapes]
    scores = torch.zeros(n // args.chunk + 1)
    offsets = [0]
    for g in grads[:-1]:
        offsets.append(offsets[-1] + g.numel())
    views = [v[o : o + g.numel()] for o, g in zip(offsets, grads)]

    def torch_add() -> None:
        for view, g in zip(views, grads):
            view.add_(g)

    def copy() -> None:
        for view, g in zip(views, grads):
            view.copy_(g)

    passes = {"torch_add": torch_add, "copy": copy}
    if csc_native.available():
        add = csc_native.add_l1_unchecked()

        def add_l1() -> None:
            for view, g, o in zip(views, grads, offsets):
                add(view.data_ptr(), g.data_ptr(), g.numel(), o, args.chunk, scores.data_ptr())

        passes = {"add_l1": add_l1, **passes}
    for fn in passes.values():  # first touch of every page, and the caches' steady state
        fn()
    rows = {}
    for name, fn in passes.items():
        samples = _time(fn, args.repeats)
        bytes_moved = (8 if name == "copy" else 12) * n
        med = statistics.median(samples)
        rows[name] = {"ms": 1e3 * med, "GBps": bytes_moved / med / 1e9, "samples_s": samples}
    result = {
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "model": args.model,
        "parameters": n,
        "passes": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"`{result['command']}` ({result['started']}); {args.model}, {n:,} parameters, one thread, "
        f"median of {args.repeats}.",
        "",
        "| pass | ms | GB/s moved |",
        "|---|---|---|",
        *(f"| {k} | {r['ms']:.1f} | {r['GBps']:.1f} |" for k, r in rows.items()),
    ]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
