"""The cost model (``gradientflow simulate``): formulas by hand, invariants, CLI and JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch
from torch import nn

from gradientflow.bench.models import resolve_model
from gradientflow.cli import main
from gradientflow.diagnostics import extras
from gradientflow.diagnostics.extras import NO_PLOT
from gradientflow.sim import CONFIGS, ModelProfile, SimConfig, allreduce_s, ring_flat_s, simulate, tree_flat_s
from gradientflow.sim.config import parse_bandwidth
from gradientflow.sim.measure import fit_alpha_beta
from gradientflow.sim.model_profile import flop_profile, measured_profile
from gradientflow.sim.planner import THETAS_MB, best_theta, plan
from gradientflow.sim.presets import paper_values
from gradientflow.sim.schedule import PASSES, TOPK_3BIT, n_chunks
from gradientflow.strategies import csc_native


def tiny_net() -> nn.Module:
    """A user's model for the module:factory path (imported as ``test_sim:tiny_net``)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


class TokenLM(nn.Module):
    """A user's language model: token ids -> Embedding -> TransformerEncoder -> logits."""

    def __init__(self, vocab: int = 100, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 2 * d, batch_first=True), layers)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids)))


# ---- cost formulas, by hand -----------------------------------------------------------------
def test_ring_flat_by_hand():
    assert ring_flat_s(1e6, 4, 1e-5, 1e9) == pytest.approx(1e-5 + 1.5e-3)  # 2*3/4 * 1 ms
    assert ring_flat_s(1e6, 2, 0.0, 1e9) == pytest.approx(1e-3)
    assert ring_flat_s(1e6, 1, 1e-5, 1e9) == 0.0


def test_tree_flat_by_hand():
    assert tree_flat_s(1e6, 8, 1e-5, 1e9) == pytest.approx(6 * (1e-5 + 1e-3))
    assert tree_flat_s(1e6, 5, 0.0, 1e9) == pytest.approx(6e-3)  # ceil(log2 5) = 3 rounds each way


def _cfg(**kw) -> SimConfig:
    base = dict(bandwidth=1e9, latency=1e-5, batch=1, gpu_images_per_s=1.0, backward_fraction=0.5)
    return SimConfig(**{**base, **kw})


def test_two_level_ring_by_hand():
    cfg = _cfg(gpus_per_node=4, intra_bandwidth=4e9, intra_latency=1e-6)
    # 16 GPUs = 4 nodes x 4: reduce-scatter and all-gather in the node, a 4-node ring between
    want = 2 * (1e-6 + 3 / 4 * 8e6 / 4e9) + 1e-5 + 2 * 3 / 4 * 8e6 / 1e9
    assert allreduce_s(8e6, 16, cfg) == pytest.approx(want)
    assert allreduce_s(8e6, 4, cfg) == pytest.approx(1e-6 + 2 * 3 / 4 * 8e6 / 4e9)  # one node
    assert allreduce_s(8e6, 16, cfg, "tree") == pytest.approx(2 * 2 * (1e-6 + 2e-3) + 2 * 2 * (1e-5 + 8e-3))
    with pytest.raises(ValueError, match="multiple of --gpus-per-node"):
        allreduce_s(8e6, 10, cfg)


# ---- the schedule, by hand: 2 tensors, t(1) = 1 s (forward 0.5, backward 0.5) ----------------
HAND = ModelProfile("hand", numels=(1000, 3000), order=(1, 0), ready=(1.0, 0.5), source="hand")


@pytest.mark.parametrize(
    "config,want",
    [
        ("baseline", 1.0 + 2 * (0.01 + 1.2) + 2 * (0.01 + 0.4)),  # tree at N=2: 2 rounds of the whole tensor
        ("ring", 1.0 + (0.01 + 1.2) + (0.01 + 0.4)),  # after backward, one per tensor
        ("overlap", 0.75 + 1.21 + 0.41),  # tensor 1 ready halfway through backward
        ("fp16", 0.75 + 0.61 + 0.21),
        ("lazy", 1.0 + 0.01 + 0.8),  # θ = inf: one bucket at the end
        ("csc", 1.0 + (0.01 + 16 / 1e4) + (0.01 + 2 * 1000 * 2 / 1e4)),  # 4 chunks, 2 sent, + 4 fp32 scores
    ],
)
def test_schedule_by_hand(config, want):
    cfg = _cfg(bandwidth=1e4, latency=0.01, theta_mb=math.inf, density=0.5, chunk_size=1000)
    it = simulate(HAND, cfg, 2, config)
    assert it.iteration_s == pytest.approx(want)
    assert it.speedup == pytest.approx(2 * 1.0 / want)


