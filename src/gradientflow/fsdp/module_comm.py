"""One FSDP module's reduction between nodes: the all-reduce hook torch's ``fully_shard`` calls, and its state.

Torch 2.13's contract (``FSDPModule.set_all_reduce_hook``; ``_fsdp_collectives.foreach_reduce``): with a 1-D mesh
the hook receives the reduce-scatter's output, this rank's flat shard of the module's gradients (every parameter's
dim-0 shard, padded, back to back; ``reduce_dtype``; already divided by the node's ranks for fp32 and bf16), on the
all-reduce stream (a CUDA device), and must reduce it in place: torch then post-divides it (fp16 only), casts it
to the parameters' dtype and views it as the sharded ``.grad``.  With a 1-D mesh torch ignores
``set_requires_all_reduce(False)`` and calls the hook at every reduce-scatter; the hook reads the flag itself and
keeps the shard (:attr:`ModuleComm.partial`) for the exchange of the last micro-step, as torch's HSDP does.
``set_requires_gradient_sync(False)`` skips the reduce-scatter, so the hook is not called at all.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.nn as nn

from .. import mechanisms
from ..comm.precision import loss_scale
from ..config import GradientFlowConfig
from . import overlap
from .bounded import mesh_watchdog
from .counters import Counts, ExchangeCounters
from .exchange import Finish, QuantizedShard, Sent, post_dense, ring_allreduce_bytes
from .mesh import HSDPMesh
from .mixing import check_tree
from .resume import warn_resume_without_state
from .topk import TopkShard

logger = logging.getLogger(__name__)

ShardState = QuantizedShard | TopkShard
"""The error-feedback state a module's exchange keeps between steps (saved by :mod:`.checkpoint`)."""
ShardExchange = Callable[[torch.Tensor], Finish]
"""A module's exchange between nodes: posted on the shard, which it reduces in place; what it returns waits for it
and gives its bytes."""


def shard_numel(param_group: Any) -> int:
    """Elements of the reduce-scatter output of an FSDP parameter group: every parameter's padded dim-0 shard."""
    return sum(p.padded_sharded_param_size.numel() for p in param_group.fsdp_params)


def shard_layout(param_group: Any) -> list[tuple[int, bool]]:
    """(elements, is 1-D) of each parameter's padded dim-0 shard, in the reduce-scatter output's order."""
    return [(p.padded_sharded_param_size.numel(), p.sharded_param.dim() == 1) for p in param_group.fsdp_params]


