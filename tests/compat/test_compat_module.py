"""The wrapper is a proper ``nn.Module``: state_dict, parameters, buffers, modes, .to(), copies."""

from __future__ import annotations

import copy
import io
import os
import pickle
import weakref

import pytest
import torch
from torch import nn

from _dist import run_distributed
from _oracle import assert_same_grads, assert_same_params, batch, pair


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _train(models, rank: int, steps: int, shape=(4, 6)) -> None:
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(steps):
        x = batch(rank, step, shape).to(next(models[0].parameters()).dtype)
        for m, o in zip(models, opts):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()


def _module_api_worker(rank: int, world_size: int) -> None:
    ref, ours = pair(_net)
    # Nothing of ours shadows nn.Module's own attributes (the old `_buffers` list broke state_dict).
    fresh = vars(nn.Module())
    for key, value in vars(ours).items():
        if key in fresh:
            assert type(value) is type(fresh[key]), key
    _train([ref, ours], rank, 3)
    # state_dict: DDP's `module.` keys and values; parameters and buffers by the same names.
    sd_ref, sd_ours = ref.state_dict(), ours.state_dict()
    assert list(sd_ours) == list(sd_ref) and all(k.startswith("module.") for k in sd_ours)
    for k in sd_ref:
        torch.testing.assert_close(sd_ours[k], sd_ref[k], atol=1e-6, rtol=1e-5, msg=k)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert len(list(ours.buffers())) == 3
    # load_state_dict round trip (strict), into a wrapper built elsewhere.
    _, other = pair(_net)
    other.load_state_dict(sd_ours)
    for (k, a), b in zip(ours.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    # train()/eval() reach the wrapped module.
    ours.eval()
    assert not ours.module[1].training
    ours.train()
    assert ours.module[1].training


def test_state_dict_parameters_buffers_modes() -> None:
    run_distributed(_module_api_worker, 2)


def _to_worker(rank: int, world_size: int) -> None:
    """``.to(dtype)`` of a not-yet-used wrapper: the pool follows, training matches DDP in float64."""
    ref, ours = pair(_net)
    # The oracle is DDP built on a float64 model (torch DDP itself does not follow a later .to(dtype)).
    ref, ours = pair(lambda: _net().to(torch.float64))[0], ours.to(torch.float64)
    assert ours.pool.buffers[0].dtype == torch.float64
    _train([ref, ours], rank, 3)
    assert_same_grads(ref, ours, atol=1e-12)
    assert_same_params(ref, ours, atol=1e-12)
    # Once CSC residuals exist, a dtype change would silently lose them: refused, with the way out.
    _, sparse = pair(_net, {"density": 0.5, "chunk_size": 8, "warmup_steps": 0})
    _train([sparse], rank, 1)
    with pytest.raises(ValueError, match="comm_state_dict"):
        sparse.to(torch.float64)


def test_to_dtype_before_use() -> None:
    run_distributed(_to_worker, 2)


def _copies_worker(rank: int, world_size: int) -> None:
    """deepcopy and pickling work as for torch DDP (default group); copies train independently."""
    ref, ours = pair(_net)
    _train([ref, ours], rank, 2)
    clone = copy.deepcopy(ours)
    buf = io.BytesIO()
    torch.save(ours, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    unpickled = pickle.loads(pickle.dumps(ours))
    before = [p.detach().clone() for p in ours.parameters()]
    for copy_ in (clone, loaded, unpickled):
        ref_copy = copy.deepcopy(ref)
        _train([ref_copy, copy_], rank, 2)
        assert_same_params(ref_copy, copy_)
        assert all(p.grad.data_ptr() != q.data_ptr() for p, q in zip(copy_.parameters(), ours.parameters()))
    # The original was not touched by its copies' training (their hooks are their own).
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
    # CSC residuals travel with a copy.
    _, sparse = pair(_net, {"density": 0.5, "chunk_size": 8, "warmup_steps": 0})
    _train([sparse], rank, 2)
    twin = copy.deepcopy(sparse)
    for a, b in zip(sparse.comm_state_dict()["v"], twin.comm_state_dict()["v"]):
        assert torch.equal(a, b)


def test_deepcopy_and_pickle() -> None:
    run_distributed(_copies_worker, 2)


def _threads() -> int:
    """This process's threads (a Gloo group runs its own: they end when the group is destroyed)."""
    return len(os.listdir("/proc/self/task"))


def _release_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    from gradientflow import DistributedDataParallel

    base = _threads()
    for make in (nn.parallel.DistributedDataParallel, DistributedDataParallel):  # torch DDP: the oracle
        group = dist.new_group(list(range(world_size)))
        assert _threads() > base
        model = make(_net(), process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(batch(rank, 0)).pow(2).mean()
        loss.backward()  # the loss stays referenced, as a training loop's last one does
        opt.step()
        module = weakref.ref(model.module)
        del model, opt
        # Freed by reference counting alone (no gc.collect()), and with them the last hold on the
        # group: destroy_process_group ends its threads while Python is whole.  A group left alive
        # until interpreter shutdown can abort the process there (examples/train_ddp.py).
        assert module() is None, make
        dist.destroy_process_group(group)
        del group
        assert _threads() == base, make
        del loss
    # CSC too (its control group is torch's to free, with destroy_process_group(), as any group).
    model = DistributedDataParallel(_net(), density=0.5, chunk_size=8, warmup_steps=0)
    _train([model], rank, 2)
    module = weakref.ref(model.module)
    del model
    assert module() is None


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_del_model_releases_it_and_its_group() -> None:
    run_distributed(_release_worker, 2)
