"""A gradientflow model wrapped in gradientflow again: the inner model's engine synchronises both.

torch DDP allows a DDP inside a DDP (torch's ``test_ddp_static_graph_nested_types``): two reducers hook
the same parameters and each averages the same local gradients.  For a dense average the two agree, so
torch trains as with one DDP.  gradientflow binds ``.grad`` to one engine's pool, so two engines on the
same parameters cannot both run; the outer wrapper shares the inner one's engine instead (one average,
the gradient torch's two give): its forward arms that engine too, and a backward synchronises when either
wrapper asks (outside ``no_sync()``), as with torch's two reducers.

Refused (:class:`DoubleWrapError`, saying why) where the two would not give the same gradient, or cannot
share: a compression recipe, ``comm_dtype`` other than fp32 or CSC (``density``) on either (torch's two
reducers would each synchronise the local gradient their own way: a dense average and a compressed one
differ, and which one ``.grad`` keeps is the order of two final callbacks), a communication hook on
either (it decides what goes on the wire), sparse gradients (synchronised apart from the engine), and
torch's DDP inside gradientflow's or around it (two different engines writing one ``.grad``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..config import GradientFlowConfig
from .torch_api import DoubleWrapError

if TYPE_CHECKING:
    from ..engine.reducer import Reducer


def _compresses(config: GradientFlowConfig) -> list[str]:
    out = []
    if config.compression not in ("none",):
        out.append(f"compression={config.compression!r}")
    if config.comm_dtype != "fp32":
        out.append(f"comm_dtype={config.comm_dtype!r}")
    if config.density is not None:
        out.append(f"density={config.density}")
    return out


def check_wrap(module: nn.Module, config: GradientFlowConfig) -> None:
    """Refuse the double wraps whose result would differ from one DDP's (see the module's docstring)."""
    if isinstance(module, Nesting):
        inner_config: GradientFlowConfig = module.__dict__["config"]
        reasons = [f"the inner model's {r}" for r in _compresses(inner_config)]
        reasons += [f"the outer's {r}" for r in _compresses(config)]
        if module.__dict__["_gf_torch"].comm_hook is not None:
            reasons.append("the inner model's communication hook")
        if module.__dict__.get("_gf_ignored"):
            reasons.append("parameters the inner model ignores (torch's outer DDP would synchronise them)")
        if module.__dict__.get("_gf_sparse_params"):
            reasons.append("sparse gradients (synchronised apart from the engine)")
        if reasons:
            raise DoubleWrapError(
                f"the module is already a gradientflow.DistributedDataParallel. Nesting two is allowed only where "
                f"both average densely (two DDPs synchronise the same local gradients; with {', '.join(reasons)} "
                "the two results differ). Wrap the inner model (model.module) once with the options you want."
            )
        module.__dict__["_gf_wrapped"] = True  # its engine is shared from now on
        return
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise DoubleWrapError(
            f"the module is already a {type(module).__module__}.{type(module).__name__}; torch's reducer and "
            "gradientflow's engine would both write the same .grad. Wrap the inner model (model.module) once."
        )


def ignored(module: nn.Module) -> set[str]:
    """The names torch DDP's ``_ddp_params_and_buffers_to_ignore`` lists (none for a nested gradientflow model:
    reading it from one is the refusal of torch DDP wrapping it, ``TorchDDPAPI._ddp_params_and_buffers_to_ignore``)."""
    if isinstance(module, Nesting):
        return set()
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


class Nesting:
    """A mixin of the wrapper: ``_gf_engine`` is the wrapper's own engine, or, for a wrapper around a
    gradientflow model, that model's (looked up at each use: ``.to()`` or a pickle round trip rebuilds it)."""

    @property
    def _gf_engine(self) -> Reducer:
        engine = self.__dict__.get("_gf_engine")
        if engine is None:
            inner = self.__dict__.get("_modules", {}).get("module")
            if isinstance(inner, Nesting):
                return inner._gf_engine
            raise AttributeError("_gf_engine")  # during construction; nn.Module.__getattr__ answers
        return engine

    @_gf_engine.setter
    def _gf_engine(self, engine: Reducer) -> None:
        self.__dict__["_gf_engine"] = engine

    def _gf_shares_engine(self) -> bool:
        """True for a wrapper around a gradientflow model: it builds no engine of its own."""
        return isinstance(self.__dict__.get("_modules", {}).get("module"), Nesting)

    def _gf_refuse_if_nested(self, what: str) -> None:
        if self._gf_shares_engine() or self.__dict__.get("_gf_wrapped"):
            raise RuntimeError(
                f"gradientflow: {what} on a gradientflow model nested in another (they share one engine); "
                "call it before nesting, on a model wrapped once."
            )