class ModuleComm:
    """The recipe state of one module sharded by :func:`gradientflow.fsdp.fully_shard` (``module._gf_fsdp``).

    ``config``: the recipe as :class:`gradientflow.config.GradientFlowConfig` validated it; ``"auto"`` runs dense
    fp32 until :mod:`.auto` switches it (:meth:`switch`).  ``param_group``: torch's FSDP parameter group (``None``:
    the module holds no parameter of its own, and torch never calls the hook)."""

    def __init__(
        self,
        config: GradientFlowConfig,
        mesh: HSDPMesh,
        param_group: Any,
        device: torch.device,
        index: int,
        module: nn.Module,
        overlap_exchange: bool = False,
    ) -> None:
        mechanisms.check_door(config.mechanism, "fsdp", f"compression={config.compression!r}")
        self.module = weakref.ref(module)  # weak: the module holds this object (module._gf_fsdp)
        self.config = config
        self.mesh = mesh
        self.param_group = param_group
        self.device = device
        self.index = index  # construction order: the same on every rank (auto's and the checkpoint's order)
        self.numel = shard_numel(param_group) if param_group is not None else 0
        # the sharded parameters an optimizer holds (auto's test of which optimizer steps this module)
        self.param_ids = frozenset(id(p.sharded_param) for p in param_group.fsdp_params) if param_group else frozenset()
        self.requested = config.compression  # "auto" stays what was asked for after its switch
        self.mixing_checked = False
        self.timeout: timedelta | None = (
            timedelta(seconds=config.timeout) if isinstance(config.timeout, (int, float)) else config.timeout
        )
        # one per mesh (fsdp/bounded.py): every rank's failure checks in under the same keys, so each names the
        # rank that stalled, whichever collective (this exchange, torch's inside the node) it waited in
        self.watchdog = mesh_watchdog(mesh, self.timeout)
        self.exchanges = 0
        self.feedback: ShardState | None = None  # the error-feedback state of a compressing recipe
        self.exchange: ShardExchange
        self.partial: torch.Tensor | None = None  # micro-steps' shards held for the next exchange
        self.counters = ExchangeCounters()
        self.auto_reason = "no optimizer step seen yet: dense fp32" if config.compression == "auto" else ""
        self.user_hook: Callable[[torch.Tensor], None] | None = None  # the user's set_all_reduce_hook
        self.overlap = overlap_exchange  # post in the hook, finish at the next hook or the backward's end (overlap.py)
        self.scaler: Any = None  # the GradScaler registered (register_grad_scaler): the residual's loss scale
        self.state_loaded = False  # the recipe state was loaded (a checkpoint's), since the model's last load
        self.resume_unchecked = False  # the model was loaded; the next exchange checks its recipe state came too
        self.replicas: Any = None  # a torchft Manager (fully_shard's replicas=): the outer syncs among live replicas
        self._make_state()

    @property
    def recipe(self) -> str:
        return self.config.compression

    def _make_state(self) -> None:
        """The recipe's exchange (its mechanism's FSDP form, :mod:`gradientflow.mechanisms`) and its error-feedback
        state, allocated with the module so that a checkpoint can be loaded before the first step (one fp32 shard
        per rank: ``1/G`` of the module; top-k's padded to whole chunks).  A form may keep the state it is handed
        (a switch of recipe, ``"auto"``'s: the same keys in a checkpoint before and after)."""
        build = mechanisms.builder(self.config.mechanism, "fsdp")
        self.exchange, self.feedback = build(self, self.feedback)

    def switch(self, config: GradientFlowConfig, reason: str) -> None:
        """Run ``config``'s recipe from the next exchange on (``"auto"``'s choice, or a resumed checkpoint's)."""
        self.config = config
        self.auto_reason = reason
        self._make_state()

    def __call__(self, t: torch.Tensor) -> None:
        """The all-reduce hook: ``t`` (this rank's shard, the node's average) <- its average over the nodes; then the
        user's hook (:meth:`set_user_hook`) on the reduced shard, where torch's HSDP calls it after its all-reduce.
        With ``overlap`` the exchange is posted here and finished later (:mod:`.overlap`): the previous module's,
        still in flight, is finished first."""
        module = self.module()
        if self.checked_mixing() and module is not None:
            check_tree(module)
        overlap.finish_posted()  # one exchange in flight: the previous module's is done before this one's starts
        step = self.begin(t)
        if step == "held":
            return
        if step == "exchange" and self.overlap and overlap.deferrable(self.param_group, t, self.numel):
            x = t.clone()  # the exchange's own buffer: torch writes t into .grad as soon as this hook returns
            t.zero_()  # so torch views zeros as .grad, or adds zeros to it (overlap.py)
            accumulate = overlap.accumulating(self.param_group)
            finish = self._post(x)

            def done() -> None:
                finish()
                if self.user_hook is not None:
                    self.user_hook(x)
                overlap.write_grads(self.param_group, x, accumulate)

            if overlap.post(done):
                return
            finish()  # no backward pass to finish in: done here, into torch's own tensor
            t.copy_(x)
        elif step == "exchange":
            self._post(t)()
        if self.user_hook is not None:
            self.user_hook(t)

    def begin(self, t: torch.Tensor) -> str:
        """Before an exchange: the resume check, and what ``t`` gets: ``"exchange"`` (its average over the nodes),
        ``"local"`` (nothing between nodes: ``t`` is the gradient), ``"held"`` (a micro-step kept for the next
        exchange: nothing reduced, and torch's HSDP calls no hook there either)."""
        if self.resume_unchecked:
            self.resume_unchecked = False
            warn_resume_without_state(self)
        if self.mesh.nodes == 1 or self.config.sync_every > 1:
            # one node: nothing between nodes (torch's HSDP all-reduces over one rank, a no-op); fewer syncs
            # (fsdp/outer.py): the nodes meet every sync_every steps, so the node's average is the gradient
            return "local"
        if self.param_group is not None and not self.param_group.all_reduce_grads:
            # a micro-step under set_requires_all_reduce(False): nothing leaves the node; the shard waits here and
            # the .grad gets zeros, so that the last micro-step's exchange carries the whole sum once
            self.partial = t.clone() if self.partial is None else self.partial.add_(t)
            t.zero_()
            self.counters.held += 1
            return "held"
        if self.partial is not None:
            t.add_(self.partial)
            self.partial = None
        return "exchange"

    def _post(self, t: torch.Tensor) -> Callable[[], None]:
        """Post the recipe's exchange of ``t`` (in place); the returned callable waits for it and counts it.  With a
        ``GradScaler`` registered (:meth:`register_grad_scaler`) the residual is in units of this step's loss scale
        while the exchange runs (``t`` is the scaled gradient) and unscaled between steps; an overflowing step's
        non-finite entries are reset to 0."""
        scale = loss_scale(self.scaler)
        state = self.feedback if self.scaler is not None else None
        if state is not None:
            state.rescale(scale)
        t0 = time.perf_counter()
        finish = self.exchange(t)
        posted = time.perf_counter() - t0

        def done() -> None:
            t1 = time.perf_counter()
            sent = finish()
            if self.param_group is not None and self.param_group.gradient_divide_factor is not None:
                # set_gradient_divide_factor(F): torch's HSDP reduce-scatters with 1/F and then *sums* over the
                # replicas (the world's sum over F); the recipe averaged over the nodes, so times the nodes (exact
                # for a power of two)
                t.mul_(self.mesh.nodes)
            if state is not None:
                state.clean()
                state.rescale(1.0 / scale)
            self._count(t, sent, posted + time.perf_counter() - t1)
            self.exchanges += 1  # this module's exchanges: its optimizer steps (an error names the step it failed in)
            self.watchdog.step = max(self.watchdog.step, self.exchanges)

        return done

    def register_grad_scaler(self, scaler: Any) -> None:
        """The ``torch.amp.GradScaler`` scaling this module's gradients (``None``: none)."""
        self.scaler = scaler

    def set_user_hook(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        """The user's ``set_all_reduce_hook``: called after this module's reduction between nodes, on the reduced
        shard, in place (torch HSDP's order); ``None`` removes it.  gradientflow's reduction is never replaced."""
        self.user_hook = hook

    def loaded(self, model: bool) -> None:
        """A ``load_state_dict`` of the module (``model``) or of its recipe state (:mod:`.checkpoint`).  A model
        loaded without its recipe state (before it, as DCP's one load then ``set_state_dict`` do, or after it and
        before the next exchange) is said at the next exchange: :func:`.checkpoint.warn_resume_without_state`."""
        if model:
            self.resume_unchecked = not self.state_loaded and self.feedback is not None
            self.state_loaded = False
        else:
            self.state_loaded = True
            self.resume_unchecked = False

    def _count(self, t: torch.Tensor, sent: Sent, seconds: float) -> None:
        dense = t.numel() * 4
        nodes = self.mesh.nodes
        self.counters.record(Counts(1, sent.payload, dense, sent.sent, ring_allreduce_bytes(dense, nodes), seconds))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("module %d: %s exchange, %d bytes sent between nodes", self.index, self.recipe, sent.sent)

    def state_bytes(self) -> int:
        """Bytes this module's recipe holds between steps on this rank (residual, ``q``, a held shard)."""
        held = [self.partial] if self.partial is not None else []
        q = self.feedback
        kept = [q.err, *([q.sq] if q.sq is not None else [])] if q is not None else []
        return sum(t.numel() * t.element_size() for t in [*kept, *held])

    def describe(self) -> dict[str, Any]:
        return {"compression": self.recipe, "auto": self.auto_reason, "numel": self.numel}

    def checked_mixing(self) -> bool:
        """True once (the first hook call); :func:`gradientflow.fsdp.api.check_tree` then runs."""
        first = not self.mixing_checked
        self.mixing_checked = True
        return first


# ---- each mechanism's FSDP form: ``build(comm, kept) -> (exchange, state)``: ``kept`` the state the module held ----


@mechanisms.form("dense", "fsdp")
def _dense_form(comm: ModuleComm, kept: ShardState | None) -> tuple[ShardExchange, ShardState | None]:
    group, wire, watchdog = comm.mesh.replicate, comm.config.wire_dtype, comm.watchdog
    return (lambda t: post_dense(t, group, wire, watchdog)), None


@mechanisms.form("auto", "fsdp")
def _auto_form(comm: ModuleComm, kept: ShardState | None) -> tuple[ShardExchange, ShardState | None]:
    """Torch HSDP's exact reduction until the first optimizer step; the state its likely pick needs already (an
    Adam-type's ``q`` beyond two nodes), so that its checkpoint's keys are the same before and after its switch."""
    exchange, _ = _dense_form(comm, None)
    return exchange, _quantized_state(comm, kept, comm.mesh.nodes > 2)


def _quantized_state(comm: ModuleComm, kept: ShardState | None, precondition: bool) -> QuantizedShard:
    if isinstance(kept, QuantizedShard):
        if precondition:
            kept.ensure_sq()
        return kept
    return QuantizedShard(comm.numel, comm.device, precondition, comm.mesh.replicate, comm.watchdog)


@mechanisms.form("quantized", "fsdp")
def _quantized_form(comm: ModuleComm, kept: ShardState | None) -> tuple[ShardExchange, ShardState | None]:
    config = comm.config
    state = _quantized_state(comm, kept, config.quantizer().precondition)
    return (lambda t: state.post(t, config.quantizer())), state


@mechanisms.form("topk", "fsdp")
@mechanisms.form("topk-quantized", "fsdp")
def _topk_form(comm: ModuleComm, kept: ShardState | None) -> tuple[ShardExchange, ShardState | None]:
    if isinstance(kept, TopkShard) or comm.param_group is None:
        state = kept
    else:
        resolved = comm.config.resolved(comm.numel, comm.device)  # chunk_size="auto": ~2000 chunks a shard
        state = TopkShard(comm.numel, comm.device, resolved, shard_layout(comm.param_group))
    group, watchdog = comm.mesh.replicate, comm.watchdog

    def exchange(t: torch.Tensor) -> Finish:
        assert isinstance(state, TopkShard)  # a module torch calls the hook for holds parameters
        return state.post(t, group, watchdog)

    return exchange, state
