"""gradientflow's ``fully_shard`` in place of torch's wherever a 2-D mesh reaches it (the FSDP runner's ranks only).

torch's FSDP2 tests call ``fully_shard`` with a 1-D mesh (FSDP), no mesh (the world, 1-D), or a 2-D mesh (HSDP).
gradientflow's ``fully_shard`` is the HSDP door: it refuses a 1-D mesh (nothing between replicas to compress).  So
the substitute hands a call with a 2-D mesh to gradientflow's, with ``compression`` (``"none"``: torch's HSDP
reduction, which torch's parity assertions can check), and every other call to torch's own.  It replaces the name
everywhere a test reaches it (``torch.distributed.fsdp``, the old ``torch.distributed._composable.fsdp`` path, and
``common_fsdp``'s own import, which its ``MLPStack.parallelize`` calls); the other names gradientflow.fsdp re-exports
(``FSDPModule``, ``MixedPrecisionPolicy``, ...) are torch's own objects, already the same.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from .cuda_on_cpu import patch

PLACES = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.testing._internal.common_fsdp",
)
"""The modules a test reaches ``fully_shard`` through (each replaced where it exists)."""


def routes_to_gradientflow(mesh: object) -> bool:
    """A 2-D mesh is HSDP: gradientflow's; anything else (none, 1-D, 3-D) is torch's."""
    return isinstance(mesh, DeviceMesh) and mesh.ndim == 2


def substitute(torch_fully_shard: Callable[..., Any], gf_fully_shard: Callable[..., Any], **recipe: Any) -> Any:
    """A ``fully_shard`` that calls ``gf_fully_shard(..., **recipe)`` for a 2-D mesh, ``torch_fully_shard`` else."""

    @functools.wraps(torch_fully_shard)
    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        if routes_to_gradientflow(kwargs.get("mesh")):
            return gf_fully_shard(module, *args, **kwargs, **recipe)
        return torch_fully_shard(module, *args, **kwargs)

    fully_shard.__name__ = "fully_shard"  # compiled_fsdp_test patches the test's global of this name
    return fully_shard


def install(compression: str) -> None:
    """Replace torch's ``fully_shard`` in :data:`PLACES` by :func:`substitute` (gradientflow's with ``compression``)."""
    import torch.distributed.fsdp as torch_fsdp

    import gradientflow.fsdp as gf_fsdp  # imported first: it binds torch's own fully_shard for its shard mesh

    replacement = substitute(torch_fsdp.fully_shard, gf_fsdp.fully_shard, compression=compression)
    for name in PLACES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an older or newer torch without that path
            continue
        if hasattr(module, "fully_shard"):
            patch(module, "fully_shard", replacement)
