"""A quality job's data, on each rank: its training batches (from a generator seeded per rank, the same for
every recipe), the fixed validation set, the model built from the job's seed, and the validation loss.

Used by :mod:`.quality_worker` and by the research scripts under ``experiments/`` that train the same workloads.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradientflow.bench.quality_spec import Job
from gradientflow.bench.runner_spec import rank_device

CORPORA = ("help-topics", "stdlib")
"""The transformer's corpora (``Job.corpus``): Python's help topics (characters, 465 kB: the published tables') and
the standard library's sources (bytes, 31.5 MB: a corpus the run does not exhaust)."""


def corpus_ids(corpus: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(train ids, validation ids, vocabulary size) of a corpus; the stdlib's held as bytes (uint8)."""
    from gradientflow.bench import data

    if corpus == "help-topics":
        train, val = data.pydoc_topics_corpus()
        vocab = data.char_vocab(train + val)
        return data.encode(train, vocab), data.encode(val, vocab), len(vocab)
    if corpus == "stdlib":
        train_b, val_b = data.stdlib_sources()
        return data.byte_ids(train_b), data.byte_ids(val_b), 256
    raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")


class WorkloadData:
    """Training batches (per rank, from a generator) and the fixed validation set of a workload."""

    def __init__(self, job: Job, seed: int, rank: int, world: int) -> None:
        self.job, self.rank, self.world = job, rank, world
        self.device = rank_device(job.device, int(os.environ.get("LOCAL_RANK", "0")))
        if job.workload == "transformer":
            self.train_ids, val_ids, self.vocab_size = corpus_ids(job.corpus)
            t = job.seq_len
            n = (len(val_ids) - 1) // t
            starts = torch.linspace(0, n - 1, min(n, job.val_windows)).long() * t  # non-overlapping, spread out
            offs = torch.arange(t)
            self.val_x = val_ids[starts[:, None] + offs].long()
            self.val_y = val_ids[starts[:, None] + offs + 1].long()
        else:
            from gradientflow.bench.data import load_digits_split, shard

            x_train, y_train, self.val_x, self.val_y = load_digits_split(seed=seed)
            self.xs, self.ys = shard(x_train, y_train, rank, world)
        self.val_x, self.val_y = self.val_x.to(self.device), self.val_y.to(self.device)
        self.seed = seed

    def batches(self):
        """An endless iterator of this rank's batches; equal for every recipe (same seed)."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + self.rank)
        b = self.job.batch_size
        if self.job.workload == "transformer":
            from gradientflow.bench.data import lm_batch

            while True:
                x, y = lm_batch(self.train_ids, b, self.job.seq_len, gen)
                yield x.long().to(self.device), y.long().to(self.device)
        while True:
            order = torch.randperm(len(self.xs), generator=gen)
            for pos in range(0, len(order) - b + 1, b):
                idx = order[pos : pos + b]
                yield self.xs[idx].to(self.device), self.ys[idx].to(self.device)

    def build_model(self) -> nn.Module:
        from gradientflow.bench.models import build_model

        torch.manual_seed(self.seed)
        if self.job.workload == "transformer":
            return build_model(
                "tiny_transformer",
                vocab_size=self.vocab_size,
                d_model=self.job.d_model,
                n_layers=self.job.n_layers,
                n_heads=self.job.n_heads,
                seq_len=self.job.seq_len,
            ).to(self.device)
        return build_model(self.job.model).to(self.device)


def cross_entropy(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the last dimension: a digits batch's classes, or each of a window's next characters."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction=reduction)


def evaluate(module: nn.Module, data: WorkloadData) -> tuple[float, float | None]:
    """(mean validation loss, accuracy or None) over the whole validation set; each rank scores its
    strided share and the sums are allreduced.  Not part of any timed step."""
    was = module.training
    module.eval()
    x, y = data.val_x[data.rank :: data.world], data.val_y[data.rank :: data.world]
    if getattr(module, "_get_fsdp_state", None) is not None:  # FSDP: every forward all-gathers, so every rank
        n = len(data.val_x) // data.world  # runs as many of them: the same count of windows each (the rest unused)
        x, y = x[:n], y[:n]
    with torch.no_grad():
        total = torch.zeros(3, dtype=torch.float64)
        for i in range(0, len(x), 64):
            out = module(x[i : i + 64])
            total[0] += float(cross_entropy(out, y[i : i + 64], "sum"))
            total[1] += y[i : i + 64].numel()
            total[2] += float((out.argmax(-1) == y[i : i + 64]).sum())
    module.train(was)
    dist.all_reduce(total)
    acc = float(total[2] / total[1]) if data.job.workload == "digits" else None
    return float(total[0] / total[1]), acc
