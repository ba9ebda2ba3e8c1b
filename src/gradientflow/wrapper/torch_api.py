"""torch DDP's semi-private surface on gradientflow's wrapper: what tests, Lightning and accelerate call.

A mixin of :class:`gradientflow.DistributedDataParallel` that sets no attribute of the wrapper: what torch's
registration methods record lives in the wrapper's :class:`TorchRegistrations` (``model._gf_torch``).
Each method keeps torch DDP's name, signature and meaning where this engine has the same concept; the ones
left out (torch's reducer internals with no counterpart here) are listed with their reason in
``docs/torch-ddp-suite.md``.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from .comm_hooks import CommHook, builtin_hook, make_hook_sync
from .surface import WrapperSurface


class _ReducerView:
    """``model.reducer``: the calls accelerate and torch's tests make on torch DDP's C++ reducer."""

    def __init__(self, ddp: Any) -> None:
        self._ddp = ddp

    def prepare_for_backward(self, outputs: Any = None) -> None:
        """The next backward synchronises (accelerate's ``trigger_sync_in_backward`` after a ``no_sync`` forward)."""
        self._ddp._gf_engine.sync_next_backward()

    def prepare_for_forward(self) -> None:
        """Nothing to prepare: the engine arms itself at every forward."""

    def _rebuild_buckets(self) -> bool:
        """The pool is re-laid once, after the first backward, by the engine itself: never here."""
        return False

    def _set_static_graph(self) -> None:
        self._ddp._set_static_graph()

    def _get_local_used_map(self) -> torch.Tensor:
        """Per synchronised parameter (registration order), how many ranks' last synchronised backward
        produced its gradient (int32, torch's map after its allreduce): exchanged every step with
        ``find_unused_parameters=True``, at the first step with ``static_graph``."""
        counts = self._ddp._gf_engine.usage.counts
        if counts is None:
            raise RuntimeError(
                "gradientflow: no used-parameter map: it is exchanged only with find_unused_parameters=True "
                "(or once with static_graph=True), after a synchronised backward. Pass find_unused_parameters=True."
            )
        return counts

    def _ddp_graph_static(self) -> bool:
        """Whether every synchronised step so far used the same parameters on this rank."""
        return self._ddp._gf_engine.usage.graph_static


class TorchRegistrations:
    """What torch DDP's registration methods recorded on one wrapper: communication hooks, ``join``'s divisor,
    the logging sample rate and sink flag.  Pickled without the hooks, as torch DDP drops them with its reducer."""

    def __init__(self) -> None:
        self.comm_hook: tuple[object, CommHook] | None = None  # (state, hook) of register_comm_hook
        self.comm_hook_name: str | None = None  # a builtin hook's type, for torch's logging data
        self.buffer_hook: tuple[Any, Any, bool] | None = None  # (state, hook, runs before forward)
        self.divide_by_initial_world_size = True  # join(): joined ranks count in the divisor (torch's default)
        self.logging_sample_rate: int | None = (
            None  # as set (None: torch's default); the engine's RuntimeLog samples at it
        )
        self.sink_clone = True  # recorded only: gradientflow has no _DDPSink to clone outputs

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("comm_hook", "comm_hook_name", "buffer_hook")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**TorchRegistrations().__dict__, **state})  # the defaults, then what was pickled


