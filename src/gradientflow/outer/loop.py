"""The outer loop of DiLoCo: the last synchronised parameters, the outer momentum, the step phase, and the sync.

After every optimizer step of the inner optimizer (the user's), :meth:`OuterLoop.after_step` counts it; a
fragment that is due (:func:`.fragments.due`) is synchronised right there, so the parameters the next forward
sees, and a checkpoint written after that step, are the synchronised ones:

1. ``delta = anchor - theta``: the pseudo-gradient, the drift since the last sync (fp32, on the state device);
2. its mean over the replicas (:class:`.exchange.Average`; the only communication);
3. the outer step (:func:`.nesterov.nesterov_step`) on ``anchor`` and the momentum;
4. every parameter of the fragment set to ``anchor``: every replica ends with the same bits (the same anchor,
   the same averaged bytes decoded the same way, the same arithmetic).

Steps 3-4 run only once step 2 completed on this rank: a rank lost during the exchange leaves the others'
parameters, anchor, momentum and residual as they were before the sync (each raises ``CommunicationError``).

Memory per rank: the anchor and, with ``outer_momentum > 0``, the momentum (4 bytes per parameter each, on
``outer_state_device``; the default, averaging, keeps no momentum), a transient
pseudo-gradient per sync, and the quantised exchange's residual (4 bytes per element of the rank's shard).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..diagnostics.watchdog import Watchdog
from .exchange import Average, Sent
from .fragments import check_cut, cut, due
from .nesterov import nesterov_step


class OuterLoop:
    """DiLoCo's outer state and sync over ``params`` (the wrapper's trainable parameters, in order)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        every: int,
        lr: float,
        momentum: float,
        fragments: int,
        exchange: Average,
        watchdog: Watchdog,
        state_device: torch.device | None = None,
    ) -> None:
        self.params, self.every, self.lr, self.momentum = params, every, lr, momentum
        self.exchange, self.watchdog = exchange, watchdog
        self.runs = cut([p.numel() for p in params], fragments)
        check_cut(self.runs, len(params))
        self.sizes = [sum(params[i].numel() for i in run) for run in self.runs]
        self.device = state_device if state_device is not None else params[0].device
        self.anchor: list[torch.Tensor] | None = None  # the last synchronised parameters, per fragment (fp32)
        self.buf: list[torch.Tensor] | None = None  # the outer momentum, per fragment
        self.steps = 0  # inner optimizer steps done: the phase within the interval is steps % every
        self.syncs = 0  # fragments synchronised (F per H steps)
        self.sent = Sent()  # this rank's bytes of every outer sync since construction (not checkpointed: a run's)
        self.seconds = 0.0
        self.last_sync_step: int | None = None
        self.loaded_steps = 0  # the steps a loaded checkpoint had done (steps_here counts this process's)

    # ---- the state ---------------------------------------------------------------------
    def _flat(self, f: int) -> torch.Tensor:
        """Fragment ``f``'s parameters now, one fp32 vector on the state device (new memory)."""
        with torch.no_grad():
            parts = [self.params[i].detach().reshape(-1) for i in self.runs[f]]
            return torch.cat(parts).to(device=self.device, dtype=torch.float32)

    def start(self) -> None:
        """Before the first inner step: the current parameters are the synchronised ones (the construction's
        broadcast, or a model state every rank loaded after it)."""
        if self.anchor is None:
            self.anchor = [self._flat(f) for f in range(len(self.runs))]
            self.buf = [torch.zeros_like(a) for a in self.anchor] if self.momentum else None  # averaging: none

    # ---- per step ----------------------------------------------------------------------
    def after_step(self) -> list[int]:
        """One inner step done: synchronise every fragment now due; the fragments synchronised."""
        self.start()
        self.steps += 1
        done = [f for f in range(len(self.runs)) if due(self.steps, f, len(self.runs), self.every)]
        for f in done:
            self.sync(f)
        return done

    def sync(self, f: int) -> None:
        """Steps 1-4 of the module docstring for fragment ``f``."""
        assert self.anchor is not None  # start() ran
        t0 = time.perf_counter()
        self.watchdog.step = self.steps  # messages name the inner step the sync follows
        delta = self.anchor[f] - self._flat(f)
        what = f"outer exchange of fragment {f} after step {self.steps}"
        wire = delta.to(self.params[0].device)  # the exchange runs where the backend sends from (NCCL: the GPU)
        sent, residual = self.exchange.average(wire, f, what)  # raises before anything below changed
        self.exchange.commit(f, residual)
        if wire is not delta:
            delta.copy_(wire)
        if self.buf is None:  # no momentum: the plain step (outer_lr 1: the replicas' average)
            self.anchor[f].sub_(delta, alpha=self.lr)
        else:
            nesterov_step(self.anchor[f], self.buf[f], delta, self.lr, self.momentum)
        self._write(f)
        self.syncs += 1
        self.sent.payload += sent.payload
        self.sent.inter += sent.inter
        self.sent.intra += sent.intra
        self.seconds += time.perf_counter() - t0
        self.last_sync_step = self.steps

    def _write(self, f: int) -> None:
        """Fragment ``f``'s parameters := its anchor (in their dtype, on their device)."""
        assert self.anchor is not None
        anchor = self.anchor[f]
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
            "inner_steps": self.steps,
            "outer_syncs": self.syncs,
            "outer_payload_bytes": self.sent.payload,
            "outer_inter_node_bytes": self.sent.inter,
            "outer_intra_node_bytes": self.sent.intra,
            "outer_seconds": self.seconds,
            "outer_payload_bytes_per_step": per_step,
            "outer_bytes_ratio": per_step / dense_bytes if dense_bytes else 0.0,
        }

    @property
    def steps_here(self) -> int:
        """Inner steps run by this process (a resumed run's steps before its checkpoint excluded)."""
        return self.steps - self.loaded_steps

    # ---- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The anchor, the momentum, the quantised exchange's residuals (this rank's shards), the step count."""
        return {
            "sync_every": self.every,
            "fragments": [list(r) for r in self.runs],
            "steps": self.steps,
            "anchor": None if self.anchor is None else [a.clone() for a in self.anchor],
            "momentum": None if self.buf is None else [b.clone() for b in self.buf],
            "residuals": [None if r is None else r.clone() for r in self.exchange.residuals],
            "exchange": self.exchange.spec.name,
        }

    def validate_state_dict(self, state: dict[str, Any]) -> None:
        """``ValueError`` (nothing changed) unless ``state`` fits this model and these options."""
        missing = {"sync_every", "fragments", "steps", "anchor", "momentum", "residuals", "exchange"} - set(state)
        if missing:
            raise ValueError(f"gradientflow sync_every: the outer state lacks {sorted(missing)} (truncated?)")
        saved = (state["sync_every"], [list(r) for r in state["fragments"]], state["exchange"])
        mine = (self.every, [list(r) for r in self.runs], self.exchange.spec.name)
        if saved != mine:
            raise ValueError(
                f"gradientflow sync_every: the outer state was saved with sync_every, fragments, outer_compression = "
                f"{saved[0]}, {saved[1]}, {saved[2]!r}; this model has {mine[0]}, {mine[1]}, {mine[2]!r}. Resume "
                "with the same options."
            )
        for key in ("anchor", "momentum"):
            ts = state[key]
            if ts is not None and [t.numel() for t in ts] != self.sizes:
                raise ValueError(
                    f"gradientflow sync_every: the outer state's {key} holds {[t.numel() for t in ts]} elements per "
                    f"fragment, this model {self.sizes}: load it into the model it was saved from."
                )
        res = state["residuals"]
        shards = [self.exchange.shard(n) for n in self.sizes]
        if len(res) != len(shards) or any(r is not None and r.numel() != s for r, s in zip(res, shards)):
            raise ValueError(
                "gradientflow sync_every: the outer state's residuals do not fit this rank's shards (saved on "
                "another node layout or model?). Resume on the same layout."
            )

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
        self.steps = int(state["steps"])
        self.loaded_steps = self.steps
