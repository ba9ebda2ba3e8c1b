"""What was tried to make AdamW keep quality under CSC at density 0.1, as one re-runnable command.

``torchrun --nproc-per-node 2 experiments/adamw_variants.py [--steps 400] [--variants a,b] [--out DIR]``
(from the repository root)

Trains the quality bench's transformer (its job: model, data, AdamW, LR schedule, seed) once per
variant, side by side and step by step interleaved, and reports each variant's final validation loss
over torch DDP's.  Every variant is ``gf-recommended`` (fp16 wire, density 0.1, the library's
defaults) with one thing changed (:data:`VARIANTS`).  None of them is part of the library: they are
the measured alternatives that lost, kept so that the README's claims about them re-run.

- *selection*: which chunks a step sends.  ``rotating`` sends a window of the chunks that moves on
  every step, so that every chunk goes once in 1/density steps (no chunk waits longer, but the
  large ones wait too); ``per-tensor`` sends the top fraction of every parameter's chunks instead of
  the pool's (``csc_scope="global"``, whose slice is the whole pool, against the same with the
  pool's top: on this model one slice either way); ``force-old`` sends chunks unsent for 40 steps
  first and ``age-boost`` ranks by score x (1 + steps unsent / 10) (:class:`AgedSelection`).  All
  replace the engine's ``gradientflow.strategies.csc.select_chunks`` while their own run steps (the library
  has no selection hook: one rule, the paper's, is the product).
- *residual*: ``residual-decay`` multiplies the residual by 0.95 after every write-back (old
  gradient is forgotten, not delayed); ``predictor`` sends each unsent chunk a shared estimate (the
  per-step mean of its last delivery, the same on every rank) and takes it out of the residual, so
  that AdamW sees a gradient every step and nothing is lost (:class:`PredictorSync`).
- *momentum*: ``mc-beside-adamw`` turns CSC's momentum correction on (``momentum=0.9``) under AdamW.
- *optimizer* (not the user's any more): ``frozen-v`` stops AdamW's second moment after the ramp
  (:class:`FrozenSecondMomentAdamW`, 1-bit Adam's idea); :class:`ArrivalAdamW`, an AdamW whose
  moments and move are those of a coordinate only on the steps its chunk arrives;
  ``arrival-adamw-age`` scales that move by the steps waited.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradientflow.strategies.csc as csc_module
from gradientflow.exchange.selection import select_chunks
from gradientflow.strategies.csc import SparseSync

VARIANTS: dict[str, str] = {
    "ddp": "torch DDP, dense fp32 (the oracle)",
    "gf-recommended": "fp16 + CSC density 0.1, the library's defaults",
    "gf-global": "the same with csc_scope='global' (per-tensor's baseline)",
    "per-tensor": "csc_scope='global', the top 10% of each parameter's chunks",
    "rotating": "a rotating 10% of the chunks instead of the top 10%",
    "force-old": "chunks unsent for 40 steps go first, in place of top ones",
    "age-boost": "scores x (1 + steps unsent / 10)",
    "residual-decay": "residual x 0.95 after each step",
    "predictor": "unsent chunks get a shared estimate, taken out of the residual",
    "mc-beside-adamw": "CSC momentum correction 0.9 as well as AdamW's own momentum",
    "frozen-v": "AdamW's second moment frozen after the 100-step ramp",
    "arrival-adamw": "ArrivalAdamW: moments and move only when the chunk arrives",
    "arrival-adamw-age": "ArrivalAdamW, the move scaled by the steps waited",
}
RESIDUAL_DECAY = 0.95
FORCE_AFTER = 40  # force-old: steps a chunk may stay unsent
AGE_SCALE = 10  # age-boost: a chunk unsent for 10 steps scores double
FREEZE_FROM = 100  # frozen-v: the library's default ramp length


# ==== optimizer ===============================================================================
class ArrivalAdamW(torch.optim.Optimizer):
    """AdamW that reads an exactly-zero gradient element as "not delivered this step".

    Per element, each step: 1. decoupled weight decay (every step, delivered or not); 2. where the
    gradient is nonzero: update m and v, count the arrival, move by the bias-corrected
    ``m / (sqrt(v) + eps)`` (times the steps since its last arrival if ``scale_by_age``); elsewhere
    m, v and the count stay as they were.  With a nonzero gradient everywhere every step it is
    torch's AdamW.
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        scale_by_age: bool = False,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "scale_by_age": scale_by_age}
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        assert closure is None, "ArrivalAdamW takes no closure"
        for group in self.param_groups:
            lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                p.mul_(1 - lr * group["weight_decay"])
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(
                        exp_avg=torch.zeros_like(p),
                        exp_avg_sq=torch.zeros_like(p),
                        arrivals=torch.zeros_like(p),
                        age=torch.zeros_like(p),
                    )
                g, m, v, n, age = p.grad, st["exp_avg"], st["exp_avg_sq"], st["arrivals"], st["age"]
                age += 1
                got = g != 0
                torch.where(got, b1 * m + (1 - b1) * g, m, out=m)
                torch.where(got, b2 * v + (1 - b2) * g * g, v, out=v)
                n += got.to(n.dtype)
                t = n.clamp(min=1)
                move = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
                if group["scale_by_age"]:
                    move = move * age
                p.sub_(torch.where(got, lr * move, torch.zeros_like(move)))
                age.masked_fill_(got, 0)


