"""FSDP2 / HSDP with gradientflow's recipes between nodes (issue 58), as user code on Gloo loopback.

Each test spawns one mesh's ranks (tests/_dist.py) and trains a small MLP sharded per block and at the root, as
FSDP2 users shard theirs: ``gradientflow.fsdp.fully_shard(block, mesh=mesh, compression=...)`` where torch's user
writes ``torch.distributed.fsdp.fully_shard(block, mesh=mesh)``.  Torch's HSDP (its ``fully_shard`` on the same
2-D mesh) is the oracle for ``compression="none"``; the quantised recipes are checked by what they promise:
replicas identical after every step, error mass conserved, their bytes by the wire format's formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from _dist import run_distributed

IN, HIDDEN, OUT, BATCH = 6, 10, 3, 8


def _net(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, OUT),
    )


def _mesh(nodes: int, per_node: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))


def _shard(net, mesh, kind: str, **options):
    """``kind`` "gf": gradientflow's fully_shard with ``options``; "torch": torch's (its HSDP on the 2-D mesh)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import gradientflow.fsdp as gf

    for block in (net[0], net[2], net):
        if kind == "gf":
            gf.fully_shard(block, mesh=mesh, **options)
        else:
            torch_fully_shard(block, mesh=mesh, **options)
    return net


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, OUT, (BATCH,), generator=g)


def _loss(net, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.cross_entropy(net(x), y)


def _full_params(net) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def _replicas_identical(net, mesh) -> bool:
    """Every rank holds bit for bit the shards its peers on the other nodes hold."""
    import torch.distributed as dist

    group = mesh.get_group("replicate")
    for p in net.parameters():
        local = p.to_local().detach().contiguous()
        every = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, local, group=group)
        if any(not torch.equal(e, local) for e in every):
            return False
    return True


