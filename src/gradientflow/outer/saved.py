"""What a saved outer state must match to be loaded (:meth:`.loop.OuterLoop.validate_state_dict`): the options it
was saved with, and the sizes of this model's fragments and of this rank's exchange shards.  A pure check, before
anything is loaded: a state that does not fit raises ``ValueError`` saying why, and nothing changed."""

from __future__ import annotations

from typing import Any


def check_saved(state: dict[str, Any], options: tuple[Any, ...], sizes: list[int], shards: list[int]) -> None:
    """``ValueError`` unless ``state`` fits: ``options`` is this loop's (sync_every, fragments as lists of tensor
    indices, the outer exchange's name, sync_delay), ``sizes`` its fragments' elements, ``shards`` this rank's
    residual shard per fragment."""
    missing = {"sync_every", "fragments", "steps", "anchor", "momentum", "residuals", "exchange"} - set(state)
    if missing:
        raise ValueError(f"gradientflow sync_every: the outer state lacks {sorted(missing)} (truncated?)")
    saved = (
        state["sync_every"],
        [list(r) for r in state["fragments"]],
        state["exchange"],
        state.get("sync_delay", 0),  # saved before streaming's overlap existed: 0
    )
    mine = options
    if saved != mine:
        raise ValueError(
            f"gradientflow sync_every: the outer state was saved with sync_every, fragments, outer_compression, "
            f"sync_delay = {saved[0]}, {saved[1]}, {saved[2]!r}, {saved[3]}; this model has {mine[0]}, {mine[1]}, "
            f"{mine[2]!r}, {mine[3]}. Resume with the same options."
        )
    replica = state.get("replica")
    if replica is not None and [t.numel() for t in replica] != sizes:
        raise ValueError(
            f"gradientflow sync_every: the outer state's replica holds {[t.numel() for t in replica]} elements per "
            f"fragment, this model {sizes}: load it into the model it was saved from."
        )
    for flight in state.get("flights", []):
        f = flight["fragment"]
        if not 0 <= f < len(sizes) or flight["then"].numel() != sizes[f]:
            raise ValueError(
                "gradientflow sync_every: the outer state's exchange in flight does not fit this model's "
                "fragments: load it into the model it was saved from."
            )
    for key in ("anchor", "momentum"):
        ts = state[key]
        if ts is not None and [t.numel() for t in ts] != sizes:
            raise ValueError(
                f"gradientflow sync_every: the outer state's {key} holds {[t.numel() for t in ts]} elements per "
                f"fragment, this model {sizes}: load it into the model it was saved from."
            )
    res = state["residuals"]
    if len(res) != len(shards) or any(r is not None and r.numel() != s for r, s in zip(res, shards)):
        raise ValueError(
            "gradientflow sync_every: the outer state's residuals do not fit this rank's shards (saved on "
            "another node layout or model?). Resume on the same layout."
        )
