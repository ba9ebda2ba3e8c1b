"""accelerate's FSDP2 path with :func:`gradientflow.fsdp.fully_shard` where it calls torch's ``fully_shard``.

accelerate shards an FSDP2 model in ``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` (its auto-wrap policy,
the embeddings and the tail carved into their own units, ``ignored_params``, ``cpu_ram_efficient_loading``, the
root), which imports ``fully_shard`` from ``torch.distributed.fsdp`` inside the function, at each call.  No
argument of accelerate reaches that name, so the one way to keep all of accelerate's logic and change only the
function it calls is to have that import find gradientflow's while accelerate prepares the model:
:func:`fsdp2_with_gradientflow` does that, for the calls on the accelerator's own FSDP mesh only (any other mesh,
or a thread sharding something else meanwhile, gets torch's function unchanged), and puts torch's function back
on exit.  :class:`gradientflow.integrations.accelerate.GradientFlowAccelerator` opens it around ``prepare``; a
``transformers.Trainer`` (whose ``Accelerator`` the Trainer builds itself) is wrapped around ``train()``.

The mesh: accelerate's ``ParallelismConfig(dp_replicate_size=nodes, dp_shard_size=ranks_per_node)`` builds
``("dp_replicate", "dp_shard")`` and hands ``fully_shard`` the 2-D ``("dp_replicate", "dp_shard_cp")`` view of
it; gradientflow gets the same ranks as ``gradientflow.fsdp.hsdp_mesh(nodes, ranks_per_node)`` (one mesh per
accelerator, built on first use: the same row-major layout, dimension 0 between nodes, 1 inside).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed.fsdp as torch_fsdp
from torch.distributed.device_mesh import DeviceMesh

from ..fsdp import fully_shard as gf_fully_shard
from ..fsdp import hsdp_mesh
from ..fsdp.api import recipe_config

FSDP_OPTIONS = tuple(
    name
    for name, p in inspect.signature(gf_fully_shard).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in inspect.signature(torch_fsdp.fully_shard).parameters
)
"""gradientflow's recipe options of :func:`gradientflow.fsdp.fully_shard` (those torch's ``fully_shard`` lacks)."""

_LOCK = threading.Lock()  # one substitution at a time: torch's name is the process's


def check_fsdp_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` if each is a recipe option of :func:`gradientflow.fsdp.fully_shard` with a valid value, else
    ``ValueError`` naming what FSDP2 reads (the same on every rank: the same arguments)."""
    other = sorted(set(options) - set(FSDP_OPTIONS))
    if other:
        raise ValueError(
            f"gradientflow under accelerate's FSDP2: {other} are options of the DDP wrapper, which FSDP2 does not "
            f"use; drop them. gradientflow.fsdp.fully_shard reads {list(FSDP_OPTIONS)}."
        )
    # the rule fully_shard itself applies (its default "auto"; "none" under sync_every), before accelerate sets up
    recipe_config(**{"compression": "auto", **options})
    return dict(options)


def check_parallelism(parallelism_config: Any) -> tuple[int, int]:
    """(nodes, ranks per node) from accelerate's ``ParallelismConfig``, or ``ValueError`` saying what to pass."""
    advice = (
        "pass Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=<nodes>, "
        "dp_shard_size=<processes per node>)) with nodes >= 2"
    )
    if parallelism_config is None:
        raise ValueError(f"gradientflow under accelerate's FSDP2 needs the HSDP mesh: {advice}.")
    pc = parallelism_config
    sizes = {"tp_size": pc.tp_size, "cp_size": pc.cp_size, "sp_size": getattr(pc, "sp_size", 1)}
    other = {k: v for k, v in sizes.items() if v != 1}
    if other or pc.dp_replicate_size < 2:
        raise ValueError(
            "gradientflow compresses HSDP's reduction between nodes, the 2-D data-parallel mesh (dp_replicate, "
            f"dp_shard) alone; got dp_replicate_size={pc.dp_replicate_size}, dp_shard_size={pc.dp_shard_size}"
            + (f", {other}" if other else "")
            + f": {advice} (one node, or tensor / context parallelism: use accelerate's FSDP2 as it is)."
        )
    return int(pc.dp_replicate_size), int(pc.dp_shard_size)


class _Substitute:
    """torch's ``fully_shard`` for accelerate's calls: gradientflow's on the accelerator's FSDP mesh."""

    def __init__(self, accelerator: Any, options: dict[str, Any], torch_fully_shard: Any) -> None:
        self.accelerator = accelerator
        self.options = options
        self.torch_fully_shard = torch_fully_shard
        self.mesh: DeviceMesh | None = None

    def ours(self, mesh: object) -> bool:
        """Whether ``mesh`` is the view of the accelerator's mesh accelerate shards on."""
        whole = self.accelerator.torch_device_mesh
        if not isinstance(mesh, DeviceMesh) or whole is None:
            return False
        # its (dp_replicate, dp_shard_cp) view: with tp, cp and sp at 1 (check_parallelism) the whole mesh's ranks
        # in the same places (compared so, not by slicing: torch warns on slicing a flattened dimension)
        names = tuple(self.accelerator.parallelism_config.fsdp_dim_names)
        return (
            mesh.mesh_dim_names == names
            and mesh.mesh.shape == whole.mesh.shape
            and bool((mesh.mesh == whole.mesh).all())
        )

    def __call__(self, module: Any, *, mesh: Any = None, **kwargs: Any) -> Any:
        if not self.ours(mesh):
            return self.torch_fully_shard(module, mesh=mesh, **kwargs)
        if self.mesh is None:
            nodes, per_node = check_parallelism(self.accelerator.parallelism_config)
            self.mesh = hsdp_mesh(nodes, per_node, device_type=mesh.device_type)
            if not bool((self.mesh.mesh == mesh.mesh).all()):  # the same ranks by construction; said if not
                raise RuntimeError(f"gradientflow: accelerate's mesh {mesh} is not hsdp_mesh's {self.mesh}")
        return gf_fully_shard(module, mesh=self.mesh, **kwargs, **self.options)


@contextlib.contextmanager
def fsdp2_with_gradientflow(accelerator: Any, **options: Any) -> Iterator[None]:
    """While open, accelerate's FSDP2 preparation by ``accelerator`` shards with
    :func:`gradientflow.fsdp.fully_shard` and ``options`` (its recipe options: ``compression``, ``density``, the
    ``quant_*`` ..., validated here); torch's ``fully_shard`` is back on exit.  For a ``transformers.Trainer``::

        with fsdp2_with_gradientflow(trainer.accelerator, compression="3bit"):
            trainer.train()
    """
    options = check_fsdp_options(options)
    if accelerator.is_fsdp2:
        check_parallelism(accelerator.parallelism_config)
    if not _LOCK.acquire(blocking=False):
        raise RuntimeError(
            "gradientflow: fsdp2_with_gradientflow is already open in this process (one accelerator prepares at a "
            "time): close it before opening another"
        )
    try:
        original = torch_fsdp.fully_shard
        substitute = _Substitute(accelerator, options, original)
        torch_fsdp.fully_shard = substitute
        try:
            yield
        finally:
            torch_fsdp.fully_shard = original
    finally:
        _LOCK.release()