def _train(net, rank: int, steps: int, mesh=None, lr: float = 1e-2, sgd: bool = False, clip: float = 0.0) -> dict:
    """AdamW (or SGD momentum) steps; ``clip``: ``clip_grad_norm_`` on the sharded (DTensor) gradients first."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) if sgd else torch.optim.AdamW(net.parameters(), lr=lr)
    identical = []
    for step in range(steps):
        _loss(net, rank, step).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if mesh is not None:
            identical.append(_replicas_identical(net, mesh))
    return {"params": _full_params(net), "identical": identical, "opt": opt}


def _first_grads(net, rank: int) -> list[torch.Tensor]:
    _loss(net, rank, 0).backward()
    return [p.grad.full_tensor() for p in net.parameters()]


# ---- compression="none" is torch's HSDP; the quantised recipes keep replicas identical ---------------------------


def _none_and_3bit(rank: int, world: int, nodes: int, per_node: int) -> dict:
    import gradientflow.fsdp as gf

    mesh = gf.hsdp_mesh() if nodes == 2 else _mesh(nodes, per_node)  # 2 nodes: from torchrun's variables
    out = {"shape": tuple(mesh.shape), "names": mesh.mesh_dim_names}
    # clip_grad_norm_ on the DTensor gradients, and blocks kept unsharded after forward: as torch's users run them
    torch_run = _train(_shard(_net(), mesh, "torch", reshard_after_forward=False), rank, 3, clip=0.5)
    ours = _shard(_net(), mesh, "gf", compression="none", reshard_after_forward=False)
    none_run = _train(ours, rank, 3, mesh, clip=0.5)
    out["none_diff"] = max((a - b).abs().max().item() for a, b in zip(torch_run["params"], none_run["params"]))
    out["none_identical"] = none_run["identical"]
    out["none_stats"] = gf.comm_stats(ours)
    reference = _first_grads(_shard(_net(), mesh, "torch"), rank)
    for half in ("fp16", "bf16"):
        net = _shard(_net(), mesh, "gf", compression=half)
        grads = _first_grads(net, rank)
        out[f"{half}_rel"] = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(reference, grads))
        out[f"{half}_identical"] = _replicas_identical(net, mesh)
        out[f"{half}_stats"] = gf.comm_stats(net)
    if nodes == 2:  # the 2-bit recipe past its 3-bit warm-up (1 exchange here, 20 by default)
        two = _shard(_net(), mesh, "gf", compression="2bit-precond", quant_warmup_steps=1)
        out["2bit_identical"] = _train(two, rank, 3, mesh)["identical"]
        out["2bit_stats"] = gf.comm_stats(two)
    for topk in ("topk-fp16", "topk-3bit"):  # sparse from the first exchange (no ramp), chunks of 8 elements
        net = _shard(_net(), mesh, "gf", compression=topk, warmup_steps=0, chunk_size=8)
        run = _train(net, rank, 3, mesh, sgd=True)
        out[f"{topk}_identical"] = run["identical"]
        out[f"{topk}_stats"] = gf.comm_stats(net)
        out[f"{topk}_moved"] = max((a - b).abs().max().item() for a, b in zip(torch_run["params"], run["params"]))
    q = _shard(_net(), mesh, "gf", compression="3bit-precond" if nodes > 2 else "3bit")
    q_run = _train(q, rank, 4, mesh, clip=0.5)
    out["q_identical"] = q_run["identical"]
    out["q_stats"] = gf.comm_stats(q)
    out["q_total"] = gf.comm_stats(q, total=True)
    out["q_diff"] = max((a - b).abs().max().item() for a, b in zip(torch_run["params"], q_run["params"]))
    return out


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 3), (3, 2)])
def test_none_is_torch_hsdp_and_3bit_keeps_replicas_identical(nodes: int, per_node: int) -> None:
    from gradientflow.comm.quantize import wire_bytes

    world = nodes * per_node
    results = run_distributed(_none_and_3bit, world, nodes, per_node, timeout=180, ranks_per_node=per_node)
    for r in results:
        assert r["shape"] == (nodes, per_node) and r["names"] == ("replicate", "shard")
        # "none" is torch's HSDP's own pair of collectives: the reduce-scatter with ReduceOp.AVG inside the node,
        # then the all-reduce with ReduceOp.AVG between nodes, on the same tensors in the same order; the summation
        # tolerance is therefore 0 (clip_grad_norm_'s total norm, AdamW: the same floats in, the same out)
        assert r["none_diff"] == 0.0, r["none_diff"]
        assert all(r["none_identical"]) and all(r["q_identical"]) and r["fp16_identical"] and r["bf16_identical"]
        # a 16-bit wire: each node's t / M rounded once, their sum once more (round to nearest: 2^-11 of the operand
        # for fp16, 2^-8 for bf16, each); two roundings of values no larger than the gradient's largest, plus the
        # node's own gradient being up to M times the average: 2 * M * 2^-11 (fp16), 2 * M * 2^-8 (bf16) relative
        assert 0 < r["fp16_rel"] <= 2 * nodes * 2**-11, r["fp16_rel"]
        assert 0 < r["bf16_rel"] <= 2 * nodes * 2**-8, r["bf16_rel"]
        assert r["q_diff"] > 0  # the quantised run is a different run (AdamW on 3-bit codes)...
        assert r["q_diff"] < 0.05  # ...of the same training: 4 steps of lr 1e-2 move no parameter by more
    # bytes by hand: each module's shard, padded per parameter to a multiple of the ranks per node
    numels = []
    for shapes in ([(HIDDEN, IN), (HIDDEN,)], [(HIDDEN, HIDDEN), (HIDDEN,)], [(OUT, HIDDEN), (OUT,)]):
        n = 0
        for shape in shapes:
            rows = -(-shape[0] // per_node)
            n += rows * (shape[1] if len(shape) > 1 else 1)
        numels.append(n)
    dense = sum(4 * n for n in numels)
    for r in results:
        assert r["none_stats"]["dense_bytes"] == dense == r["none_stats"]["payload_bytes"]
        assert r["none_stats"]["exchanges"] == 3
        assert r["fp16_stats"]["payload_bytes"] == r["bf16_stats"]["payload_bytes"] == dense // 2
        assert r["fp16_stats"]["dense_bytes"] == dense
        assert r["q_stats"]["payload_bytes"] == sum(wire_bytes(n, 3, 128) for n in numels)
        assert r["q_stats"]["dense_bytes"] == dense
        if nodes == 2:
            assert all(r["2bit_identical"])
            assert r["2bit_stats"]["payload_bytes"] == sum(wire_bytes(n, 2, 128) for n in numels)
        # memory: the 3-bit recipe keeps one fp32 shard per rank (the residual), "-precond" a second (q); "none" none
        assert r["q_stats"]["state_bytes"] == dense * (2 if nodes > 2 else 1)
        assert r["none_stats"]["state_bytes"] == 0
        assert r["q_total"]["exchanges"] == 4 * 3
        # top-k: one fp32 score per chunk of 8, then the selected chunks (the recipe's density of them, rounded up:
        # 0.1 for "topk-fp16", 0.3 for "topk-3bit"; the chunks holding a bias among them) in fp16, or quantised in
        # 3-bit blocks; the residual is the shard padded to whole chunks
        chunks = [-(-n // 8) for n in numels]
        scores = sum(4 * c for c in chunks)
        assert all(r["topk-fp16_identical"]) and all(r["topk-3bit_identical"])
        assert r["topk-fp16_stats"]["payload_bytes"] == scores + sum(2 * 8 * math.ceil(0.1 * c) for c in chunks)
        quantised = sum(wire_bytes(8 * math.ceil(0.3 * c), 3, 128) for c in chunks)
        assert r["topk-3bit_stats"]["payload_bytes"] == scores + quantised
        assert r["topk-fp16_stats"]["state_bytes"] == sum(4 * 8 * c for c in chunks)
        assert r["topk-fp16_stats"]["dense_bytes"] == dense
        assert 0 < r["topk-fp16_moved"] < 1.0  # trained (SGD lr 0.1, 3 steps) and not blown up


# ---- error feedback on the shard: nothing lost -------------------------------------------------------------------


def _conservation(rank: int, world: int) -> dict:
    """Each rank's shard t and a residual e from an earlier step; after one exchange, summed over the nodes:
    sum(t / M + e before) == result + sum(e after) elementwise (the quantiser and the top-k selection only delay).
    The top-k recipes also say which chunks they sent: how many, and whether the one holding a 1-D parameter."""
    from datetime import timedelta

    import torch.distributed as dist

    from gradientflow.config import GradientFlowConfig
    from gradientflow.diagnostics.watchdog import Watchdog
    from gradientflow.fsdp.exchange import QuantizedShard
    from gradientflow.fsdp.topk import TopkShard

    errors, fp16_errors, chosen = [], [], []
    watchdog = Watchdog(dist.group.WORLD, timedelta(seconds=30))
    for recipe in ("3bit", "3bit-precond", "2bit-precond"):
        quantizer = GradientFlowConfig(compression=recipe).quantizer()
        g = torch.Generator().manual_seed(rank)
        state = QuantizedShard(300, torch.device("cpu"), quantizer.precondition, dist.group.WORLD, watchdog)
        for step in range(3):  # step 0 fills e (and q); the checks run on steps with a residual to carry
            t = torch.randn(300, generator=g) * (1 + step)
            before = t / world + state.err
            dist.all_reduce(before)
            state.reduce(t, quantizer)
            after = t + 0  # the result, the same on every rank
            residuals = state.err.clone()
            dist.all_reduce(residuals)
            if step:
                errors.append(((after + residuals - before).abs().max() / before.abs().max()).item())
    for recipe in ("topk-fp16", "topk-3bit"):  # the residual v: padded to whole chunks of 16 (300 -> 304)
        config = GradientFlowConfig(compression=recipe, warmup_steps=0, chunk_size=16)
        g = torch.Generator().manual_seed(rank)
        topk = TopkShard(300, torch.device("cpu"), config, [(290, False), (10, True)])
        for step in range(3):
            t = torch.randn(300, generator=g) * (1 + step)
            before = topk.err.clone()
            before[:300] += t / world
            dist.all_reduce(before)
            topk.reduce(t, dist.group.WORLD, watchdog)
            after = torch.zeros(304)
            after[:300] = t
            residuals = topk.err.clone()
            dist.all_reduce(residuals)
            lost = ((after + residuals - before).abs().max() / before.abs().max()).item()
            (errors if recipe == "topk-3bit" else fp16_errors).append(lost)
            sent = after.view(19, 16).abs().sum(1) > 0  # the chunks the result holds
            chosen.append((recipe, int(sent.sum()), bool(sent[-1])))
    return {"errors": errors, "fp16_errors": fp16_errors, "chosen": chosen}


@pytest.mark.parametrize("nodes", [2, 3])
def test_error_mass_conserved(nodes: int) -> None:
    # a few fp32 roundings of values of the sum's size: relative 1e-6 (a lost block's mass would be ~0.1)
    for r in run_distributed(_conservation, nodes, timeout=60):
        assert max(r["errors"]) < 1e-6, r["errors"]
        # "topk-fp16": each node's rows rounded to fp16 keep their rounding in v, but the fp16 sum of M of them rounds
        # M - 1 times more (the ring's additions), lost to everyone: at most (M - 1) * 2^-11 of the sum's largest
        assert max(r["fp16_errors"]) <= (nodes - 1) * 2**-11, r["fp16_errors"]
        # 19 chunks: ceil(0.1 * 19) = 2 for "topk-fp16" (density 0.1), ceil(0.3 * 19) = 6 for "topk-3bit"; the last
        # chunk (elements 288-303: the 1-D parameter's 290-299) every time
        assert r["chosen"] == [("topk-fp16", 2, True)] * 3 + [("topk-3bit", 6, True)] * 3, r["chosen"]


# ---- what FSDP2 users do: mixed precision, accumulation -----------------------------------------------------------


def _mixed_and_accumulation(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import gradientflow.fsdp as gf

    mesh = _mesh(2, 2)
    out = {}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch_run = _train(_shard(_net(), mesh, "torch", mp_policy=mp), rank, 2)
    ours = _shard(_net(), mesh, "gf", compression="none", mp_policy=mp)
    none_run = _train(ours, rank, 2, mesh)
    out["mp_none_diff"] = max((a - b).abs().max().item() for a, b in zip(torch_run["params"], none_run["params"]))
    q = _shard(_net(), mesh, "gf", compression="3bit", mp_policy=mp)
    out["mp_q_identical"] = _train(q, rank, 2, mesh)["identical"]
    out["mp_q_stats"] = gf.comm_stats(q)

    # accumulation over 3 micro-steps: set_requires_gradient_sync(False) (no reduce-scatter), and
    # set_requires_all_reduce(False) (reduce-scatter inside the node, the exchange at the last micro-step)
    for flag in ("set_requires_gradient_sync", "set_requires_all_reduce"):
        runs = {}
        for kind in ("torch", "gf"):
            # "none": the accumulated gradient must then be torch's HSDP's exactly (what is held and when it is sent
            # does not depend on the recipe: the hook holds the shard before any recipe runs)
            net = _shard(_net(), mesh, kind, **({"compression": "none"} if kind == "gf" else {}))
            sent = []
            for micro in range(3):
                getattr(net, flag)(micro == 2)
                _loss(net, rank, micro).backward()
                if kind == "gf":
                    sent.append(gf.comm_stats(net, total=True)["exchanges"])
            runs[kind] = [p.grad.full_tensor() for p in net.parameters()]
            if kind == "gf":
                out[f"{flag}_sent"] = sent
                out[f"{flag}_held"] = gf.comm_stats(net)["held_micro_steps"]
        out[f"{flag}_grad_diff"] = max(
            ((a - b).abs().max() / a.abs().max()).item() for a, b in zip(runs["torch"], runs["gf"])
        )
    return out


def test_bf16_mixed_precision_and_gradient_accumulation() -> None:
    from gradientflow.comm.quantize import wire_bytes

    for r in run_distributed(_mixed_and_accumulation, 4, timeout=180):
        # bf16 parameters, fp32 reduce: the hook sees torch's fp32 reduce-scatter output, so "none" is torch's HSDP
        assert r["mp_none_diff"] == 0.0, r["mp_none_diff"]  # torch's collectives, in order (see above)
        assert all(r["mp_q_identical"])
        assert r["mp_q_stats"]["payload_bytes"] == sum(wire_bytes(n, 3, 128) for n in (35, 55, 18))
        # no exchange between nodes before the last micro-step (3 modules: 3 exchanges, all at micro-step 2)
        assert r["set_requires_gradient_sync_sent"] == [0, 0, 3]
        assert r["set_requires_all_reduce_sent"] == [0, 0, 3]
        assert r["set_requires_all_reduce_held"] == 3 * 2  # 3 modules, each held its first 2 micro-steps
        # the accumulated gradient is torch's HSDP's bit for bit: the held shard is added before the exchange, where
        # torch adds its partial reduce-scatter output before its all-reduce
        assert r["set_requires_gradient_sync_grad_diff"] == 0.0
        assert r["set_requires_all_reduce_grad_diff"] == 0.0


# ---- DCP: save, bit-exact resume; another mesh is refused --------------------------------------------------------


def _dcp(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import gradientflow.fsdp as gf

    mesh = _mesh(2, 2)
    out = {}

    def state(net, opt):
        model_sd, optim_sd = get_state_dict(net, opt)
        return {"model": model_sd, "optim": optim_sd, "gradientflow": gf.comm_state(net)}

    def steps(net, opt, first, last):
        for step in range(first, last):
            _loss(net, rank, step).backward()
            opt.step()
            opt.zero_grad()

    # "auto" (AdamW: dense step 0, then "3bit" on 2 nodes; the pick is in the checkpoint), "2bit-precond" whose
    # 3-bit warm-up of 4 exchanges ends after the resume (its count and q are in the checkpoint too), and "topk-3bit"
    # whose density ramp of 4 exchanges does (its count and the residual v)
    for name, options in (
        ("auto", {"compression": "auto"}),
        ("2bit", {"compression": "2bit-precond", "quant_warmup_steps": 4}),
        ("topk", {"compression": "topk-3bit", "warmup_steps": 4, "chunk_size": 8}),
    ):
        net = _shard(_net(), mesh, "gf", **options)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        steps(net, opt, 0, 3)
        dcp.save(state(net, opt), checkpoint_id=f"{path}-{name}")
        out[f"{name}_saved"] = gf.comm_stats(net)["compression"]
        steps(net, opt, 3, 6)
        straight = _full_params(net)

        fresh = _shard(_net(seed=1), mesh, "gf", **options)  # other initial weights: all must come from disk
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        loaded = state(fresh, fresh_opt)
        gf.check_checkpoint(f"{path}-{name}", fresh)
        dcp.load(loaded, checkpoint_id=f"{path}-{name}")
        set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        out[f"{name}_resumed"] = gf.comm_stats(fresh)["compression"]
        steps(fresh, fresh_opt, 3, 6)
        out[f"{name}_bit_exact"] = all(torch.equal(a, b) for a, b in zip(straight, _full_params(fresh)))
    path = f"{path}-auto"

    other = _shard(_net(), _mesh(4, 1), "gf", compression="auto")  # 4 nodes of one rank
    with pytest.raises(ValueError) as ours:
        gf.check_checkpoint(path, other)
    out["check_error"] = str(ours.value)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    try:
        dcp.load(state(other, other_opt), checkpoint_id=path)
        out["load_error"] = ""
    except BaseException as exc:  # noqa: BLE001 — DCP raises a CheckpointException (a BaseException) on every rank
        out["load_error"] = str(exc)
    dist.barrier()
    return out


def test_dcp_resume_is_bit_exact_and_another_mesh_is_refused(tmp_path) -> None:
    for r in run_distributed(_dcp, 4, str(tmp_path / "ckpt"), timeout=180):
        assert r["auto_saved"] == r["auto_resumed"] == "3bit"
        assert r["2bit_saved"] == r["2bit_resumed"] == "2bit-precond"
        assert r["topk_saved"] == r["topk_resumed"] == "topk-3bit"
        assert r["auto_bit_exact"] and r["2bit_bit_exact"] and r["topk_bit_exact"]
        assert "saved on a 2x2 mesh" in r["check_error"] and "runs on 4x1" in r["check_error"]
        assert "residual@4x1" in r["load_error"]


# ---- bad input: a clear error on every rank ------------------------------------------------------------------------


def _bad(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import gradientflow.fsdp as gf

    out = {}
    cases = {
        "1-D": lambda: gf.fully_shard(_net(), mesh=init_device_mesh("cpu", (2,))),
        "names": lambda: gf.fully_shard(_net(), mesh=init_device_mesh("cpu", (2, 1))),  # torch refuses it too
        "unknown": lambda: gf.fully_shard(_net(), mesh=_mesh(2, 1), compression="3bits"),
        "density": lambda: gf.fully_shard(_net(), mesh=_mesh(2, 1), compression="topk-3bit", density=1.5),
        "unread": lambda: gf.fully_shard(_net(), mesh=_mesh(2, 1), compression="3bit", density=0.1),
        "no mesh": lambda: gf.fully_shard(_net()),
        "mesh size": lambda: gf.hsdp_mesh(3, 1),
        # torchtitan's default SPMD backend passes its mesh dimensions so (torchtitan/distributed/fsdp.py)
        "dp_mesh_dims": lambda: gf.fully_shard(_net(), mesh=_mesh(2, 1), dp_mesh_dims=("replicate", "shard")),
    }
    for name, call in cases.items():
        try:
            call()
            out[name] = ""
        except ValueError as exc:
            out[name] = str(exc)
    net = _net()
    torch_fully_shard(net[0], mesh=init_device_mesh("cpu", (2,)))  # torch's plain FSDP inside ours
    try:
        gf.fully_shard(net, mesh=_mesh(2, 1))
        out["torch 1-D child"] = ""
    except ValueError as exc:
        out["torch 1-D child"] = str(exc)
    net = _net()
    gf.fully_shard(net[0], mesh=_mesh(2, 1))
    torch_fully_shard(net, mesh=init_device_mesh("cpu", (2,)))  # torch's plain FSDP around ours
    try:
        _loss(net, rank, 0).backward()
        out["torch 1-D parent"] = ""
    except RuntimeError as exc:
        out["torch 1-D parent"] = str(exc)
    one_node = gf.hsdp_mesh(1, 2)  # a 2-D mesh of one node: legal, nothing between nodes
    net = _shard(_net(), one_node, "gf", compression="3bit")
    _train(net, rank, 2)
    out["one node"] = (tuple(one_node.shape), gf.comm_stats(net, total=True)["exchanges"])
    try:  # the ranks disagree: every rank hears of it, naming what each passed
        gf.fully_shard(_net(), mesh=_mesh(2, 1), compression="3bit" if rank == 0 else "fp16")
        out["disagree"] = ""
    except ValueError as exc:
        out["disagree"] = str(exc)
    return out


def test_bad_input_raises_clearly_on_every_rank() -> None:
    for r in run_distributed(_bad, 2, timeout=120):
        assert "a 1-D mesh has none" in r["1-D"]
        assert "has no dimension names" in r["names"]
        assert "did you mean '3bit'" in r["unknown"]
        assert "density must be None (dense) or a number in (0, 1], got 1.5" in r["density"]
        assert "density=0.1 has no effect" in r["unread"]
        assert "LOCAL_WORLD_SIZE" in r["no mesh"]
        assert "product is the world size 2" in r["mesh size"]
        assert "dp_mesh_dims (an SPMD mesh) is not supported" in r["dp_mesh_dims"]
        assert "sharded by torch's fully_shard on a 1-D mesh" in r["torch 1-D child"]
        assert "drift apart" in r["torch 1-D parent"]
        assert "rank 0: 3bit" in r["disagree"] and "rank 1: fp16" in r["disagree"]
        assert r["one node"] == ((1, 2), 0)


# ---- compression="auto": dense until the optimizer's first step, then its recipe ------------------------------------


def _auto(rank: int, world: int) -> dict:
    import gradientflow.fsdp as gf

    out = {}
    mesh = _mesh(world, 1)
    for opt_name in ("adamw", "sgd"):
        net = _shard(_net(), mesh, "gf")  # compression="auto" is the default
        seen = []
        run_opt = None
        for step in range(3):
            _loss(net, rank, step).backward()
            stats = gf.comm_stats(net)
            seen.append((stats["compression"], stats["payload_bytes"]))
            out.setdefault(opt_name + "_why", []).append(stats["compression_auto"])
            if run_opt is None:
                run_opt = (
                    torch.optim.SGD(net.parameters(), lr=0.1)
                    if opt_name == "sgd"
                    else torch.optim.AdamW(net.parameters(), lr=1e-2)
                )
            run_opt.step()
            run_opt.zero_grad()
        out[opt_name] = seen
        out[opt_name + "_identical"] = _replicas_identical(net, mesh)
    return out


@pytest.mark.parametrize("nodes,adamw", [(2, "3bit"), (3, "3bit-precond")])
def test_auto_is_dense_until_the_first_step_then_the_optimizers_recipe(nodes: int, adamw: str) -> None:
    from gradientflow.comm.quantize import wire_bytes

    numels = (HIDDEN * IN + HIDDEN, HIDDEN * HIDDEN + HIDDEN, OUT * HIDDEN + OUT)  # one rank per node: whole
    dense, quantized = sum(4 * n for n in numels), sum(wire_bytes(n, 3, 128) for n in numels)
    four = sum(wire_bytes(n, 4, 128) for n in numels)
    for r in run_distributed(_auto, nodes, timeout=120):
        assert r["adamw"] == [("auto", dense), (adamw, quantized), (adamw, quantized)]
        assert r["sgd"] == [("auto", dense), ("4bit", four), ("4bit", four)]  # SGD under FSDP: 4 bits (auto.py)
        # and why, as the DDP wrapper's comm_stats() says it: nothing seen yet, then the optimizer's class
        assert r["adamw_why"] == ["no optimizer step seen yet: dense fp32", *2 * [f"AdamW -> {adamw}"]]
        assert r["sgd_why"] == ["no optimizer step seen yet: dense fp32", *2 * ["SGD -> 4bit"]]
        assert r["adamw_identical"] and r["sgd_identical"]


# ---- a compiled block ----------------------------------------------------------------------------------------------


def _compiled(rank: int, world: int) -> dict:
    import gradientflow.fsdp as gf

    mesh = _mesh(2, 1)
    out = {}
    runs = {}
    for kind, options in (("torch", {}), ("gf", {"compression": "none"}), ("gf3", {"compression": "3bit"})):
        net = _net()
        for block in (net[0], net[2]):
            block.compile(backend="aot_eager")  # as torchtitan compiles its blocks, before sharding them
        runs[kind] = _train(_shard(net, mesh, "torch" if kind == "torch" else "gf", **options), rank, 3, mesh)
        if kind == "gf3":
            out["exchanges"] = gf.comm_stats(net, total=True)["exchanges"]
    out["none_diff"] = max((a - b).abs().max().item() for a, b in zip(runs["torch"]["params"], runs["gf"]["params"]))
    out["identical"] = all(runs["gf3"]["identical"])
    return out


def test_a_compiled_block() -> None:
    for r in run_distributed(_compiled, 2, timeout=180):
        assert r["none_diff"] == 0.0  # torch's collectives, in order: the compiled blocks change nothing of it
        assert r["identical"] and r["exchanges"] == 3 * 3


# ---- one unit of several modules: fully_shard([norm, lm_head]), as accelerate shards a Hugging Face model's tail ----


def _list_unit(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import gradientflow.fsdp as gf

    mesh = gf.hsdp_mesh(2, 2)
    out: dict = {}
    runs = {}
    for kind, options in (("torch", {}), ("none", {"compression": "none"}), ("3bit", {"compression": "3bit"})):
        net = _net()
        shard = torch_fully_shard if kind == "torch" else gf.fully_shard
        shard(net[0], mesh=mesh, **options)
        shard([net[2], net[4]], mesh=mesh, **options)  # one FSDP state for both modules (torch's list form)
        shard(net, mesh=mesh, **options)  # the root: its check must take net[4] for gradientflow's, as net[2]
        seen: list[int] = []
        # torch's state is the list's: a hook set on its second module is the unit's, run after the reduction
        net[4].set_all_reduce_hook(lambda t, seen=seen: seen.append(t.numel()))
        runs[kind] = _train(net, rank, 3, mesh)
        out[f"{kind}_hook"] = seen
        if kind != "torch":
            out[f"{kind}_stats"] = gf.comm_stats(net, total=True)
    out["none_diff"] = max((a - b).abs().max().item() for a, b in zip(runs["torch"]["params"], runs["none"]["params"]))
    out["3bit_identical"] = runs["3bit"]["identical"]
    return out


def test_a_unit_of_two_modules_under_a_gradientflow_root() -> None:
    from gradientflow.comm.quantize import wire_bytes

    # the shards on each of a node's 2 ranks: net[0] (5 of 10 rows of 6, and 5 biases), the unit net[2] + net[4]
    # (5 rows of 10 and 5 biases; 2 of 3 rows of 10 and 2 biases, torch padding dim 0); the root owns nothing
    first, unit = 5 * IN + 5, (5 * HIDDEN + 5) + (2 * HIDDEN + 2)
    for r in run_distributed(_list_unit, 4, timeout=180, ranks_per_node=2):
        # torch's HSDP collectives on the same shards in the same order: the same floats (tolerance 0)
        assert r["none_diff"] == 0.0, r["none_diff"]
        assert all(r["3bit_identical"])
        for kind in ("none", "3bit"):
            assert r[f"{kind}_stats"]["exchanges"] == 2 * 3  # two units with parameters, 3 steps
            assert r[f"{kind}_hook"] == r["torch_hook"] == 3 * [unit]  # once per step, on the unit's reduced shard
        assert r["none_stats"]["sent_bytes"] == 3 * 4 * (first + unit)  # 2 nodes: a ring sends one fp32 copy
        assert r["3bit_stats"]["sent_bytes"] == 3 * (wire_bytes(first, 3, 128) + wire_bytes(unit, 3, 128))
