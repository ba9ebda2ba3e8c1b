"""Errors raised by gradientflow when communication fails or ranks disagree.

``CommunicationError`` is a ``RuntimeError`` so code that already catches the backend's own
failures (Gloo/NCCL raise ``RuntimeError``/``DistBackendError``) keeps working.
"""

from __future__ import annotations

RESTART_ADVICE = (
    "The process group is unusable now: destroy it (torch.distributed.destroy_process_group()) or exit, "
    "and restart the job (e.g. torchrun --max-restarts) from the last checkpoint."
)


class CommunicationError(RuntimeError):
    """A collective of gradientflow failed or did not complete within ``timeout``.

    Attributes (``None`` where not known):
        step: synchronised step (0-based) in which it happened.
        collective: what was being exchanged ("bucket 3", "scores", "chunks", "layout broadcast", ...).
        nbytes: bytes this rank handed to that collective.
        missing_ranks: the global ranks (``torch.distributed.get_rank()``'s numbering, whatever group the
            exchange ran on) that had not reached a failing wait when this rank gave up (found through the
            rendezvous store); empty when every rank checked in.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        collective: str | None = None,
        nbytes: int | None = None,
        missing_ranks: list[int] | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.collective = collective
        self.nbytes = nbytes
        self.missing_ranks = missing_ranks


class ConsistencyError(RuntimeError):
    """Ranks are not synchronising the same step (``check_consistency=True``) or a gradient is
    non-finite (``check_finite=True``).  Raised on every rank; the process group stays usable."""
