"""Lightning's FSDP2 strategy (``ModelParallelStrategy``) for HSDP with :func:`gradientflow.fsdp.fully_shard`.

Lightning's FSDP2 path is ``ModelParallelStrategy``: it builds a 2-D mesh ``("data_parallel", "tensor_parallel")``
and the user shards the model in ``LightningModule.configure_model`` with ``self.device_mesh``.  For HSDP with
gradientflow three things of it have to change, and :class:`GradientFlowHSDPStrategy` (a subclass) changes them:

- **The data.**  Lightning's sampler splits the data over the mesh's ``"data_parallel"`` dimension
  (``distributed_sampler_kwargs``, pytorch_lightning 2.6.6 strategies/model_parallel.py:118-122).  With the
  strategy's default sizes, ``(num_nodes, devices)``, the ranks of a node then read the same batches, as tensor-
  parallel ranks must; under HSDP every rank reads its own.  Here the sampler's replicas are all the ranks.
- **The mesh.**  ``self.device_mesh`` in ``configure_model`` is the HSDP mesh ``(num_nodes, devices)`` named
  ``("replicate", "shard")`` (:func:`gradientflow.fsdp.hsdp_mesh`): what gradientflow's ``fully_shard`` takes (and
  torch's, for its own HSDP).
- **Checkpoints.**  Lightning saves a DCP folder of the model's and optimizer's state dicts, and its other entries
  (the LightningModule's ``on_save_checkpoint`` ones, callbacks' states) in rank 0's ``meta.pt``.  gradientflow's
  recipe state (each rank's error-feedback residuals) is in neither: not in the model's state dict (docs/fsdp.md,
  Checkpoints), and rank 0's file cannot hold every rank's.  So ``save_checkpoint`` saves
  :func:`gradientflow.fsdp.comm_state` as a DCP checkpoint of its own inside Lightning's folder,
  ``<checkpoint>/gradientflow``, and ``load_checkpoint`` (``fit(ckpt_path=...)``) loads it after Lightning loaded
  the model and optimizer: the resumed run is the uninterrupted one.  A Lightning checkpoint without that folder
  loads as Lightning loads it, and gradientflow's warning says at the next exchange that the residuals restart.

Everything else is Lightning's ``ModelParallelStrategy`` (launch, process group, precision, its DCP format), built
for the standalone ``pytorch_lightning`` package or the unified ``lightning`` (:func:`hsdp_strategy_class`)::

    class Model(pl.LightningModule):
        def configure_model(self):
            for block in self.model.layers:
                fully_shard(block, mesh=self.device_mesh, compression="3bit")
            fully_shard(self.model, mesh=self.device_mesh, compression="3bit")

    trainer = pl.Trainer(strategy=GradientFlowHSDPStrategy(), num_nodes=2, devices=8)
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from ..fsdp import check_checkpoint, comm_state, hsdp_mesh
from ..fsdp.checkpoint import KEY
from ..fsdp.counters import comms
from .lightning import NAMESPACE

logger = logging.getLogger(__name__)

STATE_DIR = "gradientflow"
"""The recipe state's DCP checkpoint, inside Lightning's checkpoint folder."""


@cache
def hsdp_strategy_class(namespace: str = "pytorch_lightning") -> Any:
    """The HSDP strategy for Lightning under ``namespace``: ``"pytorch_lightning"`` or ``"lightning.pytorch"``."""
    # Chosen at run time (either Lightning package): typed as Any, which the checker lets a class extend.
    base: Any = importlib.import_module(f"{namespace}.strategies.model_parallel").ModelParallelStrategy

    class GradientFlowHSDPStrategy(base):
        """Lightning's ``ModelParallelStrategy`` for HSDP: every rank its own data, ``self.device_mesh`` the HSDP
        mesh ``(num_nodes, devices)``, gradientflow's recipe state in the checkpoint.

        ``process_group_backend``, ``timeout``: ``ModelParallelStrategy``'s (``timeout=None``: its default).
        Its mesh sizes are not options (the Trainer's ``num_nodes`` and ``devices`` give the mesh), and its
        checkpoints are its DCP folders (``save_distributed_checkpoint=True``, its default).
        """

        strategy_name = "gradientflow_hsdp"

        def __init__(
            self, *, process_group_backend: str | None = None, timeout: timedelta | None = None, **other: Any
        ) -> None:
            if other:
                raise ValueError(
                    f"GradientFlowHSDPStrategy: {sorted(other)} are not its options. The HSDP mesh is (num_nodes, "
                    "devices) from the Trainer, every rank reading its own data, and checkpoints are DCP folders (each "
                    "rank's recipe state is saved in them; one file would hold rank 0's alone): drop them. For "
                    "tensor parallelism use Lightning's ModelParallelStrategy itself."
                )
            kwargs: dict[str, Any] = {"process_group_backend": process_group_backend}
            if timeout is not None:
                kwargs["timeout"] = timeout
            super().__init__(save_distributed_checkpoint=True, **kwargs)

        def setup_environment(self) -> None:
            # Lightning's own set-up (process group, its mesh) on the sizes whose data-parallel dimension is every
            # rank; then the HSDP mesh, the one configure_model reads
            self._data_parallel_size, self._tensor_parallel_size = self.num_nodes * self.num_processes, 1
            super().setup_environment()
            self._device_mesh = hsdp_mesh(self.num_nodes, self.num_processes, device_type=self.root_device.type)
            self.lightning_module._device_mesh = self._device_mesh

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": self.world_size, "rank": self.global_rank}  # HSDP: every rank its own data

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            """Lightning's DCP folder, then the recipe state in ``<folder>/gradientflow`` (every rank its own)."""
            super().save_checkpoint(checkpoint, filepath, storage_options)
            if any(True for _ in comms(self.model)):  # the same model on every rank: all save, or none
                path = Path(self.broadcast(filepath)) / STATE_DIR
                dcp.save({KEY: comm_state(self.model)}, checkpoint_id=path)
                logger.debug("gradientflow: recipe state saved in %s", path)

        def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
            """Lightning's load (model, optimizer, metadata), then the recipe state where the checkpoint has it."""
            checkpoint: dict[str, Any] = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            path = Path(self.broadcast(checkpoint_path)) / STATE_DIR
            if path.is_dir() and any(True for _ in comms(self.model)):
                check_checkpoint(path, self.model)  # another mesh: said in words, on every rank
                dcp.load({KEY: comm_state(self.model)}, checkpoint_id=path)
            return checkpoint

    cls = GradientFlowHSDPStrategy
    cls.__module__, cls.__qualname__ = __name__, cls.__name__  # its module-level name
    return cls


GradientFlowHSDPStrategy: Any = hsdp_strategy_class(NAMESPACE)
"""The HSDP strategy for the installed Lightning (the standalone ``pytorch_lightning`` if both are)."""