def test_local_passes_are_charged_per_config():
    cfg = _cfg(bandwidth=1e4, latency=0.01, pass_bytes_per_s=16000.0)  # one pass over 16 KB = 1 s
    assert simulate(HAND, cfg, 2, "ring").iteration_s == pytest.approx(1.0 + 1.62 + 1.0)
    assert simulate(HAND, cfg, 2, "fp16").iteration_s == pytest.approx(0.75 + 0.61 + 0.21 + 3.0)  # div, cast, back
    half = dataclasses.replace(cfg, density=0.5, chunk_size=1000)  # 2 of the 4 chunks sent
    # autograd's accumulation into the residual (1 pass, lengthens backward), one score pass over the
    # pool, and clear/pack/unpack/mask over half of it: 1 + 1 + 4 * 0.5 passes
    assert simulate(HAND, half, 2, "csc").iteration_s == pytest.approx(
        1.0 + 1.0 + (0.01 + 16 / 1e4) + (0.01 + 0.4) + 3.0
    )
    measured = dataclasses.replace(
        HAND, local_s={"fp32": 0.1, "fp16": 0.2, "csc": 0.3, "csc_accumulate": 0.05, "csc_chunks": 0.2}
    )
    assert simulate(measured, cfg, 2, "ring").iteration_s == pytest.approx(1.0 + 1.62 + 0.1)
    assert simulate(measured, half, 2, "csc").iteration_s == pytest.approx(
        1.0 + 0.05 + (0.01 + 16 / 1e4) + (0.01 + 0.4) + 0.3 + 0.5 * 0.2
    )
    lazy = simulate(measured, dataclasses.replace(half, density=1.0), 2, "csc")  # every chunk: lazy, no passes of CSC
    assert lazy.iteration_s == simulate(measured, dataclasses.replace(half, density=1.0), 2, "lazy").iteration_s
    assert simulate(measured, cfg, 1, "csc").iteration_s == pytest.approx(1.0)  # one GPU: nothing to sync
    # "topk-3bit": its own density 0.3 whatever cfg's (ceil(0.3 * 4) = 2 of the 4 chunks), the 2000 gradients at 3 bits
    # + a bf16 scale per whole or partial 128 (750 + 16 * 2 = 782 bytes on a 2-rank ring: the engine's wire_bytes),
    # and the codec's passes ("quantized") on the selected half only
    codec = dataclasses.replace(measured, local_s={**measured.local_s, "quantized": 0.6})
    assert simulate(
        codec, dataclasses.replace(half, density=0.1), 2, "topk-3bit", TOPK_3BIT
    ).iteration_s == pytest.approx(1.0 + 0.05 + (0.01 + 16 / 1e4) + (0.01 + 782 / 1e4) + 0.3 + 0.5 * (0.2 + 0.6))


def test_n_chunks_matches_csc_arithmetic():
    assert n_chunks((4000,), 1000) == 4
    assert n_chunks((4001, 10), 1000) == 5 + 1


# ---- invariants on the real models ------------------------------------------------------------
@pytest.fixture(scope="module")
def resnet():
    name, factory = resolve_model("resnet50")
    return flop_profile(name, factory, (3, 224, 224)), SimConfig(**paper_values("resnet50"))


def test_flop_profile_is_backward_ordered(resnet):
    prof, _ = resnet
    assert prof.n_params == 25_557_032
    assert sorted(prof.order) == list(range(len(prof.numels)))
    assert prof.numels[prof.order[0]] == 1000  # fc bias: the first gradient backward produces
    assert [prof.ready[i] for i in prof.order] == sorted(prof.ready)


@pytest.mark.parametrize("gpus", [8, 64, 512])
def test_csc_at_density_one_is_lazy(resnet, gpus):
    prof, cfg = resnet
    lazy = simulate(prof, cfg, gpus, "lazy")
    dense_csc = simulate(prof, dataclasses.replace(cfg, density=1.0), gpus, "csc")
    assert dense_csc.iteration_s == pytest.approx(lazy.iteration_s)
    assert dense_csc.bytes_per_gpu == lazy.bytes_per_gpu
    assert simulate(prof, cfg, gpus, "csc").bytes_per_gpu < lazy.bytes_per_gpu / 9  # 10% of chunks + scores


