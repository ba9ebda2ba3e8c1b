"""``gradientflow bench --quality``: does fp16 + CSC train as well as torch DDP, and how fast?

Two workloads, each trained by several *recipes* side by side in one launch of the ranks, from the
same seed and on the same batches (each recipe draws its batches from its own generator seeded per
rank), step by step interleaved after a barrier:

- ``transformer``: a character-level :class:`~gradientflow.bench.models.TinyTransformer` on Python's
  own help topics (``pydoc_data.topics``, split by topic 90/10 into train/validation), AdamW (or SGD momentum);
- ``digits``: ``small_cnn`` on scikit-learn's digits (the demo's split), SGD with momentum 0.9;

both under linear LR warm-up then cosine decay to 10%.  Recipes (:data:`~.quality_recipes.RECIPES`): ``ddp`` (torch
DDP, dense fp32: the oracle), ``gf-recommended`` (fp16 wire + CSC density 0.1 with the library's
defaults otherwise, the user's optimizer untouched), ``gf-density-0.3`` (the same at density 0.3:
three times the bytes, for optimizers that lose quality at 0.1), ``gf-paper`` (fp16 + CSC 0.1 + momentum
correction 0.9 with plain SGD and a short dense warm-up), ``gf-fp16-dense`` and ``ddp-sgd`` (torch
DDP with gf-paper's SGD, the oracle of gf-paper where the user's optimizer differs from it).

With ``--bandwidth`` (and root) a second launch, ``tta``, trains with ``ddp`` and ``gf-recommended``
(the transformer also with ``gf-fp16-dense`` and ``gf-density-0.3``, :data:`TTA_RECIPES`) on an
emulated cluster and records the training wall clock at each validation point (validation itself is
outside the clock), for time to accuracy: a bigger transformer (AdamW) and ``digits_wide`` (SGD momentum;
AlexNet-shaped: nearly all of its 8.4M parameters in fully connected layers, so communication-bound).

Recipes, what each builds: :mod:`.quality_recipes`; the jobs handed to the ranks: :mod:`.quality_spec`.
Worker: :mod:`.quality_worker` (under torchrun); report: :mod:`.quality_report`; plots: :mod:`.quality_plot`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradientflow.bench.quality_peers import TORCH_PEERS
from gradientflow.bench.quality_recipes import RECIPES, TABLE_RECIPES, parse_recipe
from gradientflow.bench.quality_spec import Job, QualitySpec
from gradientflow.bench.quality_torchft import TORCHFT_PEERS
from gradientflow.bench.quality_torchft import check as check_torchft
from gradientflow.bench.sharded import SHARDED_MODES

logger = logging.getLogger(__name__)

_TTA_TRANSFORMER = "ddp gf-auto gf-auto:steps=1.2 gf-fp16-dense ddp-fp16-hook ddp-powersgd ddp-postlocal"
TTA_RECIPES = {"transformer": _TTA_TRANSFORMER.split(), "digits": ["ddp", "gf-recommended", "gf-auto"]}
"""Recipes on the clock.  The transformer's AdamW loses quality at density 0.1, so its user's two
alternatives (fp16 alone, density 0.3) are timed too; digits' SGD momentum keeps it.  ``gf-auto`` ends
within ~1% of DDP's loss at equal steps, a hair above it: ``gf-auto:steps=1.2`` (20% more steps, each
a fraction of DDP's) measures its time to DDP's final loss itself."""
DIGITS_ADAMW_LR = 3e-4
"""Peak LR of the digits jobs' AdamW (``--digits-optimizer adamw``; betas (0.9, 0.95), weight decay 0.1 as the
transformer's): digits_wide alone on one process, batch 64, 300 steps, ended at validation loss 0.105 with it
against 0.117 at 1e-3, which overfits from step 150 on (2026-12-05)."""
WORKLOAD_OF_CLI = {"tiny_transformer": "transformer", "small_cnn": "digits"}
"""``--workload`` names (the bench's models) of the quality workloads."""


@dataclass
class QualityOptions:
    """Options of ``gradientflow bench --quality`` (see ``gradientflow bench --help``)."""

    workloads: list[str] = field(default_factory=lambda: ["transformer", "digits"])
    recipes: list[str] | None = None  # None: every recipe that applies to the workload
    nproc: int = 2  # ranks in all
    nproc_per_node: int = 1  # ranks per node: nproc / nproc_per_node nodes, each one torchrun (c10d across)
    steps: int = 400
    tta_steps: int = 300
    eval_every: int | None = None  # None: steps // 20
    batch_size: int | None = None  # None: 16 windows (transformer), 32 images (digits), 8 windows (tta)
    transformer_size: tuple[int, int] = (128, 2)  # (d_model, layers)
    tta_size: tuple[int, int] = (256, 4)
    tta_model: str = "digits_wide"  # digits' time-to-accuracy network
    tta_recipes: list[str] | None = None  # None: TTA_RECIPES; else these (ddp always added) for every tta job
    bandwidth: str = "1gbit"
    quality_on_link: bool = False  # the quality launch behind the link (what "auto" measures), no time-to-accuracy
    adamw_lr: float | None = None  # the quality transformer's AdamW peak LR (None: 6e-3 x 128 / d_model)
    adamw_beta2: float = 0.95  # the transformer's AdamW beta2 (the settings users run: 0.95, 0.999)
    transformer_optimizer: str = "adamw"  # "sgd": the quality transformer trained with SGD momentum by every recipe
    corpus: str = "help-topics"  # the transformers' text (quality_data.CORPORA): "stdlib" is not exhausted by a run
    digits_optimizer: str = "sgd"  # "adamw": the digits jobs (small_cnn, digits_wide) trained with AdamW
    threads: int = 1
    seed: int = 0
    device: str = "cpu"  # "cuda": models, batches and codecs on the GPU (communication still over Gloo)
    timeout_s: float = 1800.0
    prefix: str = "gfq"
    out: str = "benchmarks/quality"


def plan_jobs(opts: QualityOptions) -> tuple[list[Job], list[Job]]:
    """The loopback jobs (quality) and the emulated-cluster jobs (time to accuracy; none on loopback)."""

    def every(steps: int) -> int:
        return max(1, min(steps, opts.eval_every or steps // 20))

    def transformer(name: str, size: tuple[int, int], steps: int, batch: int, recipes: list[str]) -> Job:
        d, layers = size
        return Job(
            name=name,
            workload="transformer",
            steps=steps,
            batch_size=opts.batch_size or batch,
            eval_every=every(steps),
            recipes=recipes,
            # AdamW: 6e-3 beat 3e-3 at d_model 128 (400 steps); scaled down for wider
            lr=opts.adamw_lr if opts.adamw_lr is not None and name == "transformer" else 6e-3 * 128 / d,
            beta2=opts.adamw_beta2,
            optimizer=opts.transformer_optimizer if name == "transformer" else "adamw",
            paper_lr=0.3,  # SGD: 1.0 diverged dense at d_model 128, 0.5 ended best; 0.3 leaves headroom
            paper_warmup_steps=max(1, steps // 20),
            d_model=d,
            n_layers=layers,
            n_heads=max(1, d // 32),
            device=opts.device,
            corpus=opts.corpus,
        )

    def digits(name: str, model: str, steps: int, recipes: list[str]) -> Job:
        adamw = opts.digits_optimizer == "adamw"
        return Job(
            name=name,
            workload="digits",
            model=model,
            steps=steps,
            batch_size=opts.batch_size or 32,
            eval_every=every(steps),
            recipes=recipes,
            lr=DIGITS_ADAMW_LR if adamw else 0.05,
            optimizer=opts.digits_optimizer,
            paper_lr=0.05,
            paper_warmup_steps=max(1, steps // 20),
            device=opts.device,
        )

    def chosen(default: list[str]) -> list[str]:
        # the plain recipes in their table order, then the variants (gf-…:option=value) of those
        plain = [r for r in default if opts.recipes is None or r in opts.recipes]
        named = (*TABLE_RECIPES, *SHARDED_MODES, *TORCHFT_PEERS)  # the table's, FSDP2 / HSDP, torchft's: when named
        plain += [r for r in dict.fromkeys(opts.recipes or []) if r in named]
        applies = (*default, *TABLE_RECIPES, *SHARDED_MODES, *TORCHFT_PEERS)
        variants = [r for r in opts.recipes or [] if ":" in r and parse_recipe(r)[0] in applies]
        return plain + list(dict.fromkeys(variants))  # a variant named twice is trained once

    def on_clock(workload: str) -> list[str]:
        if opts.tta_recipes is None:
            return list(TTA_RECIPES[workload])
        return ["ddp", *dict.fromkeys(r for r in opts.tta_recipes if r != "ddp")]

    jobs = []
    if "transformer" in opts.workloads:
        sgd = opts.transformer_optimizer == "sgd"  # the user's SGD: ddp-sgd would be ddp again
        recipes = [r for r in RECIPES if not (sgd and r == "ddp-sgd")]
        jobs.append(transformer("transformer", opts.transformer_size, opts.steps, 16, chosen(recipes)))
    if "digits" in opts.workloads:
        # the user's optimizer is already the paper's SGD with momentum 0.9: ddp-sgd would be ddp again
        # torch's peers are measured on the AdamW transformer, the workload they are compared on
        digits_recipes = [r for r in RECIPES if r != "ddp-sgd" and r not in TORCH_PEERS]
        jobs.append(digits("digits", "small_cnn", opts.steps, chosen(digits_recipes)))
    for job in jobs:
        if "ddp" not in job.recipes:
            job.recipes.insert(0, "ddp")  # the oracle every ratio is taken against
    tta = []
    if opts.bandwidth != "none" and not opts.quality_on_link:
        if "transformer" in opts.workloads:
            tta.append(transformer("tta", opts.tta_size, opts.tta_steps, 8, on_clock("transformer")))
        if "digits" in opts.workloads:
            tta.append(digits("tta_digits", opts.tta_model, opts.tta_steps, on_clock("digits")))
    return jobs, tta


def _launch_jobs(name: str, jobs: list[Job], opts: QualityOptions, out: Path, cluster: Any) -> dict[str, Any]:
    from gradientflow.bench.runner import error_from_log, launch_workers

    raw_path = out / f"raw-{name}.json"
    raw_path.unlink(missing_ok=True)
    spec = QualitySpec(
        jobs=[asdict(j) for j in jobs], out_path=str(raw_path.resolve()), seed=opts.seed, threads=opts.threads
    )
    spec_path = out / f"spec-{name}.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    reason, log_path, seconds = launch_workers(
        name,
        spec_path,
        out,
        opts.nproc,
        cluster,
        opts.timeout_s,
        opts.threads,
        module="gradientflow.bench.quality_worker",
        nproc_per_node=opts.nproc_per_node,
    )
    if reason is not None or not raw_path.exists():
        detail = error_from_log(log_path)
        raise RuntimeError(
            f"quality launch '{name}' failed: {reason or 'no results written'}"
            + (f": {detail}" if detail else "")
            + f" (log: {log_path})"
        )
    logger.info("quality: launch '%s' took %.0f s", name, seconds)
    return {**json.loads(raw_path.read_text()), "seconds": seconds}


def run_quality(opts: QualityOptions) -> dict[str, Any]:
    """Run the quality launch (loopback, or behind the link with ``quality_on_link``) and, with a bandwidth, the
    time-to-accuracy launch on an emulated cluster; write ``results.json``, ``table.md`` and the plots to ``out``."""
    from gradientflow.bench import quality_report
    from gradientflow.bench.cluster import EmulatedCluster, can_emulate

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs, tta = plan_jobs(opts)
    check_torchft([r for j in (*jobs, *tta) for r in j.recipes], opts.device)  # before any rank starts
    t0 = time.monotonic()
    launches: dict[str, Any] = {}
    on_link = opts.quality_on_link and opts.bandwidth != "none"
    skipped = None
    for name, todo in (("quality", jobs), ("tta", tta)):
        if not todo:
            continue
        behind = name == "tta" or on_link  # behind the emulated link, else on loopback
        where, steps = "on loopback", opts.steps if name == "quality" else opts.tta_steps
        if behind:
            ok, why = can_emulate()
            if not ok:
                skipped = f"cannot emulate a {opts.bandwidth} cluster ({why})"
                print(f"gradientflow bench --quality: {skipped}; no {name} run behind it", file=sys.stderr)
                continue
            where = f"behind an emulated {opts.bandwidth} link per node"
        logger.info(
            "quality: %s, %d ranks (%d per node) %s, %d steps, recipes %s",
            " + ".join(j.name for j in todo),
            opts.nproc,
            opts.nproc_per_node,
            where,
            steps,
            ", ".join(todo[0].recipes),
        )
        if not behind:
            launches[name] = _launch_jobs(name, todo, opts, out, None)
            continue
        with EmulatedCluster(nodes=opts.nproc // opts.nproc_per_node, rate=opts.bandwidth, prefix=opts.prefix) as c:
            launches[name] = _launch_jobs(name, todo, opts, out, c)
    summary = quality_report.summarize(launches, opts, seconds=time.monotonic() - t0, tta_skipped=skipped)
    quality_report.write_all(summary, out)
    return summary
