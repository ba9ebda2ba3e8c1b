"""Nodes of several ranks: ``topology`` and two-level synchronisation (issue 37), as user code.

The harness makes ranks into "nodes" by giving each torchrun's variables (``ranks_per_node``).  One
spawn per layout (2x2, 2x3, 3x2) trains every recipe in turn and returns what each rank saw; the
checks, by recipe:

- every rank holds identical parameters after every step (the decoded bytes are the same everywhere);
- dense fp32 two-level equals flat within the summation tolerance derived in :func:`_sum_tolerance`;
- error mass is conserved for the quantised recipe and for CSC: the ranks' residuals plus the result
  equal the sum of the ranks' contributions g_r / N, elementwise, within fp32 rounding;
- checkpoint + resume continues bit-identically; a resume onto another layout is a ValueError naming
  both; a layout the ranks disagree on, or a bad ``topology``, is a ValueError on every rank;
- flat stays flat without torchrun's variables and with ``topology="flat"``.
"""

from __future__ import annotations

import functools
import io

import pytest
import torch
from _quant_training import batches, small_net

from _dist import run_distributed

STEPS = 3
THETA_MB = 0.0  # one bucket per parameter: the small net travels as 4 buckets, several in flight at once
RECIPES: dict[str, dict] = {
    "fp32": {},
    "fp32-ring": {"algorithm": "ring"},
    "fp16": {"comm_dtype": "fp16"},
    "bf16": {"comm_dtype": "bf16"},
    "csc-fp32": {"density": 0.3, "warmup_steps": 0},  # fp32 wire: conservation is exact up to rounding
    "csc": {"compression": "csc", "warmup_steps": 1},
    "cscq": {"compression": "cscq", "warmup_steps": 0},  # sparse from step 0: its conservation is checked there
    "quantized": {"compression": "quantized"},
    "q2npw20": {"compression": "q2npw20"},
    "q2npw1": {"compression": "q2npw1"},  # the preconditioned 2-bit quantiser after one warm-up step
    "auto-sgd": {"compression": "auto"},
    "auto-adamw": {"compression": "auto"},
}
FLAT = {"fp32-flat": {"topology": "flat"}}  # the reference: the same ranks, one exchange over all of them


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name.endswith("adamw") or name.startswith("q"):
        return torch.optim.AdamW(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _local_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """This rank's own gradient at the wrapped model's current parameters (a plain copy, no wrapper)."""
    import copy

    local = copy.deepcopy(model)
    local.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(local(x), y).backward()
    return [p.grad.detach().clone() for p in local.parameters()]


def _in_pool(ddp, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-parameter tensors laid out as the gradient pool is now (one flat buffer per pool)."""
    layout = ddp.pool.layout
    out = [torch.zeros(n) for n in layout.sizes]
    for t, slot in zip(tensors, layout.slots):
        out[slot.pool][slot.offset : slot.offset + slot.numel] = t.reshape(-1)
    return out


def _train_all(rank: int, world: int, recipes: list[str], opts: dict) -> dict:
    """Each recipe for STEPS steps: parameters after every step, the step-0 pool, residuals, local grads."""
    import gradientflow

    out: dict = {}
    for name in recipes:
        model = small_net()
        options = {**RECIPES, **FLAT}[name]
        ddp = gradientflow.DistributedDataParallel(model, fusion_threshold_mb=THETA_MB, **options, **opts)
        opt = _optimizer(name, ddp.parameters())
        rec: dict = {"params": [], "topology": ddp.config.topology}
        for step, (x, y) in enumerate(batches(rank, STEPS)):
            local = _local_grads(model, x, y)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if step == 0:
                rec["result"] = [b.clone() for b in ddp.pool.buffers]
                rec["grads"] = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
                rec["contribution"] = _in_pool(ddp, [g / world for g in local])
                state = ddp.comm_state_dict()
                v = state.get("v")
                rec["residual"] = [t.clone() for t in v] if v is not None else None
                rec["local"] = local
            opt.step()
            rec["params"].append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
        rec["stats"] = ddp.comm_stats()
        rec["config"] = [ddp.config.compression, ddp.config.density]  # what runs after "auto"'s switch
        rec["memory"] = _residual_memory(ddp)
        out[name] = _portable(rec)
        del ddp
    return out


def _residual_memory(ddp) -> tuple[int, int, int, int, bool] | None:
    """The quantised recipe's error-feedback memory on this rank: (residual elements, the sum of the shards the
    plan gives this rank's buckets, the pool's elements, one block per bucket (the most whole blocks add), a fold
    pending); None for the other recipes."""
    from gradientflow.comm.topology import two_level_plan

    sync = ddp._gf_engine.sync
    if not hasattr(sync, "quantizer") or sync.res is None:  # the quantised recipe's strategy
        return None
    nodes, per_node = (int(n) for n in ddp.config.topology.split("x")) if "x" in ddp.config.topology else (1, 1)
    shards = sum(two_level_plan(b.numel, nodes, per_node, sync.quantizer.block).shard for b in ddp.pool.layout.buckets)
    held = sum(t.numel() for t in sync.res.v)
    return (
        held,
        shards,
        sum(ddp.pool.layout.sizes),
        len(ddp.pool.layout.buckets) * sync.quantizer.block,
        sync._fold is not None,
    )


def _portable(obj):
    """Tensors as numpy arrays: the result queue would otherwise share their memory with an exited rank."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_portable(v) for v in obj]
    return obj


def _tensors(obj):
    """The records back as tensors (in the test process)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_tensors(v) for v in obj]
    return obj


def _sum_tolerance(records: list[dict]) -> torch.Tensor:
    """|two-level - flat| bound for an average of N fp32 addends a_r = g_r / N summed in another order.

    Any order of the N - 1 additions errs by at most (N - 1) u sum_r |a_r| (u = 2^-24, the unit
    roundoff, each partial sum bounded by sum |a_r|); two orders differ by at most twice that.
    The division by N is the same rounding in both (done once, before the sum).
    """
    n = len(records)
    total = sum(torch.cat([g.reshape(-1) for g in r["local"]]).abs() / n for r in records)
    assert isinstance(total, torch.Tensor)
    return 2 * (n - 1) * 2.0**-24 * total + 1e-30


def _identical_everywhere(records: list[dict], name: str) -> None:
    for step in range(STEPS):
        ref = records[0][name]["params"][step]
        for rank, r in enumerate(records[1:], start=1):
            assert torch.equal(r[name]["params"][step], ref), f"{name}: rank {rank} differs at step {step}"


def _conserved(records: list[dict], name: str, per_rank_units: float = 1.0) -> None:
    """sum_r residual_r + result == sum_r g_r / N, elementwise (step 0, from zero residuals): the
    contributions g_r / N summed, less what was held back (the ranks' residuals), is what was applied.
    (Times N: the ranks' residuals in gradient units plus N x the average equal the sum of the gradients.)
    ``per_rank_units``: the residual's units in contributions (CSC keeps g_r itself: 1 / N)."""
    n = len(records)
    for k in range(len(records[0][name]["result"])):
        held = [r[name]["residual"][k] * per_rank_units for r in records]
        lhs = sum(held) + records[0][name]["result"][k]
        rhs = sum(r[name]["contribution"][k] for r in records)
        scale = sum(r[name]["contribution"][k].abs() + h.abs() for r, h in zip(records, held))
        # each fp32 add (the node sums, the residual into the shard, the decoded sums, the error) rounds by
        # at most 2^-24 of a partial sum no larger than scale + |result|: a few per element, N at most
        tol = 4 * n * 2.0**-24 * (scale + records[0][name]["result"][k].abs()) + 1e-12
        assert ((lhs - rhs).abs() <= tol).all(), f"{name}: error mass not conserved, max {(lhs - rhs).abs().max()}"


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 3), (3, 2)])
def test_every_recipe_two_level(nodes: int, per_node: int) -> None:
    world = nodes * per_node
    names = list(RECIPES)
    two = _tensors(run_distributed(_train_all, world, [*names, *FLAT], {}, ranks_per_node=per_node, timeout=300))
    for name in names:
        assert two[0][name]["topology"] == f"{nodes}x{per_node}"
        stats = two[0][name]["stats"]
        assert (stats["topology"], stats["nodes"], stats["ranks_per_node"]) == (f"{nodes}x{per_node}", nodes, per_node)
        assert stats["inter_node_bytes"] > 0 and stats["intra_node_bytes"] > 0, (name, stats)
        _identical_everywhere(two, name)
    # dense fp32: the same average as flat, within the summation-order tolerance (step 0: same parameters)
    assert two[0]["fp32-flat"]["topology"] == "flat"
    got, ref = two[0]["fp32"]["grads"], two[0]["fp32-flat"]["grads"]
    tol = _sum_tolerance([r["fp32"] for r in two])
    assert not torch.equal(got, torch.zeros_like(got))
    assert ((got - ref).abs() <= tol).all(), (got - ref).abs().max()
    for name in ("quantized", "q2npw20"):
        _conserved(two, name)
    # "auto" with SGD on nodes of several ranks: "cscq" at half the chunks (each rank sends 1/G of them between nodes)
    assert two[0]["auto-sgd"]["config"] == ["topk-3bit", 0.5]
    assert two[0]["cscq"]["config"] == ["topk-3bit", 0.3]  # passed by name: the recipe's own density
    # "auto" with AdamW: plain 3 bits between 2 nodes (two parties); beyond two nodes each shard's sum is quantised
    # again, and the preconditioned 3 bits run ("3bit-precond", policy.auto_choice.MANY_PARTIES_ADAM)
    assert two[0]["auto-adamw"]["stats"]["compression"] == ("3bit-precond" if nodes > 2 else "3bit")
    # error feedback on the node-reduced shard: each rank's residual is its buckets' shards, 1/G of the pool
    for r in two:
        for name in ("quantized", "q2npw20", "q2npw1", "auto-adamw"):
            held, shards, pool, slack, fold = r[name]["memory"]
            assert held == shards and not fold, (name, r[name]["memory"])
            assert pool / per_node <= held <= pool / per_node + slack, (name, r[name]["memory"])
    _conserved(two, "csc-fp32", per_rank_units=1 / world)  # CSC's residual: the unsent g_r, undivided
    _conserved(two, "cscq", per_rank_units=1 / world)  # + the node sum's quantisation error, on the rank's shard