def test_one_gpu_speedup_is_one(resnet):
    prof, cfg = resnet
    for c in CONFIGS:
        assert simulate(prof, cfg, 1, c).speedup == 1.0


@pytest.mark.parametrize("gpus_per_node", [1, 8])
def test_speedup_never_drops_when_bandwidth_grows(resnet, gpus_per_node):
    prof, cfg = resnet
    cfg = dataclasses.replace(cfg, gpus_per_node=gpus_per_node)
    for c in CONFIGS:
        for n in (8, 64, 512):
            s = [
                simulate(prof, dataclasses.replace(cfg, bandwidth=parse_bandwidth(f"{g}gbit")), n, c).speedup
                for g in (1, 5, 10, 25, 56, 100, 400)
            ]
            assert s == sorted(s), (c, n, s)


def test_planner_picks_a_theta_and_lists_every_system(resnet):
    prof, cfg = resnet
    assert best_theta(prof, cfg, 64) in THETAS_MB
    rows = plan(prof, cfg, [8, 64], densities=(0.1, 0.01))
    assert [r.system for r in rows[:5]] == [
        "DDP (fp32)",
        "DDP + fp16 hook",
        'gradientflow "fp16"',
        'gradientflow "topk-fp16" density 0.1',
        'gradientflow "topk-fp16" density 0.01',
    ]
    assert rows[3].result.bytes_per_gpu < rows[2].result.bytes_per_gpu


def test_fit_alpha_beta_by_hand():
    alpha, bw = fit_alpha_beta([(1e3, 1e-3 + 1e3 / 1e8), (1e7, 1e-3 + 1e7 / 1e8), (1e5, 0.5)])
    assert alpha == pytest.approx(1e-3) and bw == pytest.approx(1e8)


