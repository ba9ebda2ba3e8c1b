"""The FSDP door in FSDP2 users' own code (issue 71): their hooks, their meshes, their imports, their checkpoints.

Each finding is a user's line that torch's ``fully_shard`` takes: the same line on gradientflow's must do what
torch's HSDP does (its hook after the reduction between nodes, any named 2-D mesh by position, every name of
``torch.distributed.fsdp``), or raise on every rank what to pass.  Torch's HSDP on the same mesh is the oracle
wherever it has an answer; the ranks run on Gloo loopback (tests/_dist.py), 2 x 2 as tests/test_fsdp.py does.
"""

from __future__ import annotations

import warnings

import torch
from test_fsdp import _full_params, _loss, _net, _replicas_identical, _train

from _dist import run_distributed

# ---- 1. the user's all-reduce hook runs after gradientflow's reduction, as after torch HSDP's all-reduce ----------


def _blocks(net):
    return (net[0], net[2], net)


def _observed_run(rank: int, kind: str, mesh, compression: str) -> dict:
    """Each block's all-reduce hook set by the user (an observer: it copies what it receives), 2 steps, the second
    accumulated over 3 micro-steps under ``set_requires_all_reduce(False)`` (torch HSDP calls no hook for the held
    ones)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from gradientflow.fsdp import fully_shard

    net = _net()
    seen: list[torch.Tensor] = []
    for block in _blocks(net):
        if kind == "torch":
            torch_fully_shard(block, mesh=mesh)
        else:
            fully_shard(block, mesh=mesh, compression=compression)
    for block in _blocks(net):
        block.set_all_reduce_hook(lambda t: seen.append(t.clone()))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    _loss(net, rank, 0).backward()
    opt.step()
    opt.zero_grad()
    for micro in range(3):
        net.set_requires_all_reduce(micro == 2)
        _loss(net, rank, 1 + micro).backward()
    opt.step()
    return {"seen": seen, "params": _full_params(net), "identical": _replicas_identical(net, mesh)}


def _hooks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradientflow.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict = {}
    torch_run = _observed_run(rank, "torch", mesh, "none")
    none_run = _observed_run(rank, "gf", mesh, "none")
    q_run = _observed_run(rank, "gf", mesh, "3bit")
    out["calls"] = (len(torch_run["seen"]), len(none_run["seen"]), len(q_run["seen"]))
    # "none" is torch's HSDP reduction: the user's hook must see torch's reduced shards, bit for bit
    out["same_seen"] = all(torch.equal(a, b) for a, b in zip(torch_run["seen"], none_run["seen"]))
    out["same_params"] = all(torch.equal(a, b) for a, b in zip(torch_run["params"], none_run["params"]))
    out["identical"] = (none_run["identical"], q_run["identical"])
    # what the 3-bit hook saw is the reduced shard: the same on both nodes (an unreduced one differs between them)
    import torch.distributed as dist

    group = mesh.get_group("replicate")
    seen_here = torch.cat([t.flatten() for t in q_run["seen"]])
    every = [torch.empty_like(seen_here) for _ in range(2)]
    dist.all_gather(every, seen_here, group=group)
    out["q_seen_replicated"] = torch.equal(every[0], every[1])
    # a stream: torch refuses one under its native HSDP (the hook runs on the all-reduce's stream); so does ours
    net = _net()
    fully_shard(net, mesh=mesh, compression="3bit")
    try:
        net.set_all_reduce_hook(lambda t: None, stream=object())  # type: ignore[arg-type]
        out["stream"] = ""
    except ValueError as exc:
        out["stream"] = str(exc)
    return out


def test_a_users_observing_hook_runs_after_the_reduction_and_the_replicas_stay_identical() -> None:
    for r in run_distributed(_hooks, 4, timeout=180):
        # 3 blocks x (step 0 + the last micro-step of step 1): torch HSDP calls no hook on a held micro-step
        assert r["calls"] == (6, 6, 6), r["calls"]
        assert r["same_seen"] and r["same_params"]
        assert r["identical"] == (True, True)
        assert r["q_seen_replicated"]
        assert "stream cannot be set" in r["stream"] and "HSDP" in r["stream"]


# ---- 2. torch's mesh rules: any named 2-D mesh by position; one that contradicts the launch refused ---------------


def _named_by_position(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from gradientflow.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))
    runs = {}
    for kind in ("torch", "gf"):
        net = _net()
        for block in _blocks(net):
            if kind == "torch":
                torch_fully_shard(block, mesh=mesh)
            else:
                fully_shard(block, mesh=mesh, compression="none")
        runs[kind] = _train(net, rank, 3, mesh=None)["params"]
    q = _net()
    for block in _blocks(q):
        fully_shard(block, mesh=mesh, compression="3bit")
    from gradientflow.fsdp import comm_stats

    q_run = _train(q, rank, 2)
    return {
        "diff": max((a - b).abs().max().item() for a, b in zip(runs["torch"], runs["gf"])),
        "nodes": comm_stats(q)["nodes"],
        "per_node": comm_stats(q)["ranks_per_node"],
        "moved": max((a - b).abs().max().item() for a, b in zip(runs["gf"], q_run["params"])),
        "identical": _replicas_identical_on(q, mesh, "outer"),
    }


def _replicas_identical_on(net, mesh, dim: str) -> bool:
    import torch.distributed as dist

    group = mesh.get_group(dim)
    for p in net.parameters():
        local = p.to_local().detach().contiguous()
        every = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, local, group=group)
        if any(not torch.equal(e, local) for e in every):
            return False
    return True


def test_any_named_2d_mesh_is_hsdp_by_position() -> None:
    for r in run_distributed(_named_by_position, 4, timeout=180):
        assert r["diff"] == 0.0  # torch's HSDP on ("outer", "inner") and "none" on it: the same collectives
        assert (r["nodes"], r["per_node"]) == (2, 2)  # dimension 0 between nodes, 1 inside: by position
        assert r["identical"]  # replicated along dimension 0 ("outer"): the 3-bit exchange ran between its rows
        assert 0 < r["moved"] < 0.05  # 3-bit AdamW, 2 steps of lr 1e-2 against 3 of "none": trained, not blown up


def _against_launch(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradientflow.fsdp import fully_shard

    out = {}
    for shape in ((1, 4), (4, 1)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        try:
            fully_shard(_net(), mesh=mesh, compression="3bit")
            out[shape] = ""
        except ValueError as exc:
            out[shape] = str(exc)
    return out


def test_a_mesh_that_contradicts_the_launch_is_refused_on_every_rank() -> None:
    for r in run_distributed(_against_launch, 4, timeout=120, ranks_per_node=2):  # torchrun: 2 nodes of 2
        for shape in ((1, 4), (4, 1)):
            message = r[shape]
            assert f"mesh {shape[0]} x {shape[1]}" in message, message  # names the mesh...
            assert "LOCAL_WORLD_SIZE=2" in message and "2 nodes of 2 ranks" in message, message  # ...and the launch
            assert "hsdp_mesh()" in message  # what to pass


# ---- every bad input raised on every rank: the ranks' settings differ --------------------------------------------


def _mismatch(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradientflow.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    cases = {
        "rank 0 alone": {"compression": "3bit" if rank == 0 else "fp16"},
        "by local rank": {"compression": "3bit" if rank % 2 == 0 else "fp16"},
        "by node": {"compression": "3bit" if rank < 2 else "fp16"},
        # ranks 1 and 3 pass an option the recipe does not read: their own check refuses it before any collective
        "refused on some": {"compression": "3bit", **({"density": 0.1} if rank % 2 else {})},
    }
    out = {}
    for name, options in cases.items():
        try:
            fully_shard(_net(), mesh=mesh, **options)
            out[name] = ("returned", "")
        except Exception as exc:  # noqa: BLE001 — the test says which type each rank raised
            out[name] = (type(exc).__name__, str(exc))
    return out


def test_ranks_passing_different_settings_raise_the_same_error_on_every_rank() -> None:
    results = run_distributed(_mismatch, 4, timeout=120)
    for name in ("rank 0 alone", "by local rank", "by node", "refused on some"):
        kinds = [r[name][0] for r in results]
        assert kinds == ["ValueError"] * 4, (name, [r[name] for r in results])
        assert len({r[name][1] for r in results}) == 1, name  # the same words everywhere
    message = results[0]["rank 0 alone"][1]
    assert "rank 0: 3bit" in message and "rank 3: fp16" in message, message
    refused = results[0]["refused on some"][1]
    assert "density=0.1 has no effect" in refused and "ranks 1, 3" in refused, refused


# ---- 3. the one-line import ----------------------------------------------------------------------------------------


def test_gradientflow_fsdp_offers_every_name_torch_distributed_fsdp_exports() -> None:
    import torch.distributed.fsdp as torch_fsdp

    import gradientflow.fsdp as gf_fsdp
    from gradientflow.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    assert MixedPrecisionPolicy is torch_fsdp.MixedPrecisionPolicy and FSDPModule is torch_fsdp.FSDPModule
    assert fully_shard is not torch_fsdp.fully_shard  # ours: torch's on the shard submesh plus the recipe
    missing = [n for n in torch_fsdp.__all__ if not hasattr(gf_fsdp, n)]
    assert not missing, missing
    others = [n for n in torch_fsdp.__all__ if n != "fully_shard" and getattr(gf_fsdp, n) is not getattr(torch_fsdp, n)]
    assert not others, others  # every other name is torch's own object: isinstance and type checks still hold
    assert set(torch_fsdp.__all__) <= set(gf_fsdp.__all__)


# ---- 4. a resume through the user's own DCP code, without gradientflow's state -------------------------------------


def _resume(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from gradientflow.fsdp import comm_state, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    plain = _net()  # the model's state dict is torch's, key for key: a plain model loads it strictly
    plain_keys = set(plain.state_dict())

    def build():
        net = _net()
        for block in _blocks(net):
            fully_shard(block, mesh=mesh, compression="3bit")
        return net, torch.optim.AdamW(net.parameters(), lr=1e-2)

    net, opt = build()
    for step in range(2):
        _loss(net, rank, step).backward()
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(net, opt)
    out["keys"] = set(model_sd) == plain_keys
    plain.load_state_dict({k: v.full_tensor() for k, v in model_sd.items()}, strict=True)
    dcp.save({"model": model_sd, "optim": optim_sd, "gradientflow": comm_state(net)}, checkpoint_id=path)
    # with gradientflow's line first (the warning is said once per process), then torch's docs' checkpointer alone
    for with_state in (True, False):
        fresh, fresh_opt = build()
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        state = {"model": model_sd, "optim": optim_sd}
        if with_state:
            state["gradientflow"] = comm_state(fresh)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.load(state, checkpoint_id=path)
            set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            for step in range(2, 4):  # the first step after the resume: where the residual would have been added
                _loss(fresh, rank, step).backward()
                fresh_opt.step()
                fresh_opt.zero_grad()
        out[with_state] = [str(w.message) for w in caught if "gradientflow" in str(w.message)]
    return out


def test_a_resume_without_the_recipe_state_warns_once_on_rank_0(tmp_path) -> None:
    results = run_distributed(_resume, 4, str(tmp_path / "ckpt"), timeout=180)
    without = results[0][False]
    assert len(without) == 1, without  # once, for the whole model (3 modules)
    assert "residual" in without[0] and "comm_state(model)" in without[0], without[0]  # what is lost, the line
    assert all(not r[False] for r in results[1:])  # rank 0 alone
    assert all(not r[True] for r in results)  # with gradientflow's entry: nothing to say
    assert all(r["keys"] for r in results)


def _extra_state(rank: int, world: int, path: str) -> dict:
    """What docs/fsdp.md says of the other design, the recipe state inside the model's state dict (a module's
    ``get_extra_state``, which torch's ``get_state_dict`` returns with no new line): DCP carries a DTensor in it per
    rank and a plain value once; a plain torch model's strict load refuses the key."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    class Kept(torch.nn.Linear):
        def get_extra_state(self) -> dict:
            return {"residual": DTensor.from_local(self.kept, mesh, [Shard(0), Shard(0)], run_check=False), "n": self.n}

        def set_extra_state(self, state: dict) -> None:
            self.n = state["n"]

    def build(value: int):
        net = torch.nn.Sequential(Kept(4, 4))
        net[0].kept, net[0].n = torch.full((3,), float(value)), value
        fully_shard(net, mesh=mesh)
        return net, torch.optim.AdamW(net.parameters())

    net, opt = build(10 + rank)
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh, fresh_opt = build(0)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    out = {"residual": fresh[0].kept.tolist(), "n": fresh[0].n}
    try:
        torch.nn.Sequential(torch.nn.Linear(4, 4)).load_state_dict(
            {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model_sd.items()}
        )
        out["plain"] = ""
    except RuntimeError as exc:
        out["plain"] = str(exc)
    return out


