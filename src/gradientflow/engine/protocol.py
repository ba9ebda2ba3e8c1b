"""The one protocol every synchronisation strategy (dense, CSC, ...) implements.

The engine (:mod:`gradientflow.engine.reducer`) decides *when*: it hands each bucket over as soon as it is
ready and calls ``finish`` at the end of backward.  A strategy decides *what* goes on the wire.
The engine never probes a strategy with ``hasattr``: everything it may call is declared here,
with a default for what a strategy without state does not need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..diagnostics.stats import StepStats
from .pool import Bucket, GradPool, Layout


class SyncStrategy(ABC):
    """How the gradients of one synchronised backward are averaged across ranks."""

    def begin_backward(self) -> list[torch.Tensor] | None:
        """A synchronised backward starts: where each parameter's gradient should accumulate.

        ``None`` (the default): in the pool, ``.grad`` being the pool's views.  A strategy may
        return other per-parameter tensors of the parameters' shapes and dtypes (CSC: views of
        its residual, so autograd's accumulation is its ``v += g``); the engine binds ``.grad``
        to them and back to the pool once :meth:`finish` has written the result there.
        """
        return None

    def gradient_slice(self, bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """Where ``bucket``'s freshly accumulated gradient lives (``flat``, unless rebound)."""
        return flat

    def take_fresh(self, grad: torch.Tensor, out: torch.Tensor) -> bool:
        """Move a fresh gradient (autograd's own tensor: a dense backward that started from ``None``
        gradients binds nothing) into its pool view ``out`` (``grad`` may be ``out`` itself: in place).

        The default copies it and returns False.  A strategy may fold the first step of its
        launch into this copy (dense: the division by the world size) and return True; a bucket
        whose gradients all came this way is launched with ``divided=True``.
        """
        out.copy_(grad)
        return False

    def add_fresh(self, index: int, grad: torch.Tensor, target: torch.Tensor) -> None:
        """Add parameter ``index``'s fresh gradient into ``target``, the strategy's own tensor that
        :meth:`begin_backward` named for it (what autograd's accumulation into a bound ``.grad``
        would have done).  The default is that add; a strategy may fold work on the sum into it
        (CSC: its chunks' scores)."""
        target.add_(grad)

    @abstractmethod
    def launch(self, bucket: Bucket, flat: torch.Tensor, stats: StepStats, divided: bool = False) -> None:
        """Start synchronising ``flat`` (a ready slice of the pool), in the caller's thread.

        Called once per bucket per synchronised backward, in bucket order, on every rank alike: a
        collective started here is matched across ranks by that order.  Must not block on a peer.

        Args:
            bucket: which bucket of the pool's layout ``flat`` is (its pool, range and parameters).
            flat: the bucket's elements, as :meth:`gradient_slice` named them (the pool's slice unless
                the strategy rebound ``.grad``).
            stats: this step's counters; record every byte put on the wire
                (``stats.record_collective``) and the time of each phase (``stats.phase``).
            divided: every gradient in ``flat`` went through :meth:`take_fresh` returning True (already
                divided by the world size).

        Raises:
            RuntimeError: a bucket arrived out of order, or a collective could not start
                (``CommunicationError`` from the watchdog for a peer that failed).
        """

    def progress(self, stats: StepStats) -> None:  # noqa: B027 — nothing pending by default
        """A parameter's gradient is ready (called once per parameter during backward): a cheap
        moment to start work that waits on an earlier collective, without ever blocking."""

    @abstractmethod
    def finish(self, stats: StepStats) -> None:
        """End of backward: complete every launched collective; the pool then holds the result.

        Args:
            stats: this step's counters (as in :meth:`launch`; ``stats.extra`` for a strategy's own keys,
                which ``comm_stats()`` reports).

        Raises:
            gradientflow.CommunicationError: a collective did not complete within the watchdog's
                timeout (a peer died or ranks issued different collectives).
        """

    def relayout(self, old_layout: Layout, new_pool: GradPool) -> None:  # noqa: B027 — stateless default
        """Follow the engine to a new pool layout (move any per-element state)."""

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint beside the model (empty for a stateless strategy)."""
        return {}

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` cannot be loaded; change nothing either way."""
        if state:
            raise ValueError(
                "this model communicates densely and has no communication state to load; the checkpoint "
                f"holds {sorted(state)} (saved from a model with density set?)"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`validate_state_dict` accepted it)."""
        self.validate_state_dict(state)

    def has_state(self) -> bool:
        """Whether per-element state exists that a change of device/dtype would lose."""
        return False

    def register_grad_scaler(self, scaler: Any) -> None:  # noqa: B027 — dense needs no loss scale
        """Tell the strategy which ``torch.amp.GradScaler`` scales the gradients."""

    def untouched(self, params: Sequence[int]) -> list[int]:
        """Of these parameters (used by no rank this step), those the step delivered nothing to.

        The engine leaves their ``.grad`` ``None``, as DDP does.  Dense delivers nothing to an
        unused parameter; CSC may deliver an older residual, which must not be dropped.
        """
        return list(params)


MakeSync = Callable[[GradPool, list[torch.Size]], SyncStrategy]
"""Builds a reducer's strategy over its pool, given the parameters' shapes in pool order."""