# ---- the layout, pure ---------------------------------------------------------------------------
def _env(per_node: int, rank: int, world: int, **over: int) -> dict[str, str]:
    env = {"LOCAL_WORLD_SIZE": per_node, "LOCAL_RANK": rank % per_node, "GROUP_RANK": rank // per_node}
    env.update(RANK=rank, WORLD_SIZE=world, **over)
    return {k: str(v) for k, v in env.items()}


def test_layout_from_torchruns_variables_and_by_name() -> None:
    from gradientflow.comm.topology import resolve_topology

    assert resolve_topology("auto", 6, 4, _env(3, 4, 6), True).name == "2x3"  # rank 4 = node 1, local 1
    assert resolve_topology("auto", 6, 4, _env(2, 4, 6), True).name == "3x2"
    assert resolve_topology("auto", 4, 1, {}, True).name == "flat"  # not launched by torchrun
    assert resolve_topology("auto", 4, 1, _env(4, 1, 4), True).name == "flat"  # one node holds every rank
    assert resolve_topology("auto", 4, 1, _env(1, 1, 4), True).name == "flat"  # one rank per node
    assert resolve_topology("auto", 2, 1, _env(2, 1, 4), False).name == "flat"  # a subgroup under "auto"
    assert resolve_topology("flat", 4, 1, _env(2, 1, 4), True).name == "flat"
    # a launcher that sets LOCAL_RANK / LOCAL_WORLD_SIZE but not GROUP_RANK (accelerate's, SLURM scripts):
    # node-contiguous ranks give the node
    assert resolve_topology("auto", 4, 3, {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, True).name == "2x2"
    assert resolve_topology("auto", 2, 1, {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, True).name == "flat"
    # a named layout without torchrun's variables (forked or mp.spawn-ed ranks): taken as given
    assert resolve_topology("2x2", 4, 3, {}, True).name == "2x2"
    assert resolve_topology("1x4", 4, 3, {}, True).name == "flat"
    # ... and with them, it must be the launch's: M = WORLD_SIZE / LOCAL_WORLD_SIZE nodes of G = LOCAL_WORLD_SIZE
    assert resolve_topology("2x2", 4, 3, _env(2, 3, 4), True).name == "2x2"
    assert resolve_topology("1x4", 4, 3, _env(4, 3, 4), True).name == "flat"  # one machine of 4: flat, as "auto"
    assert resolve_topology("4x1", 4, 3, _env(1, 3, 4), True).name == "flat"  # 4 machines of 1: flat, as "auto"
    assert resolve_topology("2x2", 4, 1, _env(1, 5, 8), False).name == "2x2"  # a subgroup: the launch counts others
    assert resolve_topology("2x2", 4, 1, _env(1, 1, 8), True).name == "2x2"  # WORLD_SIZE not this group's: as given
    contradictions = [  # (topology, the launch's LOCAL_WORLD_SIZE, what each says in the message)
        ("2x2", 1, "2 nodes of 2 ranks", "4 nodes of 1 rank"),
        ("1x4", 2, "1 node of 4 ranks", "2 nodes of 2 ranks"),  # would run flat: "flat" says that choice
        ("4x1", 2, "4 nodes of 1 rank", "2 nodes of 2 ranks"),
        ("2x2", 4, "2 nodes of 2 ranks", "1 node of 4 ranks"),
    ]
    for value, per_node, named, launch in contradictions:
        for rank in range(4):  # the same error on every rank: it reads the same LOCAL_WORLD_SIZE
            with pytest.raises(ValueError) as err:
                resolve_topology(value, 4, rank, _env(per_node, rank, 4), True)
            msg = str(err.value)
            assert f"topology={value!r} ({named}) contradicts the launch" in msg, msg
            assert f"LOCAL_WORLD_SIZE={per_node}, WORLD_SIZE=4 ({launch};" in msg, msg
            assert "topology='auto'" in msg and "topology='flat'" in msg, msg
    # the launch's nodes, but this rank placed elsewhere than node-contiguous ranks place it
    with pytest.raises(ValueError, match=r"topology='2x2' \(2 nodes of 2 ranks\) contradicts.*LOCAL_RANK=0 of node"):
        resolve_topology("2x2", 4, 1, _env(2, 1, 4, GROUP_RANK=1, LOCAL_RANK=0), True)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=4 does not split the 6 ranks.*topology='flat'"):
        resolve_topology("auto", 6, 1, _env(4, 1, 6), True)
    with pytest.raises(ValueError, match="not contiguous per node.*topology='flat'"):
        resolve_topology("auto", 4, 1, _env(2, 1, 4, GROUP_RANK=1, LOCAL_RANK=0), True)
    with pytest.raises(ValueError, match="names 6 ranks, the process group has 4"):
        resolve_topology("2x3", 4, 0, {}, True)
    with pytest.raises(ValueError, match="topology must be 'auto'"):
        resolve_topology("2by2", 4, 0, {}, True)
    with pytest.raises(ValueError, match="topology must be 'auto'"):
        __import__("gradientflow").GradientFlowConfig(topology="0x4")


def test_two_level_plan_by_hand() -> None:
    from gradientflow.comm.topology import two_level_plan

    # 1000 fp32 gradients, 2 nodes of 3 ranks, dense: shards of ceil(1000 / 3) = 334, padded to 1002
    p = two_level_plan(1000, 2, 3)
    assert (p.shard, p.padded, p.bounds) == (334, 1002, ((0, 334), (334, 668), (668, 1002)))
    # inside the node: (G-1) shards out in the reduce-scatter, as many in the all-gather; between nodes
    # a ring allreduce of the shard among M = 2: 2 (M-1)/M x 334 x 4 bytes
    assert (p.intra_bytes, p.inter_bytes) == (2 * 2 * 334 * 4, 334 * 4)
    # quantised: whole 128-element blocks: 8 blocks over 3 ranks -> 3 blocks (384) a shard
    q = two_level_plan(1000, 3, 3, block=128)
    assert (q.shard, q.padded, q.bounds[2]) == (384, 1152, (768, 1152))
    assert two_level_plan(0, 2, 2).padded == 0


# ---- construction on ranks: flat stays flat, errors on every rank --------------------------------
def _wrap(**opts):
    import gradientflow

    return gradientflow.DistributedDataParallel(small_net(), fusion_threshold_mb=THETA_MB, **opts)


def _construction_cases(rank: int, world: int) -> dict:
    """Run as nodes of 2 (torchrun's variables set by the harness): what each construction gave or raised."""
    import os

    def attempt(env: dict[str, str] | None = None, hook: bool = False, **opts) -> str:
        saved = dict(os.environ)
        os.environ.update(env or {})
        try:
            ddp = _wrap(**opts)
            if hook:  # torch DDP's contract: the hook gets the whole group's buckets, flat
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            two_level = "inter_node_bytes" in _step(ddp)
            stats = ddp.comm_stats()
            return f"{ddp.config.topology} {stats['nodes']}x{stats['ranks_per_node']} {two_level}"
        except ValueError as exc:
            return f"ValueError: {exc}"
        finally:
            os.environ.clear()
            os.environ.update(saved)

    lws = {"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "LOCAL_RANK": str(rank)} if rank >= 2 else {}
    return {
        "auto": attempt(),
        "flat": attempt(topology="flat"),
        "named": attempt(topology="2x2"),
        # a named layout that contradicts the launch: 4 one-rank nodes named "2x2", the 2 x 2 launch named "1x4"
        "2x2 on 4x1": attempt({"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "GROUP_RANK": str(rank)}, topology="2x2"),
        "1x4 on 2x2": attempt(topology="1x4"),
        "wrong size": attempt(topology="3x2"),
        "uneven": attempt({"LOCAL_WORLD_SIZE": "3"}),
        "not contiguous": attempt({"GROUP_RANK": str(rank % 2), "LOCAL_RANK": str(rank // 2)}),
        "disagree": attempt(lws),  # ranks 2, 3 say one node of 4 (flat), ranks 0, 1 nodes of 2
        "hooked": attempt(hook=True),
        # a user's subgroup (ranks {0, 1} and {2, 3}): torchrun's variables describe the world, so "auto" is flat
        "subgroup": attempt(process_group=torch.distributed.new_subgroups(2)[0]),
    }


def _step(ddp) -> dict:
    x, y = batches(0, 1)[0]
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    return ddp.comm_stats()


def _plain(rank: int, world: int, **opts) -> str:
    ddp = _wrap(**opts)
    return f"{ddp.config.topology} {sorted(k for k in _step(ddp) if 'node' in k)}"


def test_layouts_at_construction_and_errors_on_every_rank() -> None:
    results = run_distributed(_construction_cases, 4, ranks_per_node=2, timeout=180)
    for rank, r in enumerate(results):
        assert r["auto"] == "2x2 2x2 True"
        assert r["flat"] == "flat 4x1 False"
        assert r["named"] == "2x2 2x2 True"
        # every rank raises its own ValueError naming both layouts (no rank is left waiting in a collective)
        msg = r["2x2 on 4x1"]
        assert msg.startswith("ValueError: gradientflow: topology='2x2' (2 nodes of 2 ranks) contradicts"), msg
        assert "LOCAL_WORLD_SIZE=1, WORLD_SIZE=4 (4 nodes of 1 rank;" in msg, msg
        msg = r["1x4 on 2x2"]
        assert msg.startswith("ValueError: gradientflow: topology='1x4' (1 node of 4 ranks) contradicts"), msg
        assert "LOCAL_WORLD_SIZE=2, WORLD_SIZE=4 (2 nodes of 2 ranks;" in msg, msg
        assert r["hooked"] == "2x2 2x2 False"  # the layout is known, the hook's exchange is flat
        assert "topology='3x2' names 6 ranks, the process group has 4" in r["wrong size"]
        assert "LOCAL_WORLD_SIZE=3 does not split the 4 ranks" in r["uneven"] or "another rank" in r["uneven"]
        assert r["uneven"].startswith("ValueError") and "topology='flat'" in r["uneven"]
        # ranks 1 and 2 say node 1, local 0 and node 0, local 1: not rank = node * 2 + local; ranks 0 and 3 hear of it
        assert r["not contiguous"].startswith("ValueError")
        assert ("not contiguous per node" in r["not contiguous"]) == (rank in (1, 2)), r["not contiguous"]
        assert r["disagree"].startswith("ValueError: gradientflow: ranks resolved different node layouts"), r
        assert "topology='flat'" in r["disagree"]
        assert r["subgroup"] == "flat 2x1 False"
    # without torchrun's variables: flat, as before the option existed; no two-level counters
    assert run_distributed(_plain, 2) == ["flat ['nodes', 'ranks_per_node']"] * 2
    # ... where a named layout is taken as given: two-level on 2 "nodes" of 2 (how these tests emulate nodes)
    two_level = "2x2 ['inter_node_bytes', 'intra_node_bytes', 'nodes', 'ranks_per_node']"
    assert run_distributed(functools.partial(_plain, topology="2x2"), 4, timeout=120) == [two_level] * 4


# ---- checkpoints ------------------------------------------------------------------------------------
def _resume(rank: int, world: int, names: list[str]) -> dict:
    """Per recipe: 2 steps, a checkpoint (model, optimizer, comm state through torch.save), 2 more steps;
    then a fresh wrapper loads the checkpoint and runs the same 2 steps; then a flat wrapper loads it."""
    import copy

    data = batches(rank, 4)
    out: dict = {}

    def steps(ddp, opt, part) -> list[torch.Tensor]:
        params = []
        for x, y in part:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            params.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]))
        return params

    for name in names:
        ddp = _wrap(**RECIPES[name])
        opt = _optimizer(name, ddp.parameters())
        steps(ddp, opt, data[:2])
        buf = io.BytesIO()
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "comm": ddp.comm_state_dict()}, buf)
        uninterrupted = steps(ddp, opt, data[2:])
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=False)
        fresh = _wrap(**RECIPES[name])
        fresh.module.load_state_dict(ckpt["model"])
        opt2 = _optimizer(name, fresh.parameters())
        opt2.load_state_dict(copy.deepcopy(ckpt["opt"]))
        fresh.load_comm_state_dict(ckpt["comm"])
        resumed = steps(fresh, opt2, data[2:])
        try:
            _wrap(topology="flat", **RECIPES[name]).load_comm_state_dict(ckpt["comm"])
            onto_flat = "loaded"
        except ValueError as exc:
            onto_flat = f"ValueError: {exc}"
        out[name] = {
            "same": all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed)),
            "topology": ckpt["comm"].get("topology"),
            "onto_flat": onto_flat,
        }
    return out


def test_checkpoint_resumes_exactly_and_only_on_its_layout() -> None:
    names = ["quantized", "q2npw1", "csc", "auto-adamw"]
    for r in run_distributed(_resume, 4, names, ranks_per_node=2, timeout=240):
        for name in names:
            assert r[name]["same"], f"{name}: the resumed run differs from the uninterrupted one"
            assert r[name]["topology"] == "2x2"
        for name in ("quantized", "q2npw1", "auto-adamw"):  # the residual lives on the rank's shard
            msg = r[name]["onto_flat"]
            assert msg.startswith("ValueError") and "topology='2x2'" in msg and "topology='flat'" in msg, msg
        assert r["csc"]["onto_flat"] == "loaded"  # CSC's residuals are per rank, whatever the layout


def test_cost_model_runs_the_engines_plan() -> None:
    """``gradientflow simulate`` prices the two-level ring on the engine's own plan: its bytes are the
    engine's ``comm_stats()`` counters for the same buckets, and its time is those bytes over the links."""
    from gradientflow.comm.topology import two_level_plan
    from gradientflow.sim import SimConfig, allreduce_s
    from gradientflow.sim.cost import two_level_bytes

    cfg = SimConfig(
        bandwidth=1e9, latency=1e-5, batch=1, gpu_images_per_s=1.0, gpus_per_node=3, intra_bandwidth=4e9,
        intra_latency=1e-6,
    )  # fmt: skip
    plan = two_level_plan(1000, 2, 3)  # 1000 fp32 gradients on 2 nodes of 3
    want = 2 * 1e-6 + plan.intra_bytes / 4e9 + 1e-5 + 3 * plan.inter_bytes / 1e9  # 3 shards share the link
    assert allreduce_s(4000, 6, cfg, itemsize=4) == pytest.approx(want, rel=1e-12)
    assert two_level_bytes([1000, 7], 2, 3) == (plan.intra_bytes + 2 * 2 * 3 * 4, plan.inter_bytes + 3 * 4)


def _dense_counters(rank: int, world: int) -> tuple[list[int], int, int]:
    ddp = _wrap()
    _step(ddp)  # step 0 re-lays the pool out in the observed order: count step 1's buckets
    stats = _step(ddp)
    return [b.end - b.start for b in ddp.pool.layout.buckets], stats["intra_node_bytes"], stats["inter_node_bytes"]


def test_engine_counters_are_the_cost_models_bytes() -> None:
    from gradientflow.sim.cost import two_level_bytes

    for numels, intra, inter in run_distributed(_dense_counters, 4, ranks_per_node=2, timeout=120):
        assert len(numels) > 1
        assert two_level_bytes(numels, 2, 2) == (intra, inter)