class TorchDDPAPI(WrapperSurface):
    """torch DDP's methods and attributes beyond ``forward``/``no_sync`` (mixed into the wrapper)."""

    _gf_torch: TorchRegistrations  # made by ddp.py at construction

    # torch DDP: 250 MiB per coalesced broadcast of parameters and buffers
    broadcast_bucket_size: int = int(250 * 1024 * 1024)

    # ---- uneven inputs (torch Join) ---------------------------------------------------------
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """``with model.join(): ...`` — ranks with fewer batches shadow the others until all are done.

        ``divide_by_initial_world_size=True`` (DDP's default): joined ranks contribute zero to a sum
        divided by the initial world size; ``False``: by the number of ranks still training.
        """
        if self.config.sync_every > 1:
            raise ValueError(
                f"join(): this model was built with sync_every={self.config.sync_every}; a rank that ran out of "
                "batches cannot shadow an outer sync it never reaches. Give every rank the same number of batches "
                "(DistributedSampler(drop_last=True)), or drop sync_every."
            )
        self._gf_torch.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        return Join([cast(Joinable, self)], enable, throw_on_early_termination)  # the wrapper is Joinable

    # ---- communication hooks ----------------------------------------------------------------
    def _gf_rescale_by_active(self, work: Any) -> Any:
        """``join(divide_by_initial_world_size=False)``: the step's mean over the ranks still training
        (Join's own allreduce of ones counts them); the engine divided by the initial world size."""
        pool = self._gf_engine.pool

        def rescale() -> None:
            active = int(work.get_future().wait()[0].item())
            if 0 < active < self._gf_world_size:
                with torch.no_grad():
                    for buf in pool.buffers:
                        buf.mul_(self._gf_world_size / active)

        return rescale

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """torch DDP's ``register_comm_hook``: ``hook(state, bucket) -> Future`` runs for every bucket
        instead of gradientflow's own communication (see :mod:`gradientflow.wrapper.comm_hooks`).

        Once per model, before training, as in torch DDP.  A hook decides what goes on the wire, so
        it cannot be combined with ``comm_dtype`` other than ``"fp32"`` or with ``density``.
        """
        if not callable(hook):
            msg = f"Communication hook must be callable, got {type(hook).__name__}"
            self._gf_engine.runtime.note_error(msg)  # torch DDP's logging data reports it
            raise TypeError(msg)
        if self._gf_torch.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self._gf_refuse_if_nested("register_comm_hook")
        cfg = self.config
        if cfg.sparse or cfg.comm_dtype != "fp32":
            raise ValueError(
                f"register_comm_hook: this model was built with comm_dtype={cfg.comm_dtype!r}, density={cfg.density}; "
                "a communication hook replaces gradientflow's own communication, so use one or the other "
                "(fp16/bf16 compress hooks = comm_dtype='fp16'/'bf16', no hook)."
            )
        if cfg.sync_every > 1:
            raise ValueError(
                f"register_comm_hook: this model was built with sync_every={cfg.sync_every}, whose exchange is the "
                "outer sync of the parameters, not a per-step gradient hook; use one or the other."
            )
        if self._gf_engine.watchdog.step > 0:
            raise RuntimeError(
                "register_comm_hook must be called before the first synchronised backward (as in torch DDP)."
            )
        self._gf_torch.comm_hook = (state, hook)
        self._gf_build_engine(order=None)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """``dist.BuiltinCommHookType.ALLREDUCE`` / ``FP16_COMPRESS``: torch's Python hooks of the same numerics."""
        self.register_comm_hook(self.process_group, builtin_hook(comm_hook_type))
        self._gf_torch.comm_hook_name = str(comm_hook_type)

    def _gf_make_sync(self) -> Any:
        assert self._gf_torch.comm_hook is not None  # called only when a hook is registered
        state, hook = self._gf_torch.comm_hook
        return make_hook_sync(self._gf_params, state, hook)

    def _register_buffer_comm_hook(self, state: Any, hook: Any, comm_hook_location: Any = None) -> None:
        """``hook(state, named_module_buffers) -> list[Future] | None`` replaces the buffer broadcast,
        before forward (the default) or after it (``_BufferCommHookLocation.POST_FORWARD``)."""
        from torch.nn.parallel.distributed import _BufferCommHookLocation  # noqa: PLC0415

        location = comm_hook_location if comm_hook_location is not None else _BufferCommHookLocation.POST_FORWARD
        self._gf_torch.buffer_hook = (state, hook, location == _BufferCommHookLocation.PRE_FORWARD)

    # ---- graph and parameters -------------------------------------------------------------
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """Mark parameters/buffers (fully qualified names) that DDP must not synchronise (torch's helper)."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        names = set(params_and_buffers_to_ignore)
        for name, param in module.named_parameters():
            if name in names:
                param._ddp_ignored = True  # type: ignore[attr-defined]  # torch's own marker, as torch sets it
        for name, buffer in module.named_buffers():
            if name in names:
                buffer._ddp_ignored = True  # type: ignore[attr-defined]

    def _build_params_for_reducer(self) -> tuple[list[nn.Parameter], list[bool]]:
        """The synchronised parameters in registration order, and whether each expects a sparse gradient."""
        sparse = {id(p) for p in self._gf_sparse_params}
        params = [p for p in self._gf_params] + [p for p in self._gf_sparse_params]
        params.sort(key=self._gf_registration_index)
        return params, [id(p) in sparse for p in params]

    def _gf_registration_index(self, p: nn.Parameter) -> int:
        order = {id(q): i for i, q in enumerate(self.module.parameters())}
        return order[id(p)]

    def _build_debug_param_to_name_mapping(self, parameters: list[nn.Parameter]) -> dict[int, str]:
        """Index in ``parameters`` -> the parameter's name (torch's checks: ValueError if they are not this model's)."""
        index = {p: i for i, p in enumerate(parameters)}
        mapping: dict[int, str] = {}
        for module_name, module in self.module.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                fqn = f"{module_name}.{param_name}" if module_name else param_name
                if fqn in self._gf_ignored or not param.requires_grad:
                    continue
                if param not in index:
                    raise ValueError(f"Param with name {fqn} found in module parameters, but not DDP parameters.")
                mapping[index[param]] = fqn
        if len(set(parameters)) != len(mapping):
            raise ValueError(
                "Expected param to name mapping to cover all parameters, but got conflicting lengths: "
                f"{len(set(parameters))} vs {len(mapping)}."
            )
        return mapping

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Any:
        """The parameters DDP synchronises (those not in ``_ddp_params_and_buffers_to_ignore``), as torch's helper."""
        for name, param in module.named_parameters():
            if not hasattr(param, "_ddp_ignored"):
                yield (name, param) if named_params else param

    def _default_broadcast_coalesced(
        self, bufs: Any = None, bucket_size: int | None = None, authoritative_rank: int = 0
    ) -> None:
        """``bufs`` (default: the module's buffers) from ``authoritative_rank`` (torch's buffer-hook helper)."""
        from ..comm.collectives import broadcast_coalesced  # noqa: PLC0415

        tensors = list(bufs) if bufs is not None else self._gf_module_buffers
        src = dist.get_global_rank(self.process_group, authoritative_rank)
        with torch.no_grad():
            broadcast_coalesced(tensors, src, self.process_group, self._gf_watchdog, "buffer broadcast")

    @property
    def parameters_to_ignore(self) -> set[str]:
        return set(self._gf_ignored)

    @parameters_to_ignore.setter
    def parameters_to_ignore(self, value: Any) -> None:
        raise AttributeError(
            "gradientflow: parameters_to_ignore is fixed when the model is wrapped; call "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names) before wrapping."
        )

    def _remove_autograd_hooks(self) -> None:
        """Detach the engine from the parameters' autograd (torch DDP's name; e.g. before ``del``)."""
        self._gf_engine.remove_hooks()

    @property
    def reducer(self) -> _ReducerView:
        return _ReducerView(self)

    # ---- logging ----------------------------------------------------------------------------
    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        if sample_rate < 1:
            raise ValueError(
                "DDP runtime logging sample rate should be equal or greater than 1, but got "
                f"{sample_rate}: set it to 1 or more."
            )
        self._gf_torch.logging_sample_rate = int(sample_rate)
        self._gf_engine.runtime.set_sample_rate(sample_rate)

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch DDP's construction-time logging fields with this model's values, plus the last step's counters."""
        params = self._gf_params
        layout = self._gf_engine.pool.layout
        hook = self._gf_torch.comm_hook
        data: dict[str, Any] = {
            "module_name": type(self.module).__name__,
            "device_ids": ",".join(map(str, self.device_ids or [])),
            "output_device": self.output_device if self.output_device is not None else -1,
            "broadcast_buffers": int(self.forward_sync_buffers),
            "bucket_cap_bytes": int(self.config.threshold_bytes),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(self.static_graph),
            "backend_name": dist.get_backend(self.process_group),
            "world_size": self._gf_world_size,
            "rank": dist.get_rank(self.process_group),
            "iteration": 0,  # torch's: the last sampled iteration (runtime fields below)
            "is_multi_device_module": 0,
            "num_parameter_tensors": len(params),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": ", ".join(
                sorted({_TYPE_NAMES.get(p.dtype, str(p.dtype).removeprefix("torch.")) for p in params})
            ),
            "bucket_sizes": ", ".join(
                str(sum(params[i].numel() * params[i].element_size() for i in b.params)) for b in layout.buckets
            ),
            "has_rebuilt_buckets": int(self._gf_engine.layout_final),
            "join_uneven_inputs": int(self._join_config.enable),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "master_addr": os.environ.get("MASTER_ADDR", "N/A"),
            "master_port": os.environ.get("MASTER_PORT", "N/A"),
            **_environment(self.process_group),
            **_rebuilt(self._gf_engine, params),
            **self._gf_engine.runtime.fields,
        }
        if hook is not None:
            data["comm_hook"] = self._gf_torch.comm_hook_name or getattr(hook[1], "__qualname__", str(hook[1]))
        error = self._gf_engine.runtime.last_error
        data.update({"has_error": int(bool(error)), "error": error})
        data.update({f"gradientflow_{k}": v for k, v in self.comm_stats().items()})
        return data

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Accepted: torch's ``_DDPSink`` clones outputs; gradientflow has no such autograd node (nothing to clone)."""
        self._gf_torch.sink_clone = bool(val)

    # ---- torch DDP properties -------------------------------------------------------------
    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """Read by torch DDP when it wraps a module: wrapping this wrapper again would average twice."""
        raise DoubleWrapError(
            "this model is already a gradientflow.DistributedDataParallel; wrapping it again in torch's "
            "DistributedDataParallel would average every gradient twice. Pass the inner model (model.module), "
            "or use the gradientflow model as it is."
        )


