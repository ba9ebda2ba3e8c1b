"""``set_gradient_divide_factor`` on a gradientflow module: torch's HSDP semantics (2 nodes x 2 ranks, Gloo).

Torch's HSDP with a divide factor F reduce-scatters each node's gradients with ``1/F`` and then *sums* over the
replicas: every rank's gradient is the world's sum over F (``_get_gradient_divide_factors``: ``PREMUL_SUM(1/F)``,
then ``SUM``).  The values here are derived by hand: ``Linear(1, 4, bias=False)``, ``loss = out.sum()`` and rank
r's input ``r + 1``, so rank r's weight gradient is ``r + 1`` everywhere and the world's sum is 1 + 2 + 3 + 4 = 10.
"""

from __future__ import annotations

import torch

from _dist import run_distributed


def _grads(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from gradientflow.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    for kind in ("torch", "none", "none-default", "none-deprecated", "3bit", "3bit-default"):
        net = torch.nn.Linear(1, 4, bias=False)
        if kind == "torch":
            torch_fully_shard(net, mesh=mesh)
        else:
            fully_shard(net, mesh=mesh, compression=kind.split("-")[0])
        if kind == "none-deprecated":
            net.set_reduce_scatter_divide_factor(2.0)  # torch's deprecated name for the same setting
        elif not kind.endswith("-default"):
            net.set_gradient_divide_factor(2.0)
        net(torch.full((1, 1), float(rank + 1))).sum().backward()
        out[kind] = net.weight.grad.to_local().flatten().tolist()
    return out


def test_a_divide_factor_gives_torch_hsdps_gradients() -> None:
    for r in run_distributed(_grads, 4, timeout=180):
        assert r["torch"] == [5.0, 5.0]  # the world's sum 10 over F = 2: torch's HSDP (each rank's shard: 2 rows)
        assert r["none"] == r["torch"]  # gradientflow's dense reduction between nodes: torch's, bit for bit
        assert r["none-deprecated"] == r["torch"]
        assert r["none-default"] == [2.5, 2.5]  # no factor: the world's average, 10 / 4
        # a compressed recipe: the factor scales what the recipe delivers (here the quantised average of the node
        # averages 1.5 and 3.5 on its first step, its residual kept) by the node count, exactly (a power of two)
        assert r["3bit"] == [2 * v for v in r["3bit-default"]] and r["3bit"] != r["3bit-default"]
