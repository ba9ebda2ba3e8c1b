"""torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, torchft 0.2.0) as ``bench --quality`` peer recipes.

``torchft-diloco`` and ``torchft-diloco-quantized`` (``should_quantize=True``): every rank is a replica group
of one rank that trains its own copy of the model with the user's inner optimizer (the job's AdamW or SGD, as
every recipe), and every ``sync_every`` optimizer steps torchft averages the pseudo-gradients (the last
synchronised parameters minus the local ones) across the replicas and steps an outer SGD(lr=0.7,
momentum=0.9, nesterov=True) on them: DiLoCo's defaults, so ``torchft-diloco:sync_every=H`` sits beside
``gf-…:sync_every=H,outer_lr=0.7,outer_momentum=0.9,outer_compression=none`` (gradientflow's defaults average
through 3 bits instead) at equal steps and tokens.  The recipe's options: H (``torchft-diloco:sync_every=30``;
:data:`DEFAULT_SYNC_EVERY` without it), and the outer SGD's ``outer_lr`` and ``outer_momentum`` (Nesterov where
the momentum is above 0), named as gradientflow's: ``torchft-diloco:sync_every=10,outer_lr=1,outer_momentum=0``
is torchft averaging the replicas through fp32, beside gradientflow's defaults at the same H.

The set-up per recipe: rank 0 starts torchft's lighthouse (``torchft.coordination.LighthouseServer``, in
process) for all ``world`` replicas and broadcasts its address over the launch's own process group; each rank
starts a TCPStore of its own (its replica group's) and a ``torchft.Manager`` on it with torchft's
``ProcessGroupGloo``, which the Manager configures at each quorum.  Every wait is bounded by :data:`TIMEOUT`,
and :meth:`TorchftDiLoCo.close` (called by the worker also when a recipe or a rank failed) shuts the Manager down, then
the lighthouse.

torchft itself (the ``torchft`` extra) is imported only when such a recipe is built: this module, which
``bench.quality_recipes`` imports for the names and the option parser, needs torch alone.
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TORCHFT_PEERS = ("torchft-diloco", "torchft-diloco-quantized")
"""torchft 0.2.0's DiLoCo, fp32 pseudo-gradients, and with its fp8 quantisation (``should_quantize=True``)."""
DEFAULT_SYNC_EVERY = 100
"""H of ``torchft-diloco`` named without ``sync_every=`` (DiLoCo's paper: 500; this bench's runs are a few
hundred steps, so a few outer steps at least)."""
OPTIONS = ("sync_every", "outer_lr", "outer_momentum")
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
"""The outer SGD's defaults (DiLoCo's); ``outer_lr=`` and ``outer_momentum=`` change them per recipe."""
TIMEOUT = timedelta(seconds=120)
"""Every wait of torchft here (quorum, collectives, connections, commits; the lighthouse's heartbeat): as
long as the bench's own process group waits, so a rank that died stops the others instead of hanging them."""
QUANT_NEEDS = (
    "torchft-diloco-quantized needs CUDA and triton (torchft 0.2.0 quantises with triton kernels on the GPU "
    "and silently sends fp32 without them): run with --device cuda where triton is installed, or use "
    "torchft-diloco"
)


def parse_options(recipe: str, rest: str) -> dict[str, Any]:
    """``"sync_every=30,outer_lr=1"`` (the text after ``torchft-diloco:``) -> ``{"sync_every": 30, "outer_lr":
    1.0}``; ``ValueError`` saying what is allowed otherwise."""
    options: dict[str, Any] = {}
    for item in rest.split(","):
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or key not in OPTIONS:
            raise ValueError(
                f"{recipe!r}: {item!r} is not one of torchft's DiLoCo peers' options: sync_every=N, outer_lr=X, "
                "outer_momentum=X"
            )
        if key == "sync_every":
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"{recipe!r}: sync_every must be a whole number of optimizer steps >= 1, got {text!r}")
            options[key] = int(text)
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = value > 0 if key == "outer_lr" else 0 <= value < 1
        if not ok:
            bound = "> 0" if key == "outer_lr" else "in [0, 1)"
            raise ValueError(f"{recipe!r}: {key} must be a number {bound}, got {text!r}")
        options[key] = value
    return options


def check_device(recipes: list[str], device: str) -> None:
    """``ValueError`` saying what to do where the quantised recipe is named but torchft would not quantise."""
    from gradientflow.diagnostics.extras import have

    if "torchft-diloco-quantized" in {r.partition(":")[0] for r in recipes}:
        if not (device == "cuda" and have("triton")):
            raise ValueError(QUANT_NEEDS)


def check(recipes: list[str], device: str) -> None:
    """Before any rank starts: torchft is installed where a torchft recipe is named (``MissingExtra`` naming
    the extra otherwise), and the quantised recipe runs where torchft quantises (:func:`check_device`)."""
    from gradientflow.diagnostics.extras import require

    if {r.partition(":")[0] for r in recipes} & set(TORCHFT_PEERS):
        require("torchft", "bench --quality --recipes torchft-*")
        check_device(recipes, device)


