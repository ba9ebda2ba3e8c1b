"""PyTorch Lightning: ``Trainer(strategy="gradientflow")``, Lightning's ``DDPStrategy`` over gradientflow.

``GradientFlowStrategy`` is a ``DDPStrategy`` whose model is wrapped by
:class:`gradientflow.DistributedDataParallel`; everything else is Lightning's own (launchers,
process group, samplers, ``no_sync`` during gradient accumulation, ``find_unused_parameters`` and
``static_graph`` passed through, checkpoints).  gradientflow's options are keyword arguments::

    Trainer(strategy="gradientflow", accelerator="cpu", devices=2)            # the defaults
    Trainer(strategy=GradientFlowStrategy(comm_dtype="fp16", density=0.1), ...)

What differs from ``DDPStrategy``, and why:

- Checkpoints carry every rank's :meth:`~gradientflow.DistributedDataParallel.comm_state_dict`
  (CSC residuals, the density ramp's step) under ``checkpoint["gradientflow"]``: gathered to rank 0
  in ``save_checkpoint`` (the file is rank 0's), restored on every rank when the model is wrapped
  or, if it already is, when the checkpoint is loaded.  A sparse run resumed from
  ``fit(ckpt_path=...)`` is then exactly the uninterrupted run.
- Lightning tests ``isinstance(model, torch.nn.parallel.DistributedDataParallel)`` to unwrap the
  model at teardown, to prepare a manual-optimization backward and in its forward redirection;
  those paths are redone here for either wrapper (written before gradientflow's wrapper became an
  instance of torch's class, issue 38; they do what Lightning's do).
- ``ddp_comm_hook`` is registered on every device (Lightning registers it only on CUDA, where it
  would stop at an ``AssertionError`` for a non-torch wrapper).
- gradientflow's warnings raised inside Lightning name the user's line, not Lightning's.

Built for the standalone ``pytorch_lightning`` package and for the unified ``lightning`` package
(``lightning.pytorch``): :func:`strategy_class` makes the subclass for either.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from contextlib import nullcontext
from functools import cache
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..config import GradientFlowConfig
from ..diagnostics.extras import MissingExtra
from ..wrapper.ddp import DistributedDataParallel
from ._warnings import attributed_to_user

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "gradientflow"
CLIENT_PACKAGES = ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities", "torchmetrics")

# gradientflow's own keyword-only options (timeout excluded: DDPStrategy has its own, for the process group).
GF_OPTIONS = tuple(
    name
    for name, p in inspect.signature(DistributedDataParallel.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
# Names under which the strategy is registered, and Lightning's start method for each.
REGISTERED = {"gradientflow": "popen", "gradientflow_spawn": "spawn", "gradientflow_fork": "fork"}


def _is_wrapped(model: Any) -> bool:
    return isinstance(model, (TorchDDP, DistributedDataParallel))


@cache
def strategy_class(namespace: str = "pytorch_lightning") -> Any:
    """The strategy for Lightning under ``namespace``: ``"pytorch_lightning"`` or ``"lightning.pytorch"``."""
    # Chosen at run time (either Lightning package): typed as Any, which the checker lets a class extend.
    ddp_module: Any = importlib.import_module(f"{namespace}.strategies.ddp")
    overrides = importlib.import_module(f"{namespace}.overrides.distributed")
    base: Any = ddp_module.DDPStrategy
    redirection_base: Any = ddp_module._DDPForwardRedirection

    class Redirection(redirection_base):
        """Lightning's manual-optimization switch of ``require_backward_grad_sync``, for either wrapper."""

        def on_after_inner_forward(self, wrapper_module: Any, original_module: Any) -> None:
            if _is_wrapped(wrapper_module) and not original_module.automatic_optimization:
                wrapper_module.require_backward_grad_sync = False

        def on_after_outer_forward(self, wrapper_module: Any, original_module: Any) -> None:
            if _is_wrapped(wrapper_module) and not original_module.automatic_optimization:
                wrapper_module.require_backward_grad_sync = True

    class GradientFlowStrategy(base):
        """Lightning's ``DDPStrategy`` wrapping with :class:`gradientflow.DistributedDataParallel`.

        Takes ``DDPStrategy``'s arguments, torch DDP's keyword arguments (``find_unused_parameters``,
        ``static_graph``, ...) and gradientflow's options (``comm_dtype``, ``density``, ...; its
        ``timeout`` is ``gf_timeout`` here, ``timeout`` being the process group's, as in ``DDPStrategy``).
        """

        strategy_name = "gradientflow"
        model: Any  # Lightning's attribute: the wrapped model once configure_ddp ran

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            gf = {k: kwargs.pop(k) for k in list(kwargs) if k in GF_OPTIONS and k != "timeout"}
            if "gf_timeout" in kwargs:  # gradientflow's per-wait timeout; `timeout` is the process group's
                gf["timeout"] = kwargs.pop("gf_timeout")
            known = set(inspect.signature(TorchDDP.__init__).parameters) | set(inspect.signature(base).parameters)
            unknown = sorted(k for k in kwargs if k not in known)
            if unknown:
                raise ValueError(
                    f"GradientFlowStrategy: unknown option(s) {unknown}. It takes DDPStrategy's arguments, torch "
                    f"DDP's keyword arguments and gradientflow's options {sorted(set(GF_OPTIONS) - {'timeout'})} "
                    "(gf_timeout for gradientflow's own timeout)."
                )
            # Validated here, on every rank, before any process is launched or group created.
            GradientFlowConfig(**{k: v for k, v in gf.items() if v is not None or k != "fusion_threshold_mb"})
            super().__init__(*args, **kwargs)
            self._gf_options = gf
            self._forward_redirection = Redirection()
            self._gf_pending_state: dict[str, Any] | None = None  # loaded before the model was wrapped
            self._gf_final: dict[str, Any] | None = None  # this rank's state when the last fit ended

        @property
        def gf_options(self) -> dict[str, Any]:
            """gradientflow's options this strategy wraps the model with."""
            return dict(self._gf_options)

        # ---- wrapping --------------------------------------------------------------------
        def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
            device_ids = self.determine_ddp_device_ids()
            logger.debug(
                "gradientflow: wrapping with device ids %s, %s, %s", device_ids, self._ddp_kwargs, self._gf_options
            )
            # Lightning wraps on a side stream on CUDA (https://pytorch.org/docs/stable/notes/cuda.html#id5).
            ctx = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
            with ctx, attributed_to_user(CLIENT_PACKAGES):
                wrapped = DistributedDataParallel(model, device_ids=device_ids, **self._ddp_kwargs, **self._gf_options)
            if self._gf_pending_state is not None:
                self._gf_load(wrapped, self._gf_pending_state)
                self._gf_pending_state = None
            return wrapped

        def setup(self, trainer: Any) -> None:
            super().setup(trainer)
            if isinstance(self.model, DistributedDataParallel):
                # The first-step optimizer check, run now so that its warnings name the user's line.
                with attributed_to_user(CLIENT_PACKAGES):
                    for optimizer in self.optimizers:
                        self.model.check_optimizer(optimizer)

        def _register_ddp_hooks(self) -> None:
            if not isinstance(self.model, DistributedDataParallel):
                super()._register_ddp_hooks()
                return
            if self._ddp_comm_hook is not None or self._ddp_comm_wrapper is not None:
                overrides._register_ddp_comm_hook(
                    model=self.model,
                    ddp_comm_state=self._ddp_comm_state,
                    ddp_comm_hook=self._ddp_comm_hook,
                    ddp_comm_wrapper=self._ddp_comm_wrapper,
                )

        # ---- backward ----------------------------------------------------------------------
        def pre_backward(self, closure_loss: torch.Tensor) -> None:
            """Manual optimization runs backward inside the forward: arm the wrapper on the loss, as
            Lightning's ``prepare_for_backward`` does for torch's reducer."""
            model = self.model
            if not isinstance(model, DistributedDataParallel):
                super().pre_backward(closure_loss)
                return
            if not self.lightning_module.automatic_optimization and torch.is_grad_enabled():
                model._gf_after_forward(closure_loss, model.require_backward_grad_sync)

        def post_backward(self, closure_loss: torch.Tensor) -> None:
            if not isinstance(self.model, DistributedDataParallel):
                super().post_backward(closure_loss)
            # gradientflow has no delayed first static-graph step to flush.

        # ---- checkpoints ---------------------------------------------------------------------
        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            """Every rank calls this; rank 0 writes the file, with all ranks' communication states in it.

            During a fit the states are the wrapper's; after it (``trainer.save_checkpoint`` once
            ``fit`` returned, as with stock DDP) the ones the fit ended with.
            """
            model = self.model
            own = _to_cpu(model.comm_state_dict()) if isinstance(model, DistributedDataParallel) else self._gf_final
            if own is not None:  # None: no fit has wrapped the model yet (nothing to carry)
                states: list[Any] | None = [None] * self.world_size if self.is_global_zero else None
                dist.gather_object(own, states, dst=0)
                if self.is_global_zero:
                    checkpoint = {**checkpoint, CHECKPOINT_KEY: {"comm_states": states}}
            super().save_checkpoint(checkpoint, filepath, storage_options)

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            saved = checkpoint.get(CHECKPOINT_KEY)
            if saved is not None:
                if isinstance(self.model, DistributedDataParallel):
                    self._gf_load(self.model, saved)
                else:  # Lightning restores the module before wrapping it: load once wrapped
                    self._gf_pending_state = saved
            return checkpoint

        def _gf_load(self, model: DistributedDataParallel, saved: dict[str, Any]) -> None:
            states = saved["comm_states"]
            if len(states) != self.world_size:
                raise ValueError(
                    f"gradientflow: the checkpoint holds the communication state of {len(states)} ranks, this run "
                    f"has {self.world_size}; residuals are per rank. Resume with {len(states)} processes, or drop "
                    f"checkpoint[{CHECKPOINT_KEY!r}] to start the communication state afresh."
                )
            model.load_comm_state_dict(states[self.global_rank])

        # ---- teardown -----------------------------------------------------------------------
        def teardown(self) -> None:
            """As ``DDPStrategy``: the wrapper goes, the LightningModule stays, free of its hooks."""
            if isinstance(self.model, DistributedDataParallel):
                # trainer.save_checkpoint() after fit() must still carry the state the fit ended with
                self._gf_final = _to_cpu(self.model.comm_state_dict())
                self.model._gf_engine.remove_hooks()
                self.model = self.lightning_module
            super().teardown()

        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None:
            for name, start_method in REGISTERED.items():
                if name not in strategy_registry:
                    strategy_registry.register(
                        name,
                        cls,
                        description=f"gradientflow's DistributedDataParallel with `start_method` '{start_method}'",
                        start_method=start_method,
                    )

    # Picklable under their module-level names (Lightning's spawn launcher pickles the strategy).
    for cls, name in ((GradientFlowStrategy, "GradientFlowStrategy"), (Redirection, "GradientFlowForwardRedirection")):
        cls.__module__, cls.__qualname__, cls.__name__ = __name__, name, name
    GradientFlowStrategy.forward_redirection_class = Redirection
    return GradientFlowStrategy


def _to_cpu(obj: Any) -> Any:
    """Tensors to CPU (gathered through pickling, and written by rank 0 whatever its device)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _default_namespace() -> str:
    try:
        importlib.import_module("pytorch_lightning.strategies")
        return "pytorch_lightning"
    except ImportError:
        pass
    try:
        importlib.import_module("lightning.pytorch.strategies")
        return "lightning.pytorch"
    except ImportError:
        raise MissingExtra("pytorch_lightning", "gradientflow.integrations.lightning") from None


NAMESPACE = _default_namespace()
GradientFlowStrategy: Any = strategy_class(NAMESPACE)
"""The strategy for the installed Lightning (the standalone ``pytorch_lightning`` if both are)."""
GradientFlowForwardRedirection = GradientFlowStrategy.forward_redirection_class
GradientFlowStrategy.register_strategies(importlib.import_module(f"{NAMESPACE}.strategies").StrategyRegistry)
