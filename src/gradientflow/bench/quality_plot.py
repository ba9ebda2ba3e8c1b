"""The plots of ``gradientflow bench --quality``: per workload validation loss against steps and against
training wall clock (and accuracy for digits), per time-to-accuracy job loss against the clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gradientflow.diagnostics.extras import can_plot


def plot(summary: dict[str, Any], out: Path) -> list[Path]:
    """``quality_<workload>.png`` (validation loss, and accuracy for digits, against steps, every recipe)
    and ``<tta job>.png`` per time-to-accuracy job (validation loss against training wall-clock seconds);
    none (and a line saying so) without matplotlib: the tables are written all the same."""
    if not can_plot():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    # recipes that train alike (ddp and gf-fp16-dense) must stay visible on top of each other
    style: dict[str, dict[str, Any]] = {
        "ddp": {"color": "black", "lw": 3, "alpha": 0.5},
        "gf-fp16-dense": {"color": "tab:red", "ls": "--"},
        "gf-recommended": {"color": "tab:orange"},
        "gf-density-0.3": {"color": "tab:blue"},
        "gf-paper": {"color": "tab:green"},
        "ddp-sgd": {"color": "tab:purple", "ls": ":"},
    }
    for w in summary["workloads"].values():
        digits = w["metric"] == "val_acc"
        panels = 3 if digits else 2
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
        loss_ax, wall_ax = axes[0][0], axes[0][panels - 1]
        for r in w["rows"]:
            c = r["curve"]
            kw = {"marker": "o", "ms": 3, "label": r["recipe"], **style.get(r["recipe"], {})}
            loss_ax.plot(c["step"], c["val_loss"], **kw)
            wall_ax.plot(c["wall_s"], c["val_loss"], **kw)
            if digits:
                axes[0][1].plot(c["step"], [100 * a for a in c["val_acc"]], **kw)
        loss_ax.set(xlabel="step", ylabel="validation loss", title=f"{w['name']} ({w['n_params']:,} parameters)")
        # on loopback the clock is the ranks' CPU (compute, codecs, copies), not a network's
        wall_ax.set(
            xlabel="training wall clock, s (validation excluded)", ylabel="validation loss", title="against time"
        )
        if not digits:
            finite = [v for r in w["rows"] for v in r["curve"]["val_loss"][1:] if np.isfinite(v)]
            if finite:  # the untrained first point would flatten the rest
                for ax in (loss_ax, wall_ax):
                    ax.set_ylim(min(finite) - 0.05, max(finite) + 0.1)
        else:
            axes[0][1].set(xlabel="step", ylabel="validation accuracy, %", ylim=(80, 100), title="digits accuracy")
            axes[0][1].legend()
        loss_ax.legend()
        fig.tight_layout()
        paths.append(out / f"quality_{w['name']}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    for t in summary["tta"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in t["rows"]:
            c = r["curve"]
            (line,) = ax.plot(
                c["wall_s"], c["val_loss"], marker="o", ms=3, label=r["recipe"], **style.get(r["recipe"], {})
            )
            if r["time_to_target_s"] is not None:
                ax.axvline(r["time_to_target_s"], color=line.get_color(), ls=":", lw=1)
        ax.axhline(t["target_val_loss"], color="gray", ls="--", lw=1, label="ddp's final loss")
        if t["common_val_loss"] != t["target_val_loss"]:
            ax.axhline(t["common_val_loss"], color="gray", ls="-.", lw=1, label="worst final loss")
        finite = [v for r in t["rows"] for v in r["curve"]["val_loss"][1:] if np.isfinite(v)]
        if finite:
            ax.set_ylim(min(finite) - 0.05, max(finite) + 0.1)
        ax.set(
            xlabel="training wall clock, s (validation excluded)",
            ylabel="validation loss",
            title=f"time to accuracy, {t['name']}: {t['n_params']:,} parameters, emulated {t['bandwidth']}",
        )
        ax.legend()
        fig.tight_layout()
        paths.append(out / f"{t['name']}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
