"""The communication checkpoint: what a resumed run needs besides the model and the optimizer.

CSC's residuals (and its step counter, which drives the density ramp) live in the pool's layout,
so the layout's parameter order is saved with them and a resumed run adopts it.  Per rank:
residuals differ between ranks.  :func:`load` checks everything before it changes anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .reducer import Reducer


def save(engine: Reducer, world_size: int) -> dict[str, Any]:
    """The strategy's state plus the layout it lives in and the world size it was made for."""
    state = dict(engine.sync.state_dict())
    state["layout_order"] = list(engine.pool.layout.order)
    state["layout_final"] = engine.layout_final
    state["world_size"] = world_size
    state["topology"] = engine.config.topology  # the node layout it ran on (the quantised residual's shards)
    return state


def load(engine: Reducer, state: dict[str, Any], world_size: int) -> None:
    """Restore what :func:`save` returned into ``engine`` (same model, options and world size).

    A state from another model, world size or chunk size, or a truncated one, raises
    ``ValueError`` before anything changes.
    """
    state = dict(state)
    order = state.pop("layout_order", None)
    final = bool(state.pop("layout_final", False))
    world = state.pop("world_size", world_size)
    state.pop("topology", None)  # informational here: the quantised strategy checks its own copy
    if world != world_size:
        raise ValueError(
            f"gradientflow: the communication state was saved with world size {world}, this job has "
            f"{world_size}; residuals are per rank and cannot be re-split. Resume with the same "
            "world size, or start the communication state afresh (skip load_comm_state_dict)."
        )
    n_params = len(engine.params)
    if order is not None and sorted(order) != list(range(n_params)):
        raise ValueError(
            f"gradientflow: the communication state's layout covers {len(order)} parameters, this model "
            f"has {n_params}: load it into the model it was saved from."
        )
    engine.sync.validate_state_dict(state)
    if order is not None and tuple(order) != engine.pool.layout.order:
        engine.adopt_order(list(order))
    engine.sync.load_state_dict(state)
    if final:
        engine.layout.mark_final()