# torch's logger names dtypes by their C++ TypeMeta name
_TYPE_NAMES = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
}


def _environment(group: dist.ProcessGroup) -> dict[str, Any]:
    """The environment torch DDP's logger records at construction (its keys; NCCL's only for NCCL)."""
    env: dict[str, Any] = {
        k: os.environ.get(v, "N/A")
        for k, v in (
            ("torch_distributed_debug", "TORCH_DISTRIBUTED_DEBUG"),
            ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"),
        )
    }
    backend = dist.get_backend(group)
    if backend == "gloo":
        env["gloo_socket_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME", "N/A")
        env["gloo_device_transport"] = os.environ.get("GLOO_DEVICE_TRANSPORT", "N/A")
        try:  # the group's own thread count, as torch reads it; Gloo's default where it cannot be read
            env["gloo_num_threads"] = int(group._get_backend(torch.device("cpu")).options._threads)  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):
            env["gloo_num_threads"] = 2
    elif backend == "nccl":
        for key in ("socket_ifname", "blocking_wait", "async_error_handling", "debug", "nthreads", "ib_timeout"):
            env[f"nccl_{key}"] = os.environ.get(f"NCCL_{key.upper()}", "N/A")
    return env


def _rebuilt(engine: Any, params: list[nn.Parameter]) -> dict[str, Any]:
    """torch's fields on the buckets after the rebuild (the pool's relayout) and on unused parameters."""
    counts = engine.usage.counts
    unused = [] if counts is None else [i for i, c in enumerate(counts.tolist()) if not c]
    out: dict[str, Any] = {"unused_parameter_size": sum(params[i].numel() * params[i].element_size() for i in unused)}
    if engine.layout_final:
        buckets = engine.pool.layout.buckets
        sizes = (sum(params[i].numel() * params[i].element_size() for i in b.params) for b in buckets)
        out["rebuilt_bucket_sizes"] = ", ".join(map(str, sizes))
        out["rebuilt_per_bucket_param_indices"] = ", ".join(" ".join(map(str, b.params)) for b in buckets)
    return out


class DoubleWrapError(RuntimeError):
    """A model wrapped by gradientflow's DDP is wrapped again (by torch DDP or by gradientflow)."""