def test_the_state_in_the_models_state_dict_would_travel_but_break_a_plain_load(tmp_path) -> None:
    results = run_distributed(_extra_state, 4, str(tmp_path / "ckpt"), timeout=120)
    assert [r["residual"] for r in results] == [[10.0 + r] * 3 for r in range(4)]  # each rank's own, in place
    assert len({r["n"] for r in results}) == 1  # a plain value: one rank's, saved once (so not a rank's own count)
    assert all('Unexpected key(s) in state_dict: "0._extra_state"' in r["plain"] for r in results)


# ---- docs/fsdp.md's snippets, run as pasted ------------------------------------------------------------------------


class _Layered(torch.nn.Module):
    """The page's ``model``: blocks under ``model.layers``, as torchtitan's models hold them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _page_snippets() -> list[str]:
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "fsdp.md").read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```", page, flags=re.S)


def _snippets(rank: int, world: int, path: str) -> dict:
    snippets = _page_snippets()
    fewer = [code for code in snippets if "sync_every" in code]  # fewer syncs: a model of its own, sharded by it
    snippets = [code for code in snippets if "sync_every" not in code]
    sync_every = []
    for code in fewer:
        own: dict = {"device": "cpu", "nodes": 2, "per_node": 2, "model": _Layered()}
        exec(compile(code, "docs/fsdp.md (fewer syncs)", "exec"), own)
        opt = torch.optim.AdamW(own["model"].parameters(), lr=1e-2)
        own["model"](torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).sum().backward()
        opt.step()
        from gradientflow.fsdp import comm_stats as stats_of

        sync_every.append((stats_of(own["model"])["sync_every"], stats_of(own["model"])["inner_steps"]))
    ns: dict = {"device": "cpu", "nodes": 2, "per_node": 2, "model": _Layered()}  # what the page says is the user's
    exec(compile(snippets[0], "docs/fsdp.md#1", "exec"), ns)
    model = ns["model"]
    ns["optimizer"] = optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ns["path"] = path
    for step in range(2):  # the user's training: "auto" switches at the first step, then has residuals to save
        model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank + 10 * step))).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, code in enumerate(snippets[1:], start=2):
            exec(compile(code, f"docs/fsdp.md#{i}", "exec"), ns)
        model(torch.randn(4, 6)).sum().backward()
    from gradientflow.fsdp import comm_stats

    return {
        "snippets": len(snippets),
        "sync_every": sync_every,
        "compression": comm_stats(model)["compression"],
        "warned": [str(w.message) for w in caught if "gradientflow" in str(w.message)],
    }


def test_the_pages_snippets_run_as_pasted(tmp_path) -> None:
    for r in run_distributed(_snippets, 4, str(tmp_path / "ckpt"), timeout=180, ranks_per_node=2):
        # the one-import change, the checkpoint, torchtitan's import line (a new snippet joins this test)
        assert r["snippets"] == 3
        assert r["sync_every"] == [(100, 1)]  # the fewer-syncs snippet: its loop counted the one inner step
        assert r["compression"] == "3bit"  # "auto" for AdamW on 2 nodes, picked and resumed
        assert r["warned"] == []  # the page's checkpoint keeps the recipe state: nothing to warn of