class FrozenSecondMomentAdamW(torch.optim.AdamW):
    """torch's AdamW whose ``exp_avg_sq`` stops changing after its first ``freeze_from`` steps."""

    def __init__(self, params: Any, freeze_from: int, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.freeze_from, self.steps_taken = freeze_from, 0

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        frozen = self.steps_taken >= self.freeze_from
        groups = [p for g in self.param_groups for p in g["params"] if p in self.state]
        saved = [self.state[p]["exp_avg_sq"].clone() for p in groups] if frozen else []
        super().step(closure)
        for p, v in zip(groups, saved):
            self.state[p]["exp_avg_sq"].copy_(v)
        self.steps_taken += 1


# ==== selection ===============================================================================
def rotating_selection(n: int, k: int, step: int) -> torch.Tensor:
    """The k chunks of a window that moves k chunks on per step (wrapping): each chunk once per ceil(n/k) steps."""
    k = min(k, n)
    start = (step * k) % n
    return torch.sort((torch.arange(k) + start) % n).values


def per_tensor_selection(scores: torch.Tensor, k: int, groups: list[tuple[int, int]]) -> torch.Tensor:
    """The top ``round(k/n * size)`` (at least 1) chunks of each group [a, b) of the n scores, ascending."""
    n = scores.numel()
    picked = []
    for a, b in groups:
        b = min(b, n)
        if a < b:
            m = min(b - a, max(1, round(k / n * (b - a))))
            picked.append(torch.topk(scores[a:b], m).indices + a)
    return torch.sort(torch.cat(picked)).values if picked else torch.zeros(0, dtype=torch.int64)


class AgedSelection:
    """Top-k by score, with chunks that waited long pushed forward (``mode``: "force" or "boost").

    It counts, per chunk, the steps since it was last picked (0 after a pick; a slice is known by
    its number of chunks).  "force": chunks that waited ``param`` steps or more go first (lowest
    index first), then the top scores; "boost": the ranking is by score x (1 + waited / ``param``).
    """

    def __init__(self, mode: str, param: int) -> None:
        self.mode, self.param, self.waited = mode, param, {}

    def __call__(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        waited = self.waited.setdefault(scores.numel(), torch.zeros_like(scores))
        if self.mode == "force":
            ranked = torch.where(waited >= self.param, torch.full_like(scores, math.inf), scores)
        else:
            ranked = scores * (1 + waited / self.param)
        idx = select_chunks(ranked, k)  # the selection module's top-k: csc's name is patched meanwhile
        waited += 1
        waited[idx] = 0
        return idx


@contextlib.contextmanager
def _selection(rule: Callable[[torch.Tensor, int], torch.Tensor] | None) -> Iterator[None]:
    """While a variant steps, CSC picks the non-forced chunks with ``rule(scores, k)`` (None: the paper's top-k)."""
    if rule is None:
        yield
        return
    original = csc_module.select_chunks

    def select(scores: torch.Tensor, k: int, forced: int = 0) -> torch.Tensor:
        n = scores.numel() - forced  # forced chunks (1-D parameters) are the last ones: always sent
        idx = rule(scores[:n], k - forced)
        return torch.cat([idx, torch.arange(n, n + forced, device=idx.device)]) if forced else idx

    csc_module.select_chunks = select
    try:
        yield
    finally:
        csc_module.select_chunks = original


# ==== residual ================================================================================
class PredictorSync(SparseSync):
    """CSC whose unsent chunks get a shared estimate E (taken out of the residual), or whose residual decays.

    ``mode="predictor"``: after the write-back, 1. every unsent chunk's pool rows get E and every
    rank's residual loses E (the mean of what is applied plus the mean residual is still the sum of
    the mean gradients: nothing lost); 2. a sent chunk that waited a steps delivered R = its gradients
    minus the (a - 1) estimates applied meanwhile, so its per-step mean is (R + (a - 1) E) / a: the new E.
    A dense step sets E to its mean gradient.  ``mode="decay"``: the residual is multiplied by
    ``decay`` after every write-back.  Turned on by :meth:`adopt` on a live wrapper's strategy.
    """

    mode: str
    decay: float

    @classmethod
    def adopt(cls, sync: SparseSync, mode: str, decay: float = RESIDUAL_DECAY) -> None:
        sync.__class__ = cls
        sync.mode, sync.decay = mode, decay
        sync._estimate, sync._age = None, None

    def _state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self._estimate is None or [e.shape for e in self._estimate] != [r.shape for r in self._pool_rows]:
            self._estimate = [torch.zeros_like(r) for r in self._pool_rows]  # (re)allocated with the layout
            self._age = [torch.zeros(r.shape[0], 1, dtype=r.dtype, device=r.device) for r in self._pool_rows]
        return self._estimate, self._age

    def finish(self, stats: Any) -> None:
        super().finish(stats)
        if self._last_dense and self.mode == "predictor":
            for rows, e, age in zip(self._pool_rows, *self._state()):
                e.copy_(rows)
                age.zero_()

    def _write_back(self, slices: list[Any], ok: bool, stats: Any) -> None:
        super()._write_back(slices, ok, stats)
        if not ok:
            return
        if self.mode == "decay":  # the pool keeps only the sent chunks: its clean state stands
            for k in range(len(self._pool_rows)):
                self.res.rows(k).mul_(self.decay)
            return
        for k, (rows, e, age) in enumerate(zip(self._pool_rows, *self._state())):
            sent = torch.zeros(rows.shape[0], 1, dtype=torch.bool, device=rows.device)
            for sl in slices:
                if sl.pool == k:
                    sent[sl.idx] = True
            age += 1
            applied = e * (~sent).to(e.dtype)
            rows.add_(applied)  # the unsent rows of the pool are zero after the write-back
            self.res.rows(k).sub_(applied)
            torch.where(sent, (rows + (age - 1) * e) / age, e, out=e)
            age.masked_fill_(sent, 0)
        self._writer.forget()  # the pool now holds more than the sent chunks


# ==== the run =================================================================================
def _build(variant: str, data: Any, job: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """Wrapper, optimizer and selection rule of one variant."""
    from gradientflow.bench.quality_recipes import build_recipe

    recipe = {
        "ddp": "ddp",
        "gf-global": "gf-recommended:csc_scope='global'",
        "per-tensor": "gf-recommended:csc_scope='global'",
        "mc-beside-adamw": "gf-recommended:momentum=0.9",
    }.get(variant, "gf-recommended")
    wrapped, opt, _ = build_recipe(recipe, data.build_model(), job)
    rule = None
    if variant in ("predictor", "residual-decay"):
        PredictorSync.adopt(wrapped._gf_engine.sync, "predictor" if variant == "predictor" else "decay")
    elif variant == "frozen-v":
        g = opt.param_groups[0]
        opt = FrozenSecondMomentAdamW(
            wrapped.parameters(),
            FREEZE_FROM,
            lr=g["lr"],
            betas=g["betas"],
            eps=g["eps"],
            weight_decay=g["weight_decay"],
        )
    elif variant == "force-old":
        rule = AgedSelection("force", FORCE_AFTER)
    elif variant == "age-boost":
        rule = AgedSelection("boost", AGE_SCALE)
    elif variant.startswith("arrival-adamw"):
        g = opt.param_groups[0]
        opt = ArrivalAdamW(
            wrapped.parameters(),
            lr=g["lr"],
            betas=g["betas"],
            eps=g["eps"],
            weight_decay=g["weight_decay"],
            scale_by_age=variant.endswith("-age"),
        )
    elif variant == "rotating":
        sync = wrapped._gf_engine.sync
        rule = lambda scores, k, sync=sync: rotating_selection(scores.numel(), k, sync.step)
    elif variant == "per-tensor":
        eng = wrapped._gf_engine
        if len(eng.pool.buffers) != 1:
            raise RuntimeError("per-tensor selection is written for a one-buffer pool")
        starts = sorted({s.offset // eng.sync.chunk_size for s in eng.pool.layout.slots})
        groups = list(zip(starts, starts[1:] + [math.inf]))
        rule = lambda scores, k, groups=groups: per_tensor_selection(scores, k, groups)  # type: ignore[arg-type]
    return wrapped, opt, rule


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| variant | what changes | final val loss | ratio to ddp |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {VARIANTS[r['variant']]} | {r['val_loss']:.3f} | {r['ratio']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from gradientflow.bench.quality_data import cross_entropy, evaluate
    from gradientflow.bench.quality_lr import lr_schedule

    from _study import start_transformer_study

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="training steps (default 400, as the quality bench)")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all; ddp is always run)",
    )
    p.add_argument("--out", default="benchmarks/adamw_variants", help="directory for results.json and table.md")
    args = p.parse_args(argv)
    chosen = ["ddp"] + [v for v in args.variants.split(",") if v and v != "ddp"]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.steps < 4:
        p.error("--steps must be at least 4")

    job, data = start_transformer_study(args.steps)
    rank = dist.get_rank()
    runs = []
    for variant in chosen:
        wrapped, opt, rule = _build(variant, data, job)
        runs.append((variant, wrapped, opt, lr_schedule(opt, job), data.batches(), rule))
    for _ in range(args.steps):
        for _, wrapped, opt, sched, batches, rule in runs:
            x, y = next(batches)
            opt.zero_grad(set_to_none=True)
            with _selection(rule):
                cross_entropy(wrapped(x), y).backward()
            opt.step()
            sched.step()
    losses = {variant: evaluate(wrapped.module, data)[0] for variant, wrapped, *_ in runs}
    if rank == 0:
        rows = [{"variant": v, "val_loss": loss, "ratio": loss / losses["ddp"]} for v, loss in losses.items()]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "job": {
                        "d_model": job.d_model,
                        "n_layers": job.n_layers,
                        "lr": job.lr,
                        "batch_size": job.batch_size,
                    },
                    "rows": rows,
                },
                indent=1,
            )
        )
        table = markdown(rows)
        (out / "table.md").write_text(table)
        print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
