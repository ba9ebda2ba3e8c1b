"""Screen quantiser variants below 0.07 of the bytes without the ring: the 2-rank quantised exchange (or N
ranks') emulated in one process on the quality bench's transformer.

    python experiments/quant_sim.py --variants dense q2n q3 pre-q2n --seed 0 --out benchmarks/quant_sim

Per step each of the two ranks' batches (the bench's, same seed) gives a gradient ``g_r``; the rank's
contribution ``x_r = g_r / 2 + e_r`` is quantised with error feedback and the optimizer (the bench's AdamW
and schedule) gets the sum of the two decoded contributions, as the library's two-rank exchange does; step
0 is dense (``compression="auto"``).  Final validation loss over the ``dense`` variant's (the same job
trained dense fp32: torch DDP's arithmetic up to fp32 rounding).  Not the library: a screen, whose winner
is then built in ``comm/`` and measured by ``gradientflow bench --quality``.

``--nproc N`` (N > 2): N ranks' batches, and the library's N-rank ring instead of the exchange: each of N
segments is owned by one rank, which adds the other ranks' decoded contributions to its own exact one and
quantises the sum once (its residual keeps that error); a variant ``A/B`` quantises the contributions with A
and the sums with B.

Variants (:data:`VARIANTS`): ``q<bits>[n][b<block>]`` the library's levels (``n``: without a zero);
``pre-...`` the same in *preconditioned* units: every coordinate divided by ``r = sqrt(v) + eps`` before
the block quantiser and multiplied back after, ``v`` an EMA (``--pre-beta``, the library's 0.9) of the squared
synchronised gradient, which every rank holds bit-identical (so ranks agree on ``r`` without a byte): AdamW divides each
coordinate's step by its own RMS, so it sees a coordinate's quantisation noise relative to that RMS, where
a max-abs block quantiser leaves the small coordinates of a block with noise of the block's scale
(``pre<beta>-``: that EMA's beta); ``hq...``: each block rotated (:func:`hadamard`) before its scale, rotated
back after.  ``--predict c``: every message codes its value less ``c`` x the last synchronised gradient (known
to every rank).  Each variant's line also reports the error energy each stage added over the synchronised
gradient's, plain and in the preconditioner's units (``w-``), and what its codes would cost entropy-coded
(:class:`Rate`: a table per message; Shannon's bound and a Huffman code).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gradientflow.bench.quality import QualityOptions, plan_jobs
from gradientflow.bench.quality_data import WorkloadData
from gradientflow.bench.quality_lr import lr_schedule
from gradientflow.comm.levels import CODEBOOKS, ZEROLESS
from gradientflow.exchange.precondition import PRECONDITION_BETA, precondition_root

SPEC = re.compile(r"(pre\d*(?:\.\d+)?-)?(h)?q(\d)(n)?(?:b(\d+))?")
MEAN_SIGN = 1  # ``q1``: the sign of each element times the block's mean |x| (the L2-best 1-bit code)


def table(bits: int, zeroless: bool) -> torch.Tensor:
    return torch.tensor(ZEROLESS[bits] if zeroless else (0.0, *CODEBOOKS[bits]))


def sign_quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """Decoded values of the 1-bit code: per block of ``block`` a bf16 scale ``mean |x|``, each element
    ``±scale`` by its sign (0 counts as +): the scaled sign of 1-bit SGD/Adam, whose scale minimises the
    block's squared error among codes that keep only the sign."""
    n = x.numel()
    rows = F.pad(x, (0, (-n) % block)).view(-1, block)
    cnt = torch.full((rows.shape[0], 1), float(block))
    cnt[-1] = block - (-n) % block  # the padded tail of the last block is not part of its mean
    s = (rows.abs().sum(1, keepdim=True) / cnt).bfloat16().float()
    return torch.where(rows >= 0, s, -s).reshape(-1)[:n]


@functools.cache
def hadamard(block: int) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order ``block`` (a power of two), times fixed random
    signs on its rows (the same on every rank: a seeded generator), as DRIVE/EDEN rotate before quantising:
    a block's energy spreads evenly over its coordinates, so its largest entry (the scale) sits near
    ~2.7 RMS (Gaussian) however heavy-tailed the block was."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (block,), generator=torch.Generator().manual_seed(1234)) * 2 - 1
    return signs[:, None].float() * h / block**0.5


def rotated(code: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, block: int) -> torch.Tensor:
    """``code`` applied to each block of ``x`` rotated by :func:`hadamard`, rotated back (orthonormal: the
    error energy is the rotated code's)."""
    n = x.numel()
    rot = hadamard(block)
    rows = F.pad(x, (0, (-n) % block)).view(-1, block) @ rot
    return (code(rows.reshape(-1)).view(-1, block) @ rot.T).reshape(-1)[:n]


