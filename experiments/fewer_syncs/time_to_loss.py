"""Time to a loss on the emulated link, from the quality bench's time-to-accuracy records (run from the repository
root: ``python experiments/fewer_syncs/time_to_loss.py benchmarks/diloco_tta/100mbit 1.0 1.05``).

Per recipe: the final validation loss over torch DDP's, the bytes the kernel counted on node 0's link over the
whole run (the mean per step: the bench's table gives the median step, which for ``sync_every`` is a step
without a sync), the median step time, and the training wall clock (the sum of the step times, slowest rank
per step, validation outside it) until the validation loss first reaches each target (a factor of DDP's final
loss), linear between validation points, over DDP's time to the same target (how many times sooner).  Where the
launch trained per-step ``gf-auto`` (with or without a ``steps=F`` variant), a last column per target gives how
many times sooner than the sooner of those to reach it.  ``--for-good``: the time from which every later validation
is at or below the target (a loss that dips below it once and comes back above is not counted reached)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from statistics import median


def clock_of(run: dict) -> list[float]:
    """Seconds of training before each step (``[0]`` before step 0, then the running sum of the step times)."""
    clock = [0.0]
    for s in run["step_s"]:
        clock.append(clock[-1] + s)
    return clock


def reach(run: dict, target: float) -> float | None:
    """Seconds of training until the validation loss first reaches ``target`` (None: never)."""
    clock = clock_of(run)
    evals = run["evals"]
    for prev, cur in zip(evals, evals[1:]):
        if cur["val_loss"] <= target:
            t0, t1 = clock[prev["step"]], clock[cur["step"]]
            l0, l1 = prev["val_loss"], cur["val_loss"]
            frac = (l0 - target) / (l0 - l1) if l0 != l1 else 1.0
            return t0 + frac * (t1 - t0)
    return None


def reach_for_good(run: dict, target: float) -> float | None:
    """Seconds of training until the validation loss reaches ``target`` for good: from then on every validation
    to the end of the run is at or below it (None: the last is above).  A validation loss that dips below the
    target once and comes back above counts in :func:`reach`, not here."""
    clock = clock_of(run)
    evals = run["evals"]
    if not evals or evals[-1]["val_loss"] > target:
        return None
    k = len(evals) - 1
    while k > 0 and evals[k - 1]["val_loss"] <= target:
        k -= 1
    if k == 0:
        return clock[evals[0]["step"]]
    prev, cur = evals[k - 1], evals[k]
    t0, t1 = clock[prev["step"]], clock[cur["step"]]
    return t0 + (prev["val_loss"] - target) / (prev["val_loss"] - cur["val_loss"]) * (t1 - t0)


def is_per_step_auto(recipe: str) -> bool:
    """``gf-auto`` or a ``gf-auto:steps=F`` variant: the per-step recipe, not a ``sync_every`` one."""
    base, _, rest = recipe.partition(":")
    return base == "gf-auto" and all(item.startswith("steps=") for item in rest.split(",") if item)


def main(folder: str, factors: list[float], when: Callable[[dict, float], float | None] = reach) -> None:
    """The table, the times by ``when`` (:func:`reach`: first reached; :func:`reach_for_good`)."""
    job = json.loads((Path(folder) / "raw-tta.json").read_text())["jobs"][0]
    runs = job["runs"]
    ddp = next(r for r in runs if r["recipe"] == "ddp")
    base = ddp["evals"][-1]["val_loss"]
    ddp_tx = sum(ddp["nodes"][0]["tx_bytes"]) / len(ddp["nodes"][0]["tx_bytes"])
    targets = [base * f for f in factors]
    autos = [r for r in runs if is_per_step_auto(r["recipe"])]
    auto_time = {t: min((x for x in (when(r, t) for r in autos) if x is not None), default=None) for t in targets}
    per = "DDP / this" + (" | auto / this" if autos else "")
    head = " | ".join(f"time to {t:.3f} ({f:g}x DDP's final) s | {per}" for t, f in zip(targets, factors))
    print(f"| recipe | final loss / DDP | link tx per step (mean) | × DDP's | median step ms | {head} |")
    print("|---|---|---|---|---|" + ("---|---|---|" if autos else "---|---|") * len(targets))
    for run in runs:
        tx = run["nodes"][0]["tx_bytes"]
        mean_tx = sum(tx) / len(tx)
        cells = []
        for t in targets:
            mine, theirs = when(run, t), when(ddp, t)
            if mine is None:
                cells += ["not reached", "—"] + (["—"] if autos else [])
                continue
            cells += [f"{mine:.1f}", f"{theirs / mine:.2f}" if theirs is not None else "—"]
            if autos:
                cells.append(f"{auto_time[t] / mine:.2f}" if auto_time[t] is not None else "—")
        print(
            f"| {run['recipe']} | {run['evals'][-1]['val_loss'] / base:.3f} | {mean_tx:,.0f} B | "
            f"{mean_tx / ddp_tx:.4f} | {1000 * median(run['step_s']):.0f} | " + " | ".join(cells) + " |"
        )


if __name__ == "__main__":
    args = sys.argv[1:]
    for_good = "--for-good" in args  # the times to reach each target for good (reach_for_good)
    args = [a for a in args if a != "--for-good"]
    main(args[0], [float(f) for f in args[1:]] or [1.0, 1.01, 1.03, 1.05], reach_for_good if for_good else reach)
