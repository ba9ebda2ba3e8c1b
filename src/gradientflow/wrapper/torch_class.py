"""torch's ``DistributedDataParallel`` as the wrapper's base class: ``isinstance`` holds, nothing else leaks.

Code that unwraps a model by ``model.module if isinstance(model, DistributedDataParallel) else model``
(user scripts, Lightning's strategies, accelerate's ``unwrap_model``, ``torch.distributed.checkpoint``'s
FQN mapping, saving helpers) must see gradientflow's wrapper as a DDP, or it saves ``module.``-prefixed
state dicts and wraps again.  So :class:`gradientflow.DistributedDataParallel` derives from
:class:`TorchDDPClass`, a subclass of torch's class whose ``__init__`` never runs: the instance holds
none of torch's state (no C++ reducer, no logger, no state-dict hooks: torch registers none in its
``__init__`` on 2.13 either, so ``state_dict()`` keys are torch DDP's ``module.``-prefixed ones).

Every method or class attribute torch's class defines is shadowed: by gradientflow's own version
(``forward``, ``no_sync``, ``join``, ``_get_ddp_logging_data``, ``__getstate__``, ... in ``ddp.py``,
``torch_api.py``, ``checkpoint.py``), or, for torch's internals that read its C++ reducer or its
``__init__``'s attributes (``_pre_forward``, ``_post_forward``, ``_sync_buffers``, ``scatter``,
``_check_reducer_finalized``, ...), by :class:`_Absent`: the attribute is missing, as it was before
the wrapper derived from torch's class, so ``hasattr`` answers False and a call is an
``AttributeError`` naming it instead of a crash deep inside torch.  Kept from torch: ``train``
(``Module.train``, returning ``self``), and ``_active_ddp_module`` / ``_get_active_ddp_module``
(dynamo's hook for its DDPOptimizer: set only inside torch DDP's own forward, so it stays ``None``
for a gradientflow model and ``torch.compile`` does not split graphs at torch's bucket boundaries).
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

# torch's own definitions that hold for gradientflow's wrapper as they are.
# ``_abc_impl``: the ABC machinery's own (torch's class is an ABC through ``Joinable``).
KEPT = frozenset({"train", "_active_ddp_module", "_get_active_ddp_module", "_abc_impl"})


class _Absent:
    """A class attribute that is not there: reading it raises ``AttributeError`` (so ``hasattr`` is False
    and ``nn.Module.__getattr__`` answers for it, as for any missing attribute)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> NoReturn:
        raise AttributeError(
            f"'{getattr(owner, '__name__', 'DistributedDataParallel')}' object has no attribute '{self.name}' "
            "(an internal of torch's DistributedDataParallel; gradientflow's engine has no counterpart)"
        )


class TorchDDPClass(nn.parallel.DistributedDataParallel):
    """torch's class for ``isinstance``, with torch's internals absent (see the module's docstring).

    Never call ``super().__init__()`` from a subclass: torch's ``__init__`` would build torch's
    reducer.  ``nn.Module.__init__(self)`` is what the wrapper calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - a guard, never meant to run
        raise TypeError("TorchDDPClass is a base class of gradientflow.DistributedDataParallel only")


def torch_internals() -> list[str]:
    """The names torch's class defines that gradientflow's wrapper must not inherit as they are."""
    return [
        name
        for name in vars(nn.parallel.DistributedDataParallel)
        if not (name.startswith("__") and name.endswith("__")) and name not in KEPT
    ]


for _name in torch_internals():
    setattr(TorchDDPClass, _name, _Absent(_name))