def _routable_ip() -> str:
    """This rank's address as the other ranks reach it: the local end of a route to the launch's master
    (127.0.0.1 on loopback; the node's own address on an emulated cluster, where the hostname may not resolve)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(master), 1))  # UDP: no packet is sent, only the route is looked up
        return str(s.getsockname()[0])


class TorchftDiLoCo(nn.Module):
    """One rank's replica under torchft's DiLoCo; ``module`` is the model (the worker evaluates it), the forward
    is the model's.  :meth:`attach` hands it the inner optimizer, whose step then syncs every ``sync_every``."""

    def __init__(
        self,
        model: nn.Module,
        recipe: str,
        sync_every: int,
        outer_lr: float = OUTER_LR,
        outer_momentum: float = OUTER_MOMENTUM,
    ) -> None:
        super().__init__()
        self.module = model
        self.sync_every = sync_every
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        self.quantized = recipe == "torchft-diloco-quantized"
        self.world = dist.get_world_size()
        self._lighthouse: Any = None
        self._manager: Any = None
        self._diloco: Any = None
        self._store: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def attach(self, inner: torch.optim.Optimizer) -> dict[str, Any]:
        """Start the lighthouse (rank 0), this rank's Manager and DiLoCo on ``inner``; what was set."""
        try:
            return self._attach(inner)
        except BaseException:  # what was started (the lighthouse, a Manager) is shut down before the error goes on
            self.close()
            raise

    def _attach(self, inner: torch.optim.Optimizer) -> dict[str, Any]:
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        rank, ms = dist.get_rank(), int(TIMEOUT.total_seconds() * 1000)
        ip = _routable_ip()
        address: list[str | None] = [None]
        if rank == 0:
            # min_replicas = every rank: each outer step averages all of them (equal steps and tokens to DDP);
            # the quorum forms as soon as all joined (join_timeout only bounds waiting for more)
            self._lighthouse = LighthouseServer(
                bind="[::]:0", min_replicas=self.world, join_timeout_ms=100, heartbeat_timeout_ms=ms
            )
            address = [f"http://{ip}:{self._lighthouse.address().rsplit(':', 1)[1]}"]
        dist.broadcast_object_list(address, src=0)
        # the replica group's store (torchft's Manager only connects to one; other replicas' Gloo groups meet in it)
        self._store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        model = self.module

        def state_dict() -> dict[str, Any]:  # what a replica that falls behind would be sent (healing)
            return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["inner_optim"])

        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=TIMEOUT),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=self.world,
            use_async_quorum=False,  # DiLoCo requires it
            timeout=TIMEOUT,
            quorum_timeout=TIMEOUT,
            connect_timeout=TIMEOUT,
            rank=0,
            world_size=1,
            store_addr=ip,
            store_port=self._store.port,
            lighthouse_addr=str(address[0]),
            replica_id=f"replica_{rank}",  # torchft reads the global rank from the trailing digits
            hostname=ip,
            init_sync=False,  # every recipe's model is built from the same seed: nothing to send at step 0
            max_retries=0,  # a failed outer step raises (recorded as the recipe's error) instead of retrying
        )
        # torch's SGD refuses Nesterov without momentum: at 0 the outer step is plain SGD (lr 1: averaging)
        nesterov = self.outer_momentum > 0
        outer = torch.optim.SGD(model.parameters(), lr=self.outer_lr, momentum=self.outer_momentum, nesterov=nesterov)
        self._diloco = DiLoCo(
            self._manager,
            [model],
            inner,
            outer,
            sync_every=self.sync_every,
            backup_device=next(model.parameters()).device,
            should_quantize=self.quantized,
        )
        self._diloco.__enter__()  # its hooks on the inner optimizer's step; removed by close()
        return {
            "wrapper": "torchft.local_sgd.DiLoCo + torchft.Manager (one replica group per rank)",
            "sync_every": self.sync_every,
            "outer_optimizer": f"SGD(lr={self.outer_lr:g}, momentum={self.outer_momentum:g}, nesterov={nesterov})",
            "should_quantize": self.quantized,
        }

    def payload_bytes(self, step: int) -> float:
        """Bytes this rank hands to torchft's collectives at 0-based ``step`` (computed: torchft does not report
        them).  DiLoCo syncs after every ``sync_every``-th optimizer step, one allreduce per parameter.  fp32:
        4 bytes per parameter.  Quantised: torchft's fp8 buffer (``quantization._prepare_quantize_fp8``), a
        tensor as rows (1-D: one element a row), the rows padded to a multiple of the replicas, each row its
        values in 1 byte padded to 4 bytes plus a 4-byte fp32 scale; alltoall'd then allgathered in that form."""
        if (step + 1) % self.sync_every:
            return 0.0
        total = 0
        for p in self.module.parameters():
            if not self.quantized:
                total += 4 * p.numel()
                continue
            m, n = (p.shape[0], math.prod(p.shape[1:])) if p.dim() > 1 else (p.numel(), 1)
            rows = math.ceil(m / self.world) * self.world
            total += rows * (math.ceil(n / 4) + 1) * 4
        return float(total)

    def close(self) -> None:
        """Remove DiLoCo's hooks, shut the Manager down, then (rank 0) the lighthouse; safe to call twice."""
        if self._diloco is not None:
            self._diloco.__exit__(None, None, None)
            self._diloco = None
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None
        self._store = None
