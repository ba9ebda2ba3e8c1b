"""The step-time bench's mode names in the recipe table's words, and the names they had before it.

A gradientflow mode is ``gf-<recipe>``, one row of the recipe table (docs/recipes.md), optionally with wrapper
options after a colon (``gf-topk-fp16:csc_scope=global``, the syntax of ``bench --quality``'s variants) and a
layout after ``@`` (``gf-fp16@flat``).  The names the bench had before the table (``gf-fp32``,
``gf-fp16-csc-slice``, ``gf-cscq``, ...; :data:`OLD_MODES`) and ``gf-<earlier name>`` of a recipe (``gf-csc``,
``gf-q3p``) still run: :func:`canonical_mode` spells them as the table does, and the reports show results written
under them in that spelling (:func:`canonical_summary`), so a table made from an older ``results.json`` reads as a
new one does.

This module imports nothing of the bench: the reports read it as the runner does.
"""

from __future__ import annotations

import ast
import copy
from typing import Any

from gradientflow.recipes import ALIASES

GF_PREFIX = "gf-"
OPTIONS_SEP = ":"
TOPOLOGY_SEP = "@"
DENSE_FP32 = "gf-none"
"""gradientflow's dense fp32 mode: the θ sweep's, beside torch DDP's buckets."""

OLD_MODES: dict[str, str] = {
    "gf-fp32": "gf-none",
    "gf-fp16-csc": "gf-topk-fp16:csc_scope=global",
    "gf-fp16-csc-slice": "gf-topk-fp16",
    "gf-bf16-csc-slice": "gf-none:comm_dtype=bf16,density=0.1",
    "gf-fp16-csc-auto": "gf-topk-fp16:csc_scope=global,schedule=auto",
    "gf-cscq": "gf-topk-3bit",
}
"""The bench's names from before the recipe table -> the same mode in the table's words (what runs is the same:
``gf-fp32`` was ``compression="none"``, ``gf-fp16-csc-slice`` ``"topk-fp16"``, ...)."""


def canonical_mode(mode: str) -> str:
    """``mode`` as the recipe table spells it: an old name (:data:`OLD_MODES`) or a recipe's earlier name after
    ``gf-`` (``gf-csc``) replaced, its options and ``@topology`` kept; any other mode unchanged."""
    base, at, topology = mode.partition(TOPOLOGY_SEP)
    base = OLD_MODES.get(base, base)
    if base.startswith(GF_PREFIX):
        recipe, colon, options = base.removeprefix(GF_PREFIX).partition(OPTIONS_SEP)
        base = GF_PREFIX + ALIASES.get(recipe.lower(), recipe) + colon + options
    return base + at + topology


def canonical_name(name: str) -> str:
    """A row's name in a bench's results (``"<mode>"``, ``"<mode> alone"``, ``"<mode> θ=4"``) with its mode
    spelled as the recipe table does."""
    mode, space, rest = name.partition(" ")
    return canonical_mode(mode) + space + rest


def canonical_command(command: str | None) -> str | None:
    """A recorded command line with every old mode name in it (``--modes gf-fp32 gf-fp32@flat``) as the recipe
    table spells it; the rest of it as it was."""
    if command is None:
        return None
    words = command.split(" ")
    return " ".join(canonical_mode(w) if w.partition(TOPOLOGY_SEP)[0] in OLD_MODES else w for w in words)


def canonical_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """A copy of a bench's ``results.json`` summary whose rows, θ sweep pairs, ``--modes`` and command carry the
    table's names (:func:`canonical_name`); the summary itself is left as it was."""
    out = copy.copy(summary)
    out["rows"] = [
        {**r, "name": canonical_name(r["name"]), "mode": canonical_mode(r["mode"]) if r.get("mode") else r.get("mode")}
        for r in summary.get("rows", [])
    ]
    out["sweep"] = [
        {k: canonical_name(v) if k in ("gf", "ddp") and v else v for k, v in pair.items()}
        for pair in summary.get("sweep", [])
    ]
    if "command" in summary:
        out["command"] = canonical_command(summary["command"])
    if isinstance(summary.get("options"), dict) and "modes" in summary["options"]:
        out["options"] = {**summary["options"], "modes": [canonical_mode(m) for m in summary["options"]["modes"]]}
    return out


def parse_options(text: str) -> dict[str, Any]:
    """``"csc_scope=global,density=0.3"`` -> ``{"csc_scope": "global", "density": 0.3}``: values are Python
    literals (``0.3``, ``False``, ``None``), anything else a string.  ``ValueError`` for an item that is not
    ``OPTION=VALUE``; which options exist is the caller's to check."""
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key:
            raise ValueError(f"{item!r} is not OPTION=VALUE")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def canonical_matrix(matrix: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``bench --links``' ``matrix.json`` whose rows and command carry the table's names."""
    out = {**matrix, "command": canonical_command(matrix.get("command"))}
    out["profiles"] = [
        {**p, "rows": [{**r, "mode": canonical_name(r["mode"])} for r in p["rows"]]} if p.get("rows") else p
        for p in matrix.get("profiles", [])
    ]
    return out