def huffman_bits(counts: list[int]) -> int:
    """Bits a Huffman code built for these symbol counts spends on them (its table not counted)."""
    heap = [c for c in counts if c]
    if len(heap) < 2:
        return sum(counts)  # one symbol still takes a bit each in a prefix code
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        merged = heapq.heappop(heap) + heapq.heappop(heap)
        total += merged  # every symbol below the merged node gets one bit longer
        heapq.heappush(heap, merged)
    return total


class Rate:
    """What the codes of the messages would cost entropy-coded, one table per message (its size not counted):
    the ideal (Shannon) bits and a Huffman code's."""

    def __init__(self) -> None:
        self.symbols, self.shannon, self.huffman = 0, 0.0, 0

    def add(self, codes: torch.Tensor, nsym: int) -> None:
        counts = torch.bincount(codes, minlength=nsym)
        n = int(counts.sum())
        p = counts[counts > 0].double() / n
        self.symbols += n
        self.shannon += float(-(p * p.log2()).sum()) * n
        self.huffman += huffman_bits(counts.tolist())


def block_quantize(x: torch.Tensor, lv: torch.Tensor, block: int, rate: Rate | None = None) -> torch.Tensor:
    """Decoded values: per block of ``block`` a bf16 max-abs scale, each element the nearest of ``±lv``
    (a tie toward the smaller level), as comm/quantize.py.  ``rate``: the codes' entropy tallied there (a
    table with a zero level: one symbol for 0, else the sign is a symbol's lowest bit)."""
    n = x.numel()
    rows = F.pad(x, (0, (-n) % block)).view(-1, block)
    s = rows.abs().amax(1, keepdim=True).bfloat16().float()
    u = rows / torch.where(s > 0, s, torch.ones_like(s))
    mids = (lv[1:] + lv[:-1]) / 2
    k = torch.bucketize(u.abs(), mids)  # right=False: a value equal to a midpoint takes the lower level
    if rate is not None:
        neg = (u < 0) & ((k > 0) | bool(lv[0] > 0))  # a zero level has no sign
        rate.add((k * 2 + neg).reshape(-1)[:n], 2 * len(lv))
    return (lv[k].copysign(u) * s).reshape(-1)[:n]