# ---- config validation and the CLI ---------------------------------------------------------
@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(density=0.0), "density must be in"),
        (dict(bandwidth=0.0), "bandwidth must be"),
        (dict(gpus_per_node=8), "needs intra_bandwidth"),
        (dict(latency=-1.0), "latency must be"),
        (dict(batch=0), "batch must be"),
        (dict(theta_mb=-1), "theta_mb must be"),
    ],
)
def test_config_rejects_with_a_hint(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _cfg(**kw)


def test_cli_json_schema(capsys):
    assert main(["simulate", "--preset", "paper", "--model", "alexnet", "--gpus", "1,8,64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"model", "assumptions", "rows"} and out["model"] == "alexnet"
    assert out["assumptions"]["bandwidth"] == 7e9 and "sources" in out["assumptions"]
    assert len(out["rows"]) == 3 * len(CONFIGS)
    types = {
        "gpus": int,
        "config": str,
        "iteration_s": float,
        "speedup": float,
        "efficiency": float,
        "bytes_per_gpu": int,
    }
    for row in out["rows"]:
        assert {k: type(v) for k, v in row.items()} == types
    assert [r["config"] for r in out["rows"][:6]] == list(CONFIGS)


def test_cli_user_model_table_plan_and_plot(capsys, tmp_path):
    png = tmp_path / "s.png"
    argv = [
        "simulate",
        "--model",
        "test_sim:tiny_net",
        "--input-shape",
        "3,8,8",
        "--bandwidth",
        "10gbit",
        "--gpu-images-per-s",
        "5000",
        "--gpus",
        "1,2,4",
        "--plan",
        "--plot",
        str(png),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| csc |" in out and 'gradientflow "topk-fp16" density 0.1' in out
    assert png.stat().st_size > 0


def test_cli_writes_a_plot_only_when_asked_and_claims_only_what_it_wrote(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["simulate", "--model", "test_sim:tiny_net", "--input-shape", "3,8,8", "--bandwidth", "10gbit"]
    argv += ["--gpu-images-per-s", "5000", "--gpus", "1,2"]
    assert main(argv) == 0
    assert "plot:" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # no PNG unasked in the current folder
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # matplotlib not installed: its import fails
    monkeypatch.setattr(extras, "_said_no_plot", False)  # said once per process: as in a fresh one
    assert main([*argv, "--plot", "asked.png"]) == 0
    out, err = capsys.readouterr()
    assert "| csc |" in out and "plot:" not in out
    assert err.strip() == NO_PLOT == "no plot written (pip install 'gradientflow[plot]')"
    assert not (tmp_path / "asked.png").exists()


def test_cli_profile_measures_here(capsys):
    prof = measured_profile("tiny", tiny_net, (3, 8, 8), batch=4, steps=1)
    assert prof.times is not None and all(t > 0 for t in prof.times)
    assert set(prof.local_s) == set(PASSES)
    # CSC's score costs nothing of its own where its C kernel sums it during the accumulation
    folded = {"csc"} if csc_native.available() else set()
    assert all(t > 0 for k, t in prof.local_s.items() if k not in folded), prof.local_s
    assert all(prof.local_s[k] == 0 for k in folded), prof.local_s
    assert (
        main(
            [
                "simulate",
                "--model",
                "test_sim:tiny_net",
                "--input-shape",
                "3,8,8",
                "--profile",
                "--bandwidth",
                "1gbit",
                "--gpus",
                "1,2",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["assumptions"]["profile"] == "profile"


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--model", "nosuchmodule:f", "--bandwidth", "1gbit", "--gpu-images-per-s", "1"], "cannot load --model"),
        (["--model", "vgg"], "module:factory"),
        (["--model", "alexnet", "--gpu-images-per-s", "100"], "give --bandwidth"),
        (["--model", "alexnet", "--bandwidth", "1gbit"], "give --gpu-images-per-s"),
        (["--preset", "paper", "--model", "alexnet", "--gpus", "12"], "multiple of --gpus-per-node"),
        (["--preset", "paper", "--model", "alexnet", "--density", "1.5"], "density must be in"),
    ],
)
def test_cli_invalid_options_say_what_to_do(argv, msg, capsys):
    assert main(["simulate", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_cli_bad_units_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--bandwidth", "fast"])
    assert exc.value.code == 2
    assert "56gbit" in capsys.readouterr().err


def test_validate_predicts_every_bench_mode_and_scales_to_the_bench_compute():
    from gradientflow.sim.validate import predict, table

    row = dict(sweep=False, status="ok", p10_s=0.1, p90_s=0.3, speedup=1.0)
    bench = {
        "options": {"workload": "small_cnn", "batch_size": 4, "fusion_mb": 25.0},
        "world_size": 2,
        "chunk_size": 1024,
        "threads_per_rank": 1,
        "rows": [
            {**row, "name": m, "mode": m, "median_s": 0.2}
            for m in ("compute", "gf-none", "gf-topk-fp16:csc_scope=global")
        ],
    }
    preds, assumptions = predict(bench, {"alpha_s": 1e-3, "bandwidth_Bps": 1e8}, steps=1)
    assert set(preds) == {"compute", "gf-none", "gf-topk-fp16:csc_scope=global"}
    assert preds["compute"][1].iteration_s == pytest.approx(0.2)  # scaled to the bench's compute mode
    assert preds["gf-none"][1].iteration_s > 0.2 and preds["gf-none"][1].collectives == 1
    assert preds["gf-topk-fp16:csc_scope=global"][1].collectives == 2  # scores, then the packed chunks
    md, rows = table(bench, preds)
    assert len(rows) == 3 and md.count("\n") == 5
    assert preds["gf-none"][2].iteration_s >= preds["gf-none"][1].iteration_s  # no overlap: never faster


def test_cli_token_model_gets_token_ids(capsys):
    """``--model mod:fn --input-shape 64`` on an Embedding + TransformerEncoder model: its first layer is an
    Embedding, so the probe input is int64 token ids (or as --input-dtype says)."""
    argv = ["simulate", "--model", "test_sim:TokenLM", "--input-shape", "16", "--bandwidth", "1gbit"]
    argv += ["--gpu-images-per-s", "100", "--gpus", "1,2", "--json"]
    assert main(argv) == 0
    n_params = sum(p.numel() for p in TokenLM().parameters())
    assert json.loads(capsys.readouterr().out)["assumptions"]["n_params"] == n_params
    assert main([*argv, "--input-dtype", "long"]) == 0
    assert main([*argv, "--profile", "--batch", "2"]) == 0  # timed here, on real ids
    capsys.readouterr()
    assert main([*argv, "--input-dtype", "float"]) == 2
    assert "--input-dtype long" in capsys.readouterr().err


def test_flop_profile_of_a_transformer_orders_attention_weights_by_layer():
    """The attention projections (used through F.multi_head_attention_forward, by no leaf module) are
    ready when their layer is walked back: the last layer's first, the embedding last."""
    prof = flop_profile("lm", TokenLM, (16,))
    names = [n for n, p in TokenLM().named_parameters()]
    ready = dict(zip(names, prof.ready))
    first, last = "enc.layers.0.self_attn.in_proj_weight", "enc.layers.1.self_attn.in_proj_weight"
    assert ready["head.weight"] < ready[last] < ready[first] < 1.0
    assert ready["emb.weight"] == 1.0


# ---- nodes of several ranks: the engine's two-level exchange, and the bench's layout --------------
def test_exchange_by_hand_two_level_flat_and_quantised():
    from gradientflow.sim.cost import exchange_s
    from gradientflow.sim.schedule import THREE_BIT

    cfg = _cfg(bandwidth=1e4, latency=0.01, gpus_per_node=2, intra_bandwidth=1e5, intra_latency=0.001)
    # 2 nodes x 2, 4000 fp32 gradients: shards of 2000; inside the node a reduce-scatter and an
    # all-gather of one shard each (2 x 8000 B at 1e5 B/s), between nodes 2 concurrent 2-rank rings of
    # one shard (each 2 (M-1)/M x 8000 B) sharing the link
    assert exchange_s(4000, 4, cfg, 4) == pytest.approx(2 * 0.001 + 0.16 + 0.01 + 1.6)
    # flat: one ring over the 4 ranks, its slowest hops on the link: 2 x 3/4 x 16000 B
    assert exchange_s(4000, 4, cfg, 4, flat=True) == pytest.approx(0.01 + 2.4)
    # the quantised recipe's flat direct exchange: each node's 2 ranks send 2/4 of 1563 B twice
    q = dict(intra_wire=4, block=THREE_BIT.block, direct=True)
    assert exchange_s(4000, 4, cfg, THREE_BIT.wire_bytes, flat=True, **q) == pytest.approx(
        0.01 + 2 * 2 * 2 / 4 * 1563 / 1e4
    )
    # two-level: 32 blocks of 128 -> shards of 2048 gradients; fp32 inside, 800 quantised bytes between
    assert exchange_s(4000, 4, cfg, THREE_BIT.wire_bytes, **q) == pytest.approx(
        0.002 + 2 * 2048 * 4 / 1e5 + 0.01 + 2 * 800 / 1e4
    )
    assert exchange_s(4000, 2, cfg, 4) == pytest.approx(0.001 + 16000 / 1e5)  # one node: its own ring
    one = _cfg(bandwidth=1e4, latency=0.01)  # one rank per node: flat and two-level are the same ring
    assert exchange_s(4000, 4, one, 4) == exchange_s(4000, 4, one, 4, flat=True) == pytest.approx(0.01 + 2.4)


def _results(nodes: int | None, per_node: int | None, world: int = 4, optimizer: str = "adamw") -> dict:
    """A bench's results.json, trimmed to what validate reads (recorded by `gradientflow bench`)."""
    row = dict(sweep=False, alone=False, status="ok", p10_s=1.0, p90_s=4.0, speedup=1.0, median_s=2.0)
    modes = ("compute", "gf-none", "gf-none@flat", "gf-fp16", "gf-auto", "gf-auto@flat", "ddp", "ddp-powersgd")
    out = {
        "options": {"workload": "small_cnn", "batch_size": 1, "fusion_mb": 1.0, "optimizer": optimizer},
        "world_size": world,
        "chunk_size": 1000,
        "rows": [{**row, "name": m, "mode": m} for m in modes],
    }
    if nodes is not None:
        out["nodes"], out["nproc_per_node"] = nodes, per_node
    return out


def test_bench_layout_and_mode_plan_from_results_json():
    from gradientflow.sim.planner import DDP
    from gradientflow.sim.schedule import TECHNIQUES, THREE_BIT
    from gradientflow.sim.validate import bench_layout, mode_plan

    assert bench_layout(_results(2, 2)) == (2, 2)
    assert bench_layout(_results(None, None, world=2)) == (2, 1)  # before the layout was recorded
    with pytest.raises(ValueError, match="world size 4"):
        bench_layout(_results(3, 2))
    assert mode_plan("gf-fp16@flat", "sgd", (2, 2)) == (TECHNIQUES["lazy"], True)
    assert mode_plan("gf-fp16", "sgd", (2, 2)) == (TECHNIQUES["lazy"], False)
    assert mode_plan("gf-fp16@2x2", "sgd", (2, 2)) == (TECHNIQUES["lazy"], False)
    assert mode_plan("gf-auto", "adamw", (2, 2)) == (THREE_BIT, False)
    # "auto" with SGD is "topk-3bit" at 0.5 beyond a pair of ranks, as the engine runs it; on 2 ranks the recipe's 0.3
    denser = dataclasses.replace(TOPK_3BIT, density=0.5)
    assert mode_plan("gf-auto@flat", "sgd", (2, 2)) == (denser, True)
    assert mode_plan("gf-auto", "sgd", (2, 2)) == (denser, False)
    assert mode_plan("gf-auto", "sgd", (3, 1)) == (denser, False)
    assert mode_plan("gf-auto", "sgd", (2, 1)) == (TOPK_3BIT, False)
    assert mode_plan("ddp", "sgd", (2, 2)) == (DDP, True)  # torch DDP: a flat ring whatever the layout
    assert mode_plan("ddp-powersgd", "sgd", (2, 2)) is None
    with pytest.raises(ValueError, match="layout 2x2"):
        mode_plan("gf-fp16@1x4", "sgd", (2, 2))


def test_validate_predicts_a_recorded_2x2_results_json_by_hand():
    """2 nodes x 2 ranks: one bucket of 4000 gradients ready at the end of a 1 s step (forward 0.5,
    backward 0.5), link α 0.01 s / B 1e4 B/s, inside the node α 0.001 s / B 1e5 B/s."""
    from gradientflow.sim.validate import bench_config, predict_rows

    bench = _results(2, 2)
    prof = dataclasses.replace(HAND, times=(0.5, 0.5, 0.0))
    with pytest.raises(ValueError, match="loopback"):
        bench_config(bench, {"alpha_s": 0.01, "bandwidth_Bps": 1e4}, None, 1.0)
    cfg = bench_config(bench, {"alpha_s": 0.01, "bandwidth_Bps": 1e4}, {"alpha_s": 0.001, "bandwidth_Bps": 1e5}, 1.0)
    assert (cfg.gpus_per_node, cfg.intra_bandwidth, cfg.intra_latency) == (2, 1e5, 0.001)
    got = {k: v[0].iteration_s for k, v in predict_rows(bench, prof, prof, cfg).items()}
    want = {
        "compute": 1.0,
        "gf-none": 1.0 + (0.002 + 0.16) + (0.01 + 1.6),  # two-level, fp32 at both levels
        "gf-none@flat": 1.0 + 0.01 + 2.4,  # one 4-rank ring: 1.5 x 16000 B over the link
        "gf-fp16": 1.0 + (0.002 + 0.08) + (0.01 + 0.8),  # the same in fp16
        "gf-auto": 1.0 + (0.002 + 0.16384) + (0.01 + 0.16),  # AdamW: quantised, fp32 inside the node
        "gf-auto@flat": 1.0 + 0.01 + 0.3126,  # its direct exchange: 2 x 2 x 2/4 x 1563 B per link
        "ddp": 1.0 + 0.01 + 2.4,  # torch DDP is flat
    }
    assert got == pytest.approx(want)


def test_cli_validate_a_2x2_bench_end_to_end(capsys, tmp_path):
    """`simulate --validate` on a recorded 2 x 2 results.json: without the intra-node fit it says what to
    measure; with it, one row per mode it models, flat twins included, into --validate-out."""
    bench = _results(2, 2)
    bench["threads_per_rank"], bench["host"] = 1, {"cpus": 2}
    (tmp_path / "results.json").write_text(json.dumps(bench))
    fit = {"fits": {"native": {"alpha_s": 1e-3, "bandwidth_Bps": 1e8}}}
    (tmp_path / "link.json").write_text(json.dumps(fit))
    (tmp_path / "lo.json").write_text(json.dumps({"fits": {"native": {"alpha_s": 1e-4, "bandwidth_Bps": 1e9}}}))
    argv = ["simulate", "--validate", str(tmp_path / "results.json"), "--alpha-beta", str(tmp_path / "link.json")]
    assert main(argv) == 2
    assert "measure --loopback" in capsys.readouterr().err
    assert main([*argv, "--loopback-fit", str(tmp_path / "lo.json"), "--validate-out", str(tmp_path / "v")]) == 0
    out = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert out["assumptions"]["layout"] == "2x2" and out["assumptions"]["oversubscribed"]  # 4 ranks, 2 cores
    assert [r["mode"] for r in out["rows"]] == [
        "compute",
        "gf-none",
        "gf-none@flat",
        "gf-fp16",
        "gf-auto",
        "gf-auto@flat",
        "ddp",
    ]
    assert all(r["predicted_model_s"] == r["predicted_no_overlap_s"] for r in out["rows"])
