"""A mechanism is declared once and each door builds it from its form (``gradientflow.mechanisms``).

The contract (issue 69): a new mechanism added *through the registry alone* — one ``declare``, one ``form`` per door,
one recipe row — runs behind every door it declares (the DDP wrapper's buckets, ``gradientflow.fsdp.fully_shard``'s
shards, the outer exchange of ``sync_every``), and a door it declares no form for refuses it, in the registry's
words, on every rank before anything is built.  The toy here averages every coordinate in fp32 by a plain SUM
all-reduce of ``x / N``: its results are checked against the dense recipe's (``"none"``), which it must equal to
fp32 rounding (the same sum in a possibly different order of the backend's reduction).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from _dist import run_distributed

TOY = "toy-mean"  # the toy's recipe (and mechanism) name
OUTER_ONLY = "toy-outer-only"  # a second toy: an outer form only


def _register() -> None:
    """What a mechanism's author writes, and nothing else: run in every rank (each is its own process)."""
    from gradientflow import mechanisms
    from gradientflow.engine.protocol import SyncStrategy
    from gradientflow.fsdp.exchange import Sent
    from gradientflow.outer.exchange import Flight
    from gradientflow.recipes import Recipe, add_row

    if TOY in mechanisms.MECHANISMS:
        return
    mechanisms.declare(
        mechanisms.Mechanism(TOY, "every coordinate, fp32, averaged", (), frozenset({"ddp", "fsdp", "outer"}))
    )
    mechanisms.declare(mechanisms.Mechanism(OUTER_ONLY, "every coordinate, fp32, averaged", (), frozenset({"outer"})))

    class MeanSync(SyncStrategy):
        def __init__(self, group: dist.ProcessGroup) -> None:
            self.group, self.works = group, []

        def launch(self, bucket, flat, stats, divided=False):  # noqa: ANN001, ANN201
            if not divided:
                flat.div_(dist.get_world_size(self.group))
            self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))

        def finish(self, stats):  # noqa: ANN001, ANN201
            for work in self.works:
                work.wait()
            self.works = []

    @mechanisms.form(TOY, "ddp")
    def _ddp(config, parts, pool, shapes):  # noqa: ANN001, ANN202
        return MeanSync(parts.group)

    @mechanisms.form(TOY, "fsdp")
    def _fsdp(comm, kept):  # noqa: ANN001, ANN202
        group = comm.mesh.replicate

        def exchange(t: torch.Tensor) -> Callable[[], Sent]:  # posted on the shard; what it returns finishes it
            t.div_(dist.get_world_size(group))
            work = dist.all_reduce(t, group=group, async_op=True)

            def finish() -> Sent:
                work.wait()
                return Sent(t.numel() * 4, t.numel() * 4)

            return finish

        return exchange, None

    class MeanFlight(Flight):
        def post(self, fragment: int) -> None:
            dist.all_reduce(self.mine.div_(self.avg.parties), group=self.avg.group)

        def complete(self) -> None:
            pass

    mechanisms.form(TOY, "outer")(MeanFlight)
    mechanisms.form(OUTER_ONLY, "outer")(MeanFlight)
    summary, when = "every coordinate, fp32, by a plain all-reduce", "a test"
    add_row(Recipe(TOY, TOY, summary, when, {}, scopes=("per step", "outer")))
    add_row(Recipe(OUTER_ONLY, OUTER_ONLY, summary, when, {}, scopes=("per step", "outer")))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train(model: nn.Module, rank: int, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_worker(rank: int, world: int, toy: dict, dense: dict) -> float:
    import gradientflow as gf

    _register()
    ours = _train(gf.DistributedDataParallel(_mlp(), **toy), rank, 6)
    reference = _train(gf.DistributedDataParallel(_mlp(), **dense), rank, 6)
    return max((a - b).abs().max().item() for a, b in zip(ours, reference))


def test_a_mechanism_added_through_the_registry_runs_in_the_ddp_wrapper() -> None:
    """Per step: ``compression=`` the toy, against ``"none"``."""
    diffs = run_distributed(_ddp_worker, 2, {"compression": TOY}, {"compression": "none"}, timeout=120)
    assert max(diffs) < 1e-6, diffs


def test_a_mechanism_added_through_the_registry_runs_as_the_outer_exchange() -> None:
    """Every ``sync_every`` steps: ``outer_compression=`` the toy, against ``"none"`` (fp32 averaging)."""
    toy, dense = ({"sync_every": 2, "outer_compression": name} for name in (TOY, "none"))
    diffs = run_distributed(_ddp_worker, 2, toy, dense, timeout=120)
    assert max(diffs) < 1e-6, diffs


def _fsdp_worker(rank: int, world: int) -> float:
    from torch.distributed.device_mesh import init_device_mesh

    import gradientflow.fsdp as gff

    _register()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = []
    for compression in (TOY, "none"):
        net = _mlp()
        for block in (net[0], net[2], net):
            gff.fully_shard(block, mesh=mesh, compression=compression)
        results.append([p.full_tensor() for p in _train(net, rank, 4)])
    return max((a - b).abs().max().item() for a, b in zip(*results))


def test_a_mechanism_added_through_the_registry_runs_in_fully_shard() -> None:
    """2 nodes x 2 ranks: the toy is the reduction between nodes."""
    diffs = run_distributed(_fsdp_worker, 4, timeout=120)
    assert max(diffs) < 1e-6, diffs


def _refused_worker(rank: int, world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    import gradientflow as gf
    import gradientflow.fsdp as gff

    _register()
    out: dict[str, str] = {}
    attempts = {
        "ddp": lambda: gf.DistributedDataParallel(_mlp(), compression=OUTER_ONLY),
        "fsdp": lambda: gff.fully_shard(
            _mlp(), mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")), compression=OUTER_ONLY
        ),
        "outer": lambda: gf.DistributedDataParallel(_mlp(), sync_every=2, outer_compression="topk-fp16"),
    }
    for door, attempt in attempts.items():
        try:
            attempt()
            out[door] = "built"
        except ValueError as exc:
            out[door] = str(exc)
    return out


def test_a_door_without_a_form_refuses_the_mechanism_in_the_registrys_words_on_every_rank() -> None:
    """The toy with only an outer form, passed per step to the DDP wrapper and to fully_shard, and the per-step
    top-k (no outer form) passed as the outer exchange: a ``ValueError`` on every rank naming the mechanism, the door
    and the doors it is built for."""
    outs = run_distributed(_refused_worker, 2, timeout=120)
    for out in outs:
        assert f"mechanism {OUTER_ONLY!r}, which has no form for the DDP wrapper" in out["ddp"], out
        assert f"mechanism {OUTER_ONLY!r}, which has no form for gradientflow.fsdp.fully_shard" in out["fsdp"], out
        assert "it is built for the outer exchange of sync_every" in out["ddp"], out
        assert "mechanism 'topk', which has no form for the outer exchange of sync_every" in out["outer"], out
    assert outs[0] == outs[1]


def test_every_declared_form_of_the_shipped_mechanisms_is_registered() -> None:
    """Importing the doors registers every form the shipped mechanisms declare (none is declared and missing)."""
    import gradientflow.fsdp.module_comm  # noqa: F401 — registers the FSDP forms
    import gradientflow.outer.exchange  # noqa: F401 — the outer forms
    import gradientflow.sim.recipes  # noqa: F401 — the cost model's
    import gradientflow.strategies  # noqa: F401 — the DDP forms
    from gradientflow import mechanisms

    for name in ("dense", "topk", "quantized", "topk-quantized", "indexed-topk", "auto"):
        for door in mechanisms.doors_of(name):
            assert mechanisms.builder(name, door) is not None, (name, door)
