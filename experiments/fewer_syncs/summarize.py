"""The fewer-syncs table of docs/fewer-syncs.md from the quality bench's raw records (run from the repository root:
``python experiments/fewer_syncs/summarize.py benchmarks/diloco_h/seed0 benchmarks/diloco_h/seed1``).

Per recipe and seed: the final validation loss over torch DDP's (same seed, same batches, one launch) and the bytes
handed to the exchange between replicas per step, over DDP's (4 bytes a parameter a step)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(folder: Path) -> dict[str, tuple[float, float]]:
    job = json.loads((folder / "raw-quality.json").read_text())["jobs"][0]
    dense = 4.0 * job["n_params"]
    base = next(r for r in job["runs"] if r["recipe"] == "ddp")["evals"][-1]["val_loss"]
    out = {}
    for run in job["runs"]:
        payload = [s["payload_bytes"] for s in run["stats"] if s.get("payload_bytes") is not None]
        ratio = sum(payload) / len(payload) / dense if payload else 1.0
        out[run["recipe"]] = (run["evals"][-1]["val_loss"] / base, ratio)
    return out


def main(folders: list[str]) -> None:
    per_seed = [rows(Path(f)) for f in folders]
    print("| recipe | " + " | ".join(f"loss / DDP ({Path(f).name})" for f in folders) + " | bytes / DDP's |")
    print("|---|" + "---|" * len(folders) + "---|")
    for recipe in per_seed[0]:
        losses = " | ".join(f"{s[recipe][0]:.3f}" if recipe in s else "—" for s in per_seed)
        print(f"| `{recipe}` | {losses} | {per_seed[0][recipe][1]:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