class Quant:
    """One quantiser: ``q32`` (exact) or ``[pre<beta>-]q<bits>[n][b<block>]``."""

    def __init__(self, spec: str, pre_beta: float) -> None:
        m = SPEC.fullmatch(spec)
        self.exact = spec == "q32"
        self.bits = 32.0  # exact: fp32 on the wire
        self.pre = False
        if not self.exact:
            assert m is not None, f"unknown quantiser {spec!r}"
            self.pre = m[1] is not None
            self.beta = float(m[1][3:-1]) if self.pre and len(m[1]) > 4 else pre_beta
            self.rotate = m[2] is not None
            self.sign = int(m[3]) == MEAN_SIGN
            self.lv = torch.ones(1) if self.sign else table(int(m[3]), m[4] is not None)
            self.block = int(m[5]) if m[5] else 128
            self.bits = int(m[3]) + 16 / self.block
        self.rate = Rate()

    def __call__(self, x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        if self.exact:
            return x.clone()
        if self.pre and r is not None:
            return self.code(x / r) * r
        return self.code(x)

    def code(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotate:
            return rotated(self.plain, x, self.block)
        return self.plain(x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        return sign_quantize(x, self.block) if self.sign else block_quantize(x, self.lv, self.block, self.rate)


class Variant:
    """``PHASE[>PHASE@step ...]``, a phase ``QUANT[~REGEX=QUANT ...]``: per step range, a quantiser per group of
    parameters (names matching REGEX; the rest get the first), each group blocked on its own.  ``QUANT`` is
    one quantiser for every message or ``A/B``: from 3 ranks, ``A`` for the reduce-scatter's contributions,
    ``B`` for the segment sums of the all-gather (two ranks exchange contributions only: ``A``)."""

    def __init__(
        self, name: str, pre_beta: float, names: list[str], sizes: list[int], nproc: int = 2, predict: float = 0.0
    ) -> None:
        self.name, self.dense = name, name == "dense"
        n = sum(sizes)
        self.phases: list[tuple[int, list[tuple[torch.Tensor, Quant, Quant]]]] = []
        for k, phase in enumerate([] if self.dense else name.split(">")):
            start = 0
            if k:
                phase, at = phase.rsplit("@", 1)
                start = int(at)
            first, *rest = phase.split("~")
            owner = torch.zeros(n, dtype=torch.long)
            quants = [self._pair(first, pre_beta)]
            for j, item in enumerate(rest, 1):
                regex, spec = item.rsplit("=", 1)
                quants.append(self._pair(spec, pre_beta))
                off = 0
                for nm, sz in zip(names, sizes):
                    if re.search(regex, nm):
                        owner[off : off + sz] = j
                    off += sz
            self.phases.append((start, [(torch.nonzero(owner == j)[:, 0], *q) for j, q in enumerate(quants)]))
        self.err = [torch.zeros(n) for _ in range(nproc)]
        self.v: torch.Tensor | None = None
        # the EMA's beta is the one a ``pre<beta>-`` names (the last such), else ``--pre-beta``.  Until 2026-11-28
        # it was always ``--pre-beta`` (then 0.99 by default): a ``pre0.9-`` without ``--pre-beta 0.9`` ran 0.99.
        pres = [q.beta for _, grp in self.phases for _, qa, qb in grp for q in (qa, qb) if q.pre]
        self.beta = pres[-1] if pres else pre_beta
        self.bits = [0.0, 0.0, 0.0]  # bits sent: fixed-width codes, and entropy-coded (Shannon, Huffman: :class:`Rate`)
        # error energy each stage added, and the synchronised gradient's, over the quantised steps
        self.energy = {k: 0.0 for k in ("contributions", "sums", "signal", "w-contributions", "w-sums", "w-signal")}
        self.predict = predict  # --predict: code the difference to predict x the last synchronised gradient
        self.last: torch.Tensor | None = None

    @staticmethod
    def _pair(spec: str, pre_beta: float) -> tuple[Quant, Quant]:
        a, _, b = spec.partition("/")
        return Quant(a, pre_beta), Quant(b or a, pre_beta)

    def _count(self, what: str, x: torch.Tensor, w: torch.Tensor) -> None:
        """``x``'s energy into ``what``, plain and weighted by ``w`` (``"w-" + what``)."""
        sq = x.square()
        self.energy[what] += float(sq.sum())
        self.energy["w-" + what] += float((sq * w).sum())

    @property
    def bits_sent(self) -> float:
        """The bits the fixed-width codes sent (the dense steps' 32 a coordinate included)."""
        return self.bits[0]

    def _spend(self, q: Quant, before: tuple[int, float, int], weight: float) -> None:
        """This step's bits of ``q``'s messages at ``weight`` coordinates' share of the bytes: fixed-width, and had
        its codes been entropy-coded (Shannon and Huffman, a table per message; codes without a tally, exact or
        1-bit, at their fixed width)."""
        n = q.rate.symbols - before[0]
        over = 0.0 if q.exact else 16 / q.block  # the scales' bits per coordinate
        coded = (
            [q.bits] * 2
            if n == 0
            else [(q.rate.shannon - before[1]) / n + over, (q.rate.huffman - before[2]) / n + over]
        )
        self.bits = [b + per * weight for b, per in zip(self.bits, [q.bits, *coded])]

    def sync(self, grads: list[torch.Tensor], step: int) -> torch.Tensor:
        """The averaged gradient every rank's optimizer gets (the library's direct quantised ring)."""
        n, world = grads[0].numel(), len(grads)
        if self.dense or step == 0:
            total = sum(grads) / world
            self.bits = [b + 32 * n for b in self.bits]
        else:
            groups = [g for start, g in self.phases if start <= step][-1]
            xs = [g / world + e for g, e in zip(grads, self.err)]
            # every rank holds the last synchronised gradient bit-identical: a prediction that costs no byte
            pred = torch.zeros_like(grads[0]) if self.last is None else self.last * self.predict
            xs = [x - pred / world for x in xs]
            r = precondition_root(self.v) if self.v is not None else None  # the library's (one bucket)
            # "w-": the same energies in the preconditioner's units (each coordinate over its RMS, as AdamW weighs it)
            w = torch.ones_like(grads[0]) if r is None else r.square().reciprocal()
            total = torch.zeros_like(grads[0])
            for idx, qa, qb in groups:
                ri = None if r is None else r[idx]
                before = [(q.rate.symbols, q.rate.shannon, q.rate.huffman) for q in (qa, qb)]
                if world == 2:  # one exchange of whole contributions, the sum never requantised
                    for i, x in enumerate(xs):
                        dec = qa(x[idx], ri)
                        self.err[i][idx] = x[idx] - dec
                        self._count("contributions", self.err[i][idx], w[idx])
                        total[idx] += dec
                    total[idx] += pred[idx]
                    self._spend(qa, before[0], idx.numel())
                    continue
                # direct reduce-scatter into `world` segments (each owned by one rank), then the owner's sum
                # quantised once and sent to all (its residual keeps that error too)
                for j, seg in enumerate(idx.tensor_split(world)):
                    rs = None if r is None else r[seg]
                    s = xs[j][seg].clone()
                    for i in range(world):
                        if i != j:
                            dec = qa(xs[i][seg], rs)
                            self.err[i][seg] = xs[i][seg] - dec
                            self._count("contributions", self.err[i][seg], w[seg])
                            s += dec
                    out = qb(s, rs)
                    self.err[j][seg] = s - out
                    self._count("sums", self.err[j][seg], w[seg])
                    total[seg] = out
                total[idx] += pred[idx]
                # per copy, as DDP's 4 bytes a gradient: contributions and sums, half the coordinates' share each
                self._spend(qa, before[0], idx.numel() / 2)
                self._spend(qb, before[1], idx.numel() / 2)
            self._count("signal", total, w)
        self.last = total.clone()
        if not self.dense and step > 0:  # the library's quantised strategy starts after the dense step 0
            sq = total.square()
            self.v = sq if self.v is None else self.v.mul_(self.beta).add_(sq, alpha=1 - self.beta)
        return total


def train(variant: str, args: argparse.Namespace) -> tuple[float, ...]:
    opts = QualityOptions(workloads=["transformer"], steps=args.steps, bandwidth="none", adamw_lr=args.lr)
    opts.adamw_beta2 = args.beta2
    if args.size:
        opts.transformer_size = tuple(int(v) for v in args.size.split("x"))  # type: ignore[assignment]
    job = plan_jobs(opts)[0][0]
    ranks = [WorkloadData(job, args.seed, r, args.nproc) for r in range(args.nproc)]
    model = ranks[0].build_model()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=job.lr, betas=(0.9, job.beta2), weight_decay=0.1)
    sched = lr_schedule(opt, job)
    batches = [d.batches() for d in ranks]
    names = [nm for nm, p in model.named_parameters() if p.requires_grad]
    v = Variant(variant, args.pre_beta, names, [p.numel() for p in params], args.nproc, args.predict)
    for step in range(job.steps):
        grads = []
        for it in batches:
            x, y = next(it)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))  # type: ignore[union-attr]
        total, off = v.sync(grads, step), 0
        for p in params:
            p.grad = total[off : off + p.numel()].view_as(p).clone()
            off += p.numel()
        opt.step()
        sched.step()
    model.eval()
    vx, vy = ranks[0].val_x, ranks[0].val_y
    loss = 0.0
    with torch.no_grad():
        for i in range(0, len(vx), 64):
            out = model(vx[i : i + 64])
            loss += float(F.cross_entropy(out.reshape(-1, out.shape[-1]), vy[i : i + 64].reshape(-1), reduction="sum"))
    e = v.energy
    return (
        loss / vy.numel(),
        *(b / (32 * job.steps * sum(p.numel() for p in params)) for b in v.bits),
        *(e[k] / (e["signal"] or 1.0) for k in ("contributions", "sums")),
        *(e[k] / (e["w-signal"] or 1.0) for k in ("w-contributions", "w-sums")),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["dense", "q2n", "pre-q2n"])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--nproc", type=int, default=2, help="ranks emulated (each its own batches, as the bench's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=None, help="AdamW peak LR (default: the bench's)")
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--size", default=None, help="transformer DxL (default the bench's 128x2)")
    ap.add_argument(
        "--pre-beta", type=float, default=PRECONDITION_BETA, help="EMA of the squared synchronised gradient"
    )
    ap.add_argument("--predict", type=float, default=0.0, help="code x - this x the last synchronised gradient")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    results: dict[str, tuple[float, ...]] = {}
    for name in dict.fromkeys(["dense", *args.variants]):
        t0 = time.time()
        results[name] = train(name, args)
        loss, nbytes, shannon, huffman, d_contrib, d_sum, w_contrib, w_sum = results[name]
        ratio = loss / results["dense"][0]
        print(
            f"{name}: val loss {loss:.4f}, ratio {ratio:.4f}, bytes {nbytes:.4f} (entropy-coded: Shannon "
            f"{shannon:.4f}, Huffman {huffman:.4f}), error energy / the synchronised "
            f"gradient's: contributions {d_contrib:.4f}, sums {d_sum:.4f}; over each coordinate's RMS: "
            f"{w_contrib:.4f}, {w_sum:.4f} ({time.time() - t0:.0f} s)",
            flush=True,
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tag = f"n{args.nproc}_seed{args.seed}_lr{args.lr}_b2{args.beta2}_{args.size or '128x2'}"
        (Path(args.out) / f"{tag}_{int(time.time())}.json").write_text(
            json.dumps({"args": vars(args), "loss": results}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
