"""``gradientflow.DistributedDataParallel``: torch DDP's interface over the gradient pool.

The ``nn.Module`` face: torch DDP's arguments and attributes, forward (inputs to the device,
buffers from rank 0, arming the backward), ``no_sync``, ``Join`` (its hook in :mod:`.join`),
device/dtype changes, pickling, and the communication checkpoint (kept by :mod:`.comm_state`).
What happens during a synchronised backward (``.grad`` bound to the pool, buckets launched in order,
the final callback) is the :class:`~gradientflow.engine.reducer.Reducer`'s, built here and rebuilt after ``.to()``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .. import mechanisms
from ..comm.collectives import broadcast_coalesced
from ..config import GradientFlowConfig
from ..diagnostics.watchdog import Watchdog, resolve_timeout
from ..engine.consistency import check_same_setup
from ..engine.pool import GradPool
from ..engine.reducer import Reducer
from ..engine.schedule import resolve as resolve_schedule
from ..recipe_options import QuantLevels, RecipeOptions
from ..strategies import build_strategy
from . import auto, compat, fewer_syncs, nested
from .checkpoint import Checkpointing, OptimizerWatch
from .compat import DDPSettings, DDPValueError, move_to_device, resolve_ddp_args, sparse_gradient_params
from .construction import agree_on_construction, fallback_group
from .groups import between_nodes, control_group, layout_stats, node_groups, resolved_topology, sync_group
from .join import GradientFlowJoinHook, common_rank
from .nested import Nesting
from .shutdown import end_groups_at_exit
from .sparse_grads import SparseGradSync
from .torch_api import TorchDDPAPI, TorchRegistrations
from .torch_class import TorchDDPClass


class DistributedDataParallel(TorchDDPAPI, Checkpointing, Nesting, TorchDDPClass, Joinable):  # torch_class.py
    """Drop-in for ``torch.nn.parallel.DistributedDataParallel`` with GradientFlow's communication.

    torch DDP's arguments keep their positions, defaults and meaning:
        device_ids, output_device: ``[local_rank]`` for a module on one GPU (inputs are moved there at
            forward, as DDP does); ``None`` for CPU modules.  dim: accepted, unused (as in DDP).
        broadcast_buffers (deprecated in torch 2.13) / forward_sync_buffers: broadcast buffers
            from rank 0 at every synchronised forward [True].
        init_sync: compare the models and broadcast rank 0's parameters and buffers [True].
        process_group / device_mesh (1-D): the group to average over [the default group].
        bucket_cap_mb: θ of lazy allreduce (the same setting as ``fusion_threshold_mb``) [25; quantised: 8].
        find_unused_parameters: as torch DDP: True = a per-parameter count of the ranks that used it is
            exchanged every step (``.grad`` of those no rank used goes back to ``None``); False = no
            exchange, and a parameter that got no gradient is torch's RuntimeError at the next forward.
        gradient_as_bucket_view: accepted, no effect: ``.grad`` is always a view of the pool (but with
            ``sync_every > 1`` on a flat layout, where no gradient is ever exchanged: autograd's own tensors).
        static_graph: the set of used parameters never changes, so the "used" exchange runs
            once instead of every step.
        check_reduction, skip_all_reduce_unused_params, batched_grad_copy: accepted, no effect on
            results here.
        mixed_precision, delay_all_reduce_named_params, param_to_hook_all_reduce,
            a multi-dimensional device_mesh: ``ValueError`` with the alternative.  bucket_cap_mb_list:
            recorded (``bucket_bytes_cap_list``); the pool is cut by one threshold.

    gradientflow's options (keyword-only; see :class:`GradientFlowConfig` and the README), first the recipe options
    (:class:`gradientflow.recipe_options.RecipeOptions`, each documented there; ``fully_shard`` takes them too):
        compression ["none"; a recipe of the table :mod:`gradientflow.recipes`: "fp16", "bf16", "topk-fp16",
        "topk-3bit", "3bit", "3bit-precond", "2bit-precond", "auto"; docs/recipes.md], density [None = dense],
        chunk_size ["auto"], warmup_steps [100], quant_bits, quant_block, quant_levels, quant_precondition,
        quant_warmup_steps, quant_clip [None: the recipe's], timeout [the process group's, at most 5 min between nodes];
    then the wrapper's own:
        fusion_threshold_mb [25.0; quantised: 8.0], comm_dtype ["fp32"], algorithm ["native"], momentum [0.0],
        dense_1d [True], chunk_score ["l1"], csc_scope ["slice"], schedule ["fixed"; "auto": θ and csc_scope from
        the link measured at construction, see :mod:`gradientflow.engine.schedule`], topology ["auto": torchrun's
        node layout, two-level synchronisation with nodes of several ranks; "flat"; "MxG"]; sync_every [1; H > 1:
        DiLoCo, the replicas synchronised every H optimizer steps, docs/fewer-syncs.md], outer_lr [1.0],
        outer_momentum [0.0] (the replicas averaged; DiLoCo's: 0.7, 0.9), outer_compression ["3bit";
        "indexed-topk-2bit": the top chunks in 2 bits], outer_density [0.1 with a top-k outer_compression],
        sync_fragments [1], sync_delay [0], outer_state_device [None] (the outer ones: sync_every > 1 only);
        timeout (above), check_consistency, check_finite, trace_path, trace_steps: fail loudly, never hang, and a
        timeline [the process group's, False, False, None, (1, 4)].
    """

    # Set by _gf_validate / _gf_attach_group / _gf_collect_tensors (declared for the type checker).
    _gf_settings: DDPSettings  # the rest: surface.py (WrapperSurface), shared by every part of the class
    _gf_src: int

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        # the recipe options (recipe_options.RecipeOptions: their names, types, defaults and meaning; fully_shard's too)
        compression: str = RecipeOptions.compression,
        density: float | None = RecipeOptions.density,
        chunk_size: int | str = RecipeOptions.chunk_size,
        warmup_steps: int = RecipeOptions.warmup_steps,
        quant_bits: int | None = RecipeOptions.quant_bits,
        quant_block: int | None = RecipeOptions.quant_block,
        quant_levels: QuantLevels | None = RecipeOptions.quant_levels,
        quant_precondition: bool | None = RecipeOptions.quant_precondition,
        quant_warmup_steps: int | None = RecipeOptions.quant_warmup_steps,
        quant_clip: float | None = RecipeOptions.quant_clip,
        timeout: float | timedelta | None = RecipeOptions.timeout,
        # the wrapper's own options (config.GradientFlowConfig's other fields)
        fusion_threshold_mb: float | None = None,
        comm_dtype: str | torch.dtype = "fp32",
        algorithm: str = "native",
        momentum: float = 0.0,
        dense_1d: bool = True,
        chunk_score: str = "l1",
        csc_scope: str = "slice",
        schedule: str = "fixed",
        check_consistency: bool = False,
        check_finite: bool = False,
        trace_path: str | os.PathLike | None = None,
        trace_steps: tuple[int, int] | None = None,
        topology: str = "auto",
        sync_every: int = 1,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        outer_compression: str | None = None,
        outer_density: float | None = None,
        sync_fragments: int | None = None,
        sync_delay: int | None = None,
        outer_state_device: str | None = None,
        replicas: Any = None,
    ) -> None:
        nn.Module.__init__(self)  # never torch DDP's __init__ (torch_class.py)
        Joinable.__init__(self)
        error: Exception | None = None
        try:  # everything local first: a failure here is raised on every rank (agree_on_construction)
            settings = resolve_ddp_args(  # torch DDP's arguments, translated (those without effect: DDPSettings)
                module,
                device_ids=device_ids,
                output_device=output_device,
                dim=dim,
                broadcast_buffers=broadcast_buffers,
                forward_sync_buffers=forward_sync_buffers,
                init_sync=init_sync,
                process_group=process_group,
                device_mesh=device_mesh,
                bucket_cap_mb=bucket_cap_mb,
                fusion_threshold_mb=fusion_threshold_mb,
                bucket_cap_mb_list=bucket_cap_mb_list,
                find_unused_parameters=find_unused_parameters,
                gradient_as_bucket_view=gradient_as_bucket_view,
                static_graph=static_graph,
                delay_all_reduce_named_params=delay_all_reduce_named_params,
                param_to_hook_all_reduce=param_to_hook_all_reduce,
                mixed_precision=mixed_precision,
            )
            config = GradientFlowConfig(  # gradientflow's options as given, θ and the buffers' flag as resolved
                compression=compression,
                density=density,
                chunk_size=chunk_size,
                warmup_steps=warmup_steps,
                quant_bits=quant_bits,
                quant_block=quant_block,
                quant_levels=quant_levels,
                quant_precondition=quant_precondition,
                quant_warmup_steps=quant_warmup_steps,
                quant_clip=quant_clip,
                timeout=timeout,
                fusion_threshold_mb=settings.fusion_threshold_mb,
                broadcast_buffers=settings.forward_sync_buffers,
                # these five take more than the config's Literal types (torch's dtypes, any case): it normalises them
                comm_dtype=comm_dtype,  # type: ignore[arg-type]
                algorithm=algorithm,  # type: ignore[arg-type]
                chunk_score=chunk_score,  # type: ignore[arg-type]
                csc_scope=csc_scope,  # type: ignore[arg-type]
                schedule=schedule,  # type: ignore[arg-type]
                momentum=momentum,
                dense_1d=dense_1d,
                check_consistency=check_consistency,
                check_finite=check_finite,
                trace_path=os.fspath(trace_path) if isinstance(trace_path, os.PathLike) else trace_path,
                trace_steps=trace_steps,
                topology=topology,
                sync_every=sync_every,
                outer_lr=outer_lr,
                outer_momentum=outer_momentum,
                outer_compression=outer_compression,
                outer_density=outer_density,
                sync_fragments=sync_fragments,
                sync_delay=sync_delay,
                outer_state_device=outer_state_device,
            )
            # a torchft Manager: each outer sync among the replicas alive (outer/membership.py), None: a fixed set
            self._gf_replicas = replicas
            self._gf_validate(module, settings, config)
        except (ValueError, TypeError, RuntimeError) as e:
            error = e
        agree_on_construction(
            error, self.__dict__.get("process_group") or fallback_group(process_group, device_mesh), module
        )
        settings, group = self._gf_settings, self.process_group
        end_groups_at_exit()
        # One exchange compares the options that must agree and the models (even with init_sync=False:
        # a mismatch there is a hang or a silently wrong model later).
        named = [(n, p) for n, p in module.named_parameters() if n not in self._gf_ignored]
        signature = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        signature += [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers() if n not in self._gf_ignored]
        device = named[0][1].device
        check_same_setup(self.config, signature, group, self._gf_watchdog, device)
        if settings.init_sync:
            states = [p for _, p in named] + (self._gf_module_buffers if settings.init_sync_buffers else [])
            with torch.no_grad():
                broadcast_coalesced(states, self._gf_src, group, self._gf_watchdog, "parameter broadcast")
        # schedule="auto": θ and csc_scope from the measured link; self.schedule says what and why
        self.config, self.schedule = resolve_schedule(
            self.config, group, self._gf_watchdog, self._gf_params, self._gf_src
        )
        self._gf_outer = fewer_syncs.build(self)  # sync_every > 1: the outer loop (its groups, its hooks)
        self._gf_build_engine(order=None)

    def _gf_validate(self, module: nn.Module, settings: DDPSettings, config: GradientFlowConfig) -> None:
        """The module against the arguments and options (``settings``, ``config``: each checked already), on this
        rank alone (no collective); torch DDP's attributes set."""
        self.config = compat.recipe_theta(config, settings.theta_given)  # the quantised recipe's own θ
        mechanisms.check_door(self.config.mechanism, "ddp", f"compression={self.config.compression!r}")
        nested.check_wrap(module, self.config)  # a DDP inside: refused where two DDPs' results would differ
        # torch DDP's public attributes, same names and meaning.
        self.module = module
        self.device_ids = settings.device_ids
        self.output_device = settings.output_device
        self.dim = settings.dim
        self.forward_sync_buffers = settings.forward_sync_buffers
        self.find_unused_parameters = settings.find_unused_parameters
        self.gradient_as_bucket_view = settings.gradient_as_bucket_view
        self.static_graph = settings.static_graph
        self.require_backward_grad_sync = True  # False inside no_sync(), as in DDP
        # True after a synchronised forward (and at first): the next forward, with grad or not, broadcasts
        # the buffers, as torch DDP does (a validation pass after training sees rank 0's BatchNorm stats).
        self.require_forward_param_sync = True
        self.device_mesh = settings.device_mesh
        self.bucket_cap_mb_list = settings.bucket_cap_mb_list
        self.bucket_bytes_cap_list = [int(c * 1024 * 1024) for c in self.bucket_cap_mb_list or []]
        self._gf_torch = TorchRegistrations()
        self._gf_device = settings.device
        self._gf_ignored = nested.ignored(module)
        self._gf_settings = settings
        self._gf_attach_group(settings.process_group)
        self._gf_collect_tensors()
        if not self._gf_params and not self._gf_sparse_params:
            raise DDPValueError(
                "gradientflow.DistributedDataParallel: the module has no parameter that requires a gradient, so "
                "there is nothing to synchronise (torch DDP refuses it too). Wrap the trainable model."
            )
        if not self._gf_params:
            names = ", ".join(repr(n) for n, p in module.named_parameters() if p in set(self._gf_sparse_params))
            raise DDPValueError(
                f"gradientflow.DistributedDataParallel: the module has only sparse gradients ({names}); the engine "
                "needs at least one dense trainable parameter. Use torch DDP for this module, or sparse=False."
            )
        self.config = self.config.resolved(sum(p.numel() for p in self._gf_params), self._gf_params[0].device)
        self.config = resolved_topology(self.config, self.process_group)  # "auto" -> "flat" or "MxG"
        self._gf_auto = auto.AutoState(requested=self.config.compression == "auto")
        fewer_syncs.check(self)
        self._gf_outer: fewer_syncs.FewerSyncs | None = None  # sync_every > 1: built once the replicas agree

    # ---- construction (also after unpickling or a change of device/dtype) -----------------
    def _gf_attach_group(self, group: dist.ProcessGroup) -> None:
        self.process_group = group
        timeout = resolve_timeout(self.config.timeout, group, between_nodes=between_nodes(self.config, group))
        self._gf_watchdog = Watchdog(group, timeout)
        self._gf_world_size = dist.get_world_size(group)
        self._gf_src = dist.get_global_rank(group, 0)

    def _gf_collect_tensors(self) -> None:
        named = [(n, p) for n, p in self.module.named_parameters() if n not in self._gf_ignored]
        sparse = sparse_gradient_params(self.module)  # torch DDP syncs these apart, one allreduce each
        self._gf_sparse_params = [p for n, p in named if p.requires_grad and n in sparse]
        self._gf_sparse = SparseGradSync(self._gf_sparse_params, self.process_group, self._gf_watchdog)
        self._gf_names = [n for n, p in named if p.requires_grad and n not in sparse]
        self._gf_params = [p for n, p in named if p.requires_grad and n not in sparse]
        self._gf_frozen = [(n, p) for n, p in named if not p.requires_grad and p.is_floating_point()]
        self._gf_module_buffers = [b for n, b in self.module.named_buffers() if n not in self._gf_ignored]

    def _gf_build_engine(self, order: list[int] | None, layout_final: bool = False) -> None:
        """A reducer (pool, strategy, hooks) for the current parameters (``order``: a saved layout order)."""
        if self._gf_shares_engine():  # a gradientflow model inside: its engine serves both (nested.py)
            return
        old = self.__dict__.get("_gf_engine")
        if old is not None:
            old.remove_hooks()
        hooked = self._gf_torch.comm_hook is not None
        # A hook's then() callbacks issue collectives from the backend's threads (PowerSGD: P, then Q):
        # the used exchange, issued before the hooks' futures are waited for, must not share their group.
        control = control_group(self) if self.config.needs_control_group or hooked else None  # once per wrapper
        inner = self._gf_outer.engine_setup(self) if self._gf_outer is not None else None
        if hooked:
            make_sync = self._gf_make_sync()
        elif inner is not None:  # sync_every > 1 on nodes: dense every step inside the node, on its group
            make_sync = build_strategy(inner[0], inner[1], inner[2], control, None)
        else:
            make_sync = build_strategy(self.config, sync_group(self), self._gf_watchdog, control, node_groups(self))
        config, group, watchdog = inner if inner is not None else (self.config, self.process_group, self._gf_watchdog)
        self._gf_engine = Reducer(
            self._gf_params,
            self._gf_names,
            config,
            group,
            watchdog,
            control,
            self.static_graph,
            order,
            make_sync,
            find_unused=self.find_unused_parameters,
            layout_final=layout_final,
            totals=old.totals if old is not None else None,  # the run's, since construction
            local_steps=self._gf_outer is not None and self._gf_outer.local_steps,  # sync_every > 1, flat
        )
        self._gf_optimizers = OptimizerWatch(self, self.__dict__.get("_gf_optimizers"))
        if self._gf_optimizers.scaler is not None:  # a rebuild (after .to()) keeps the registration
            self._gf_engine.register_grad_scaler(self._gf_optimizers.scaler)

    # ---- forward ------------------------------------------------------------------------
    # Under torch.compile, dynamo traces this frame, which holds nothing but the module's forward: what the wrapper
    # does before and after it runs in the two disabled methods, which hand each other their state through ``self``
    # (``_gf_forward_state``).  A value dynamo saw in this frame would be guarded on: the wrapper's flags
    # (``require_backward_grad_sync``, ``require_forward_param_sync``) compiled the module again for ``no_sync``
    # micro-steps, and the trace's timestamp would be a float guarded by value.  So the module compiles once, as
    # inside torch DDP, whose flags dynamo never sees (its forward is in torch's files, which dynamo skips).
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        inputs, kwargs = self._gf_pre_forward(inputs, kwargs)
        return self._gf_post_forward(self.module(*inputs, **kwargs))

    @torch.compiler.disable
    def _gf_pre_forward(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Before the module's forward: the checks, buffers from rank 0, the inputs on the module's device."""
        if self._gf_engine.unused.pending_error is not None and torch.is_grad_enabled():
            self._gf_engine.raise_pending()  # the last backward left a parameter without gradient (torch's error)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        outer = self._gf_outer
        if outer is not None:
            outer.loop.restore_replica()  # after load_comm_state_dict: this replica's own parameters
            if outer.local_steps:  # sync_every > 1, flat: each rank steps on its own gradient
                sync = False
        self._gf_engine.forward_started(sync)  # frees last step's fresh gradients; torch's runtime logging
        tr = self._gf_engine.trace
        self._gf_forward_state = (sync, time.perf_counter() if tr is not None and tr.active else None)
        if sync:
            self._gf_before_sync_forward()
        if self.require_forward_param_sync and self._gf_syncs_buffers():
            self._gf_sync_buffers(post_forward=False)
        if self._gf_device is not None:
            inputs, kwargs = move_to_device(inputs, self._gf_device), move_to_device(kwargs, self._gf_device)
        return inputs, kwargs

    @torch.compiler.disable
    def _gf_post_forward(self, out: Any) -> Any:
        """After the module's forward: buffers (a post-forward buffer hook), the backward armed, the trace's span."""
        sync, t_fwd = self._gf_forward_state
        if self.require_forward_param_sync and self._gf_syncs_buffers():
            self._gf_sync_buffers(post_forward=True)
        # sync_every > 1: buffers from rank 0 at the first forward after an outer sync (_gf_after_outer_sync)
        self.require_forward_param_sync = sync and self._gf_outer is None
        if torch.is_grad_enabled():
            self._gf_after_forward(out, sync)
        tr = self._gf_engine.trace
        if t_fwd is not None and tr is not None:
            tr.complete("forward", "forward", t_fwd, time.perf_counter())
        return out

    def _gf_after_outer_sync(self) -> None:
        """sync_every > 1, after an outer sync: the next forward broadcasts the buffers from rank 0, as torch DDP's
        first forward does (the replicas' BatchNorm statistics drifted apart with their parameters)."""
        self.require_forward_param_sync = True

    def _gf_before_sync_forward(self) -> None:
        for name, p in self._gf_frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"gradientflow: parameter '{name}' had requires_grad=False when the model was wrapped and "
                    "requires grad now; its gradient would never be synchronised. Set requires_grad before "
                    "wrapping (toggling it off and on again later is fine), or wrap the model anew."
                )
        if self._join_config.enable:
            work = Join.notify_join_context(self)
            if work is not None and not self._gf_torch.divide_by_initial_world_size:
                self._gf_engine.call_after_step(self._gf_rescale_by_active(work))
        auto.switch_if_chosen(self)

    def _gf_syncs_buffers(self) -> bool:
        return self.forward_sync_buffers and bool(self._gf_module_buffers) and self._gf_world_size > 1

    def _gf_current_buffers(self) -> list[torch.Tensor]:
        """The module's buffers as they are now: one the model reassigned (not changed in place) is the one sent."""
        self._gf_module_buffers = [b for n, b in self.module.named_buffers() if n not in self._gf_ignored]
        return self._gf_module_buffers

    @torch.compiler.disable  # also called by Lightning's strategy (manual optimisation), outside the forward
    def _gf_after_forward(self, out: Any, sync: bool) -> None:
        self._gf_engine.arm(out, sync)
        if sync and self._gf_sparse_params:
            self._gf_sparse.arm(out)

    def _gf_sync_buffers(self, post_forward: bool) -> None:
        """Before forward (or after it, with a post-forward buffer hook): the buffer broadcast, or the user's hook."""
        hook = self._gf_torch.buffer_hook
        if hook is None:
            if not post_forward:
                self._gf_broadcast_buffers(active=True)
            return
        state, fn, pre_forward = hook
        if pre_forward != post_forward:
            named = {n: b for n, b in self.module.named_buffers() if n not in self._gf_ignored}
            for fut in fn(state, named) or []:
                fut.wait()

    def _gf_broadcast_buffers(self, active: bool) -> None:
        """Buffers from rank 0 (under ``Join``: from the highest rank still training), looked up now."""
        src = self._gf_src
        if self._join_config.enable:
            src = common_rank(self.process_group, self.join_device, self._gf_watchdog, candidate=active)
        buffers = self._gf_current_buffers()
        with torch.no_grad():
            broadcast_coalesced(buffers, src, self.process_group, self._gf_watchdog, "buffer broadcast")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside the context synchronises them."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # ---- uneven inputs (torch Join; join() itself is in TorchDDPAPI) -------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        return GradientFlowJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._gf_params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # ---- torch DDP's attributes that its methods change (set here, where the others are) -------
    @property
    def broadcast_buffers(self) -> bool:
        """Deprecated alias of ``forward_sync_buffers`` (as in torch 2.13 DDP)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction (before the first backward, as torch requires)."""
        if self._gf_engine.watchdog.step > 0:
            msg = "_set_static_graph() should be called before training loop starts (after wrapping the model)"
            self._gf_engine.runtime.note_error(msg)
            raise RuntimeError(msg)
        self.static_graph = True
        self._gf_engine.usage.make_static()

    # ---- nn.Module plumbing: device/dtype changes, copies, pickling ------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> DistributedDataParallel:
        super()._apply(fn, recurse)
        engine = self.__dict__.get("_gf_engine")
        if engine is None:
            return self  # during __init__
        layout = engine.pool.layout
        self._gf_collect_tensors()
        if [(p.dtype, p.device) for p in self._gf_params] != [layout.keys[s.pool] for s in layout.slots]:
            if engine.sync.has_state():
                raise ValueError(
                    "gradientflow: the model's device or dtype changed after sparse (density) residuals were "
                    "created. Move the model before the first step, or save comm_state_dict(), rebuild the "
                    "wrapper on the new device and load it."
                )
            self._gf_build_engine(list(layout.order), layout_final=engine.layout_final)
        return self

    # ---- introspection ------------------------------------------------------------------
    def comm_stats(self, total: bool = False) -> dict[str, float | int | str]:
        """The last synchronised step's counters (:class:`StepStats`; ``total=True``: summed since construction,
        with ``steps``), the active ``compression`` (under ``"auto"`` also ``compression_auto``: what picked it) and
        the node layout (``nodes``, ``ranks_per_node``; ``topology`` when two-level); with ``sync_every > 1`` the outer
        syncs' counters since construction (:meth:`gradientflow.outer.loop.OuterLoop.stats`)."""
        stats = self._gf_engine.totals if total else self._gf_engine.last_stats
        counters = stats.as_dict()
        outer: dict[str, Any] = {}
        if self._gf_outer is not None:  # the exchange between nodes is the outer sync's: its bytes are payload_bytes
            counters = self._gf_outer.between_nodes(counters, self._gf_engine.dense_bytes, total)
            outer = self._gf_outer.stats(self._gf_engine.dense_bytes)
        return {**counters, **auto.describe(self), **layout_stats(self), **outer}

    @property
    def pool(self) -> GradPool:
        """The gradient pool (its ``layout`` and flat ``buffers``); read-only.  With ``sync_every > 1`` on a flat
        layout it holds no memory (meta tensors): no gradient is ever exchanged there."""
        return self._gf_engine.pool
