"""The outer loop of DiLoCo: the last synchronised parameters, the outer momentum, the step phase, and the sync.

After every optimizer step of the inner optimizer (the user's), :meth:`OuterLoop.after_step` counts it; a
fragment that is due (:func:`.fragments.due`) is synchronised right there, so the parameters the next forward
sees, and a checkpoint written after that step, are the synchronised ones:

1. ``delta = anchor - theta``: the pseudo-gradient, the drift since the last sync (fp32, on the state device);
2. its mean over the replicas (:class:`.exchange.Average`; the only communication);
3. the outer step (:func:`.nesterov.nesterov_step`) on ``anchor`` and the momentum;
4. every parameter of the fragment set to ``anchor``: every replica ends with the same bits (the same anchor,
   the same averaged bytes decoded the same way, the same arithmetic).  The top-k exchange sends only part of
   each replica's pseudo-gradient: there step 4 sets the fragment to ``anchor`` minus what this replica did not
   send (:mod:`.sparse` says why), so the anchors are the same bits on every replica and the parameters differ by
   that; averaging (outer lr 1, no momentum) then leaves the replicas' mean where their parameters' mean was.

Steps 3-4 run only once step 2 completed on this rank: a rank lost during the exchange leaves the others'
parameters, anchor, momentum and residual as they were before the sync (each raises ``CommunicationError``).

Streaming's overlap (``delay`` = ``sync_delay`` > 0): step 2 is only started at the sync step (the exchange posted,
:class:`.exchange.Flight`) and the inner steps go on; ``delay`` steps later it is finished, step 3 runs, and step 4
sets the fragment to the new anchor plus this replica's own progress since step 1 (``theta_now - theta_then``),
so no inner step is lost: the next pseudo-gradient carries that progress to the other replicas.  The anchors are
the same bits on every replica after every merge; the parameters differ by each replica's progress since the
sync step.  ``delay = 0`` is the blocking sync above, unchanged.

Memory per rank: the anchor and, with ``outer_momentum > 0``, the momentum (4 bytes per parameter each, on
``outer_state_device``; the default, averaging, keeps no momentum), a transient
pseudo-gradient per sync, and the quantised exchange's residual (4 bytes per element of the rank's shard; the
top-k exchange keeps none between syncs).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from ..diagnostics.watchdog import Watchdog
from .exchange import Average, Flight, Sent
from .fragments import check_cut, cut, due
from .nesterov import nesterov_step
from .saved import check_saved


class Syncs(Protocol):
    """Who synchronises the due fragments, where not the loop itself: replicas that come and go
    (:class:`.membership.Membership`, which holds the loop; the loop knows it only by this contract)."""

    def sync(self, loop: OuterLoop, fragments: list[int]) -> list[int]: ...


class Pending:
    """A fragment's outer exchange between :meth:`OuterLoop.begin` and :meth:`OuterLoop.merge` (streaming's
    overlap): the parameters at the sync step (``then``), the pseudo-gradient's buffers (``wire`` becomes the mean),
    and the exchange in flight, or its finished result (finished early by a checkpoint, or loaded from one)."""

    def __init__(
        self,
        fragment: int,
        merge_at: int,
        then: torch.Tensor,
        delta: torch.Tensor,
        wire: torch.Tensor,
        flight: Flight | None,
        result: tuple[Sent, torch.Tensor | None] | None = None,
    ) -> None:
        self.fragment, self.merge_at, self.then = fragment, merge_at, then
        self.delta, self.wire, self.flight, self.result = delta, wire, flight, result

    def poll(self) -> None:
        if self.flight is not None:
            self.flight.poll()

    def finish(self) -> tuple[Sent, torch.Tensor | None]:
        """The exchange's bytes and new residual, waiting for it the first time (``wire`` is then the mean)."""
        if self.result is None:
            assert self.flight is not None
            self.result = self.flight.finish()
            self.flight = None
        return self.result


class OuterLoop:
    """DiLoCo's outer state and sync over ``params`` (the wrapper's trainable parameters, in order; under
    ``fully_shard`` this rank's local shards of the sharded parameters, views of FSDP's storage)."""

    def __init__(
        self,
        params: list[torch.Tensor],
        *,
        every: int,
        lr: float,
        momentum: float,
        fragments: int,
        exchange: Average,
        watchdog: Watchdog,
        state_device: torch.device | None = None,
        delay: int = 0,
        cut_sizes: list[int] | None = None,
    ) -> None:
        self.params, self.every, self.lr, self.momentum = params, every, lr, momentum
        self.delay = delay
        self.exchange, self.watchdog = exchange, watchdog
        # the fragments are cut by ``cut_sizes`` where given: the whole parameters' sizes, the same on every rank,
        # where ``params`` are shards whose sizes differ between the ranks of a node (fully_shard's)
        self.runs = cut(cut_sizes if cut_sizes is not None else [p.numel() for p in params], fragments)
        check_cut(self.runs, len(params))
        self.sizes = [sum(params[i].numel() for i in run) for run in self.runs]
        self.device = state_device if state_device is not None else params[0].device
        self.anchor: list[torch.Tensor] | None = None  # the last synchronised parameters, per fragment (fp32)
        self.buf: list[torch.Tensor] | None = None  # the outer momentum, per fragment
        self.steps = 0  # inner optimizer steps done: the phase within the interval is steps % every
        self.syncs = 0  # fragments synchronised (F per H steps)
        self.sent = Sent()  # this rank's bytes of every outer sync since construction (not checkpointed: a run's)
        self.last = Sent()  # those of the last inner step's syncs (none: zeros): comm_stats()'s per-step view
        self.seconds = 0.0
        self.last_sync_step: int | None = None
        self.loaded_steps = 0  # the steps a loaded checkpoint had done (steps_here counts this process's)
        self.flights: dict[int, Pending] = {}  # delay > 0: the fragments whose exchange is in flight
        # a loaded checkpoint's own parameters of this replica, written back before the next forward or step
        self.replica: list[torch.Tensor] | None = None
        # replicas that come and go (``replicas=``, a torchft Manager): the syncs run among the live replicas
        self.membership: Syncs | None = None

    # ---- the state ---------------------------------------------------------------------
    def _flat(self, f: int) -> torch.Tensor:
        """Fragment ``f``'s parameters now, one fp32 vector on the state device (new memory)."""
        with torch.no_grad():
            parts = [self.params[i].detach().reshape(-1) for i in self.runs[f]]
            return torch.cat(parts).to(device=self.device, dtype=torch.float32)

    def start(self) -> None:
        """Before the first inner step: the current parameters are the synchronised ones (the construction's
        broadcast, or a model state every rank loaded after it)."""
        self.restore_replica()
        if self.anchor is None:
            self.anchor = [self._flat(f) for f in range(len(self.runs))]
            self.buf = [torch.zeros_like(a) for a in self.anchor] if self.momentum else None  # averaging: none

    def restore_replica(self) -> None:
        """After :meth:`load_state_dict`, once: this replica's own parameters as they were saved.  Between syncs the
        replicas differ, and a checkpoint written the torch DDP way (the model from rank 0 only, loaded on every
        rank: accelerate's ``save_state``, Lightning's checkpoint) holds one replica's; each rank's
        ``comm_state_dict()`` holds its own, written back here, at the next forward or optimizer step (whichever
        comes first), so that the order in which a framework loads the model and the communication state does not
        matter."""
        if self.replica is None:
            return
        for f, values in enumerate(self.replica):
            self._write(f, values)
        self.replica = None

    # ---- per step ----------------------------------------------------------------------
    def after_step(self) -> list[int]:
        """One inner step done: synchronise every fragment now due; the fragments whose parameters changed (with
        ``delay``: merged now, their exchange started ``delay`` steps ago)."""
        self.start()
        self.steps += 1
        self.last = Sent()
        due_now = [f for f in range(len(self.runs)) if due(self.steps, f, len(self.runs), self.every)]
        if self.membership is not None:  # replicas that come and go: each sync among the live ones (membership.py)
            return self.membership.sync(self, due_now)
        if not self.delay:
            for f in due_now:
                self.sync(f)
            return due_now
        for pending in self.flights.values():
            pending.poll()
        merged = [f for f, pending in self.flights.items() if pending.merge_at == self.steps]
        for f in merged:  # merged before a new one starts: one exchange in flight at a time (delay <= H // F)
            self.merge(f)
        for f in due_now:
            self.begin(f)
        return merged

    def sync(self, f: int) -> None:
        """Steps 1-4 of the module docstring for fragment ``f``."""
        assert self.anchor is not None  # start() ran
        t0 = time.perf_counter()
        self.watchdog.step = self.steps  # messages name the inner step the sync follows
        delta = self._flat(f).neg_().add_(self.anchor[f])  # anchor - now, in the new copy: the same bits, one copy
        what = f"outer exchange of fragment {f} after step {self.steps}"
        wire = delta.to(self.params[0].device)  # the exchange runs where the backend sends from (NCCL: the GPU)
        sent, residual = self.exchange.average(wire, f, what)  # raises before anything below changed
        buffers = [delta, wire]
        del delta, wire  # held by ``buffers`` alone: apply() frees them before the parameters are written
        self.apply(f, buffers, sent, residual, t0)

    def apply(self, f: int, buffers: list[torch.Tensor], sent: Sent, residual: torch.Tensor | None, t0: float) -> None:
        """Steps 3-4 once fragment ``f``'s exchange completed: ``buffers`` = [``delta``, ``wire``] (``wire`` the mean;
        ``delta`` its copy on the state device, or ``wire`` itself; emptied here, the caller's only reference), the
        residual committed, the outer step, the parameters written."""
        assert self.anchor is not None
        delta, wire = buffers
        buffers.clear()
        self.exchange.commit(f, residual)
        if wire is not delta:
            delta.copy_(wire)
        self._outer_step(f, delta)
        del delta, wire  # a copy of the fragment less while the parameters are written
        if self.exchange.keeps_unsent:  # the top-k exchange: what this replica did not send stays in its parameters
            assert residual is not None  # the exchange's own tensor, stored nowhere: anchor - it, in place
            self._write(f, residual.to(self.anchor[f].device).neg_().add_(self.anchor[f]))
        else:
            self._write(f)
        self._count(sent, t0)

    def begin(self, f: int) -> None:
        """Streaming's overlap, at fragment ``f``'s sync step: the pseudo-gradient taken and its exchange started."""
        assert self.anchor is not None
        t0 = time.perf_counter()
        self.watchdog.step = self.steps
        then = self._flat(f)  # this replica's parameters at the sync step (its progress is measured from here)
        delta = self.anchor[f] - then
        what = f"outer exchange of fragment {f} after step {self.steps} (merged after step {self.steps + self.delay})"
        wire = delta.to(self.params[0].device)
        pending = Pending(f, self.steps + self.delay, then, delta, wire, self.exchange.start(wire, f, what))
        self.flights[f] = pending
        self.seconds += time.perf_counter() - t0

    def merge(self, f: int) -> None:
        """Streaming's overlap, ``delay`` steps after :meth:`begin`: the exchange finished (raises before anything
        changed), the outer step on the anchor, and the fragment set to the anchor plus the progress since."""
        assert self.anchor is not None
        t0 = time.perf_counter()
        pending = self.flights[f]
        self.watchdog.step = self.steps
        sent, residual = pending.finish()
        delta = pending.delta
        if pending.wire is not delta:
            delta.copy_(pending.wire)
        self.exchange.commit(f, residual)
        del self.flights[f]
        self._outer_step(f, delta)
        progress = self._flat(f).sub_(pending.then)  # the inner steps since the sync step, kept
        if self.exchange.keeps_unsent:  # and, with the top-k exchange, what this replica did not send
            assert residual is not None
            progress.sub_(residual.to(progress.device))
        self._write(f, progress.add_(self.anchor[f]))
        self._count(sent, t0)

    def _outer_step(self, f: int, delta: torch.Tensor) -> None:
        """Step 3 on fragment ``f``'s anchor with the averaged ``delta`` (overwritten by Nesterov's direction)."""
        assert self.anchor is not None
        if self.buf is None:  # no momentum: the plain step (outer_lr 1: the replicas' average)
            self.anchor[f].sub_(delta, alpha=self.lr)
        else:
            nesterov_step(self.anchor[f], self.buf[f], delta, self.lr, self.momentum)

    def _count(self, sent: Sent, t0: float) -> None:
        """One fragment synchronised: its bytes and time in the run's totals."""
        self.syncs += 1
        for run in (self.sent, self.last):
            run.payload += sent.payload
            run.inter += sent.inter
            run.intra += sent.intra
        self.seconds += time.perf_counter() - t0
        self.last_sync_step = self.steps

    def _write(self, f: int, values: torch.Tensor | None = None) -> None:
        """Fragment ``f``'s parameters := its anchor, or ``values`` (in their dtype, on their device)."""
        assert self.anchor is not None
        anchor = self.anchor[f] if values is None else values
        offset = 0
        with torch.no_grad():
            for i in self.runs[f]:
                p = self.params[i]
                p.copy_(anchor[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # ---- comm_stats() ------------------------------------------------------------------
    def stats(self, dense_bytes: int) -> dict[str, float | int]:
        """``comm_stats()``'s outer keys: syncs, bytes since construction and per inner step (the run's average),
        and the same per step over ``dense_bytes`` (one dense fp32 allreduce of every gradient: torch DDP's
        bytes handed over per step)."""
        steps = max(self.steps_here, 1)
        per_step = self.sent.payload / steps
        return {
            "sync_every": self.every,
            "sync_fragments": len(self.runs),
            "sync_delay": self.delay,
            "inner_steps": self.steps,
            "outer_syncs": self.syncs,
            "outer_payload_bytes": self.sent.payload,
            "outer_inter_node_bytes": self.sent.inter,
            "outer_intra_node_bytes": self.sent.intra,
            "outer_seconds": self.seconds,
            "outer_payload_bytes_per_step": per_step,
            "outer_bytes_ratio": per_step / dense_bytes if dense_bytes else 0.0,
            "outer_state_bytes": self.state_bytes(),
        }

    def state_bytes(self) -> int:
        """Bytes of the tensors the outer loop holds between steps: the anchor, the momentum, the quantised
        exchange's residuals and, with ``delay``, the fragments in flight (their parameters at the sync step and
        pseudo-gradient).  What a sync allocates and frees within the step is not counted."""
        held = [*(self.anchor or []), *(self.buf or []), *(r for r in self.exchange.residuals if r is not None)]
        for pending in self.flights.values():
            held += [pending.then, pending.delta] + ([pending.wire] if pending.wire is not pending.delta else [])
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def steps_here(self) -> int:
        """Inner steps run by this process (a resumed run's steps before its checkpoint excluded)."""
        return self.steps - self.loaded_steps

    # ---- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The anchor, the momentum, the quantised exchange's residuals (this rank's shards), the step count."""
        flights = []
        for f, pending in sorted(self.flights.items()):  # each finished here (not merged): its result is saved
            _, residual = pending.finish()
            flights.append(
                {
                    "fragment": f,
                    "merge_at": pending.merge_at,
                    "then": pending.then.clone(),
                    "mean": pending.wire.clone(),
                    "residual": None if residual is None else residual.clone(),
                }
            )
        return {
            "sync_every": self.every,
            "fragments": [list(r) for r in self.runs],
            "sync_delay": self.delay,
            "steps": self.steps,
            "anchor": None if self.anchor is None else [a.clone() for a in self.anchor],
            "momentum": None if self.buf is None else [b.clone() for b in self.buf],
            "residuals": [None if r is None else r.clone() for r in self.exchange.residuals],
            "exchange": self.exchange.spec.name,
            "flights": flights,
            # this replica's own parameters (they differ from the other replicas' between syncs): see restore_replica
            "replica": [self._flat(f) for f in range(len(self.runs))] if self.replica is None else self.replica,
        }

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        """``ValueError`` (nothing changed) unless ``state`` fits this model and these options (:mod:`.saved`)."""
        options = (self.every, [list(r) for r in self.runs], self.exchange.spec.name, self.delay)
        check_saved(state, options, self.sizes, [self.exchange.shard(n) for n in self.sizes])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validate_state_dict(state)
        dev = self.device

        def put(ts: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if ts is None else [t.to(device=dev, dtype=torch.float32).clone() for t in ts]

        self.anchor, self.buf = put(state["anchor"]), put(state["momentum"])
        if self.anchor is not None and self.buf is None and self.momentum:
            self.buf = [torch.zeros_like(a) for a in self.anchor]
        self.exchange.residuals = [
            None if r is None else r.to(device=self.params[0].device, dtype=torch.float32).clone()
            for r in state["residuals"]
        ]
        self.flights = {}
        params_device = self.params[0].device
        for flight in state.get("flights", []):
            mean = flight["mean"].to(device=dev, dtype=torch.float32).clone()
            residual = flight["residual"]
            if residual is not None:
                residual = residual.to(device=params_device, dtype=torch.float32).clone()
            then = flight["then"].to(device=dev, dtype=torch.float32).clone()
            f = int(flight["fragment"])
            self.flights[f] = Pending(f, int(flight["merge_at"]), then, mean, mean, None, (Sent(), residual))
        replica = state.get("replica")  # saved before the replica was: the model's loaded parameters stand
        self.replica = None if replica is None else [t.to(dtype=torch.float32).clone() for t in replica]
        self.steps = int(state["steps"])
        self.loaded_steps = self.steps
