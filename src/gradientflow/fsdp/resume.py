"""The warning of a resume that loaded a gradientflow FSDP module without its recipe state: said by
:class:`.module_comm.ModuleComm` at its next exchange, below :mod:`.checkpoint` (which reads the modules' state)."""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

_WARNED: list[str] = []  # the resume warning, said once per process


def warn_resume_without_state(comm: Any) -> None:
    """Rank 0's warning, once per process: ``comm``'s module (a ``ModuleComm``) was loaded by ``load_state_dict``
    (torch's ``set_state_dict``, the user's own DCP code) and its recipe state was not.

    Why a warning and not the state inside the model's state dict, where torch's ``get_state_dict`` would carry it
    with no new line: see docs/fsdp.md (Checkpoints).  The state is per rank and per mesh; a model state dict is
    loaded into plain torch models, onto other meshes, consolidated to one file: each would break or gather it."""
    if _WARNED or not dist.is_initialized() or dist.get_rank() != 0:
        return
    _WARNED.append(comm.recipe)
    warnings.warn(
        "gradientflow.fsdp: the model was loaded (load_state_dict, torch's set_state_dict) without gradientflow's "
        f"recipe state: the error-feedback residuals of compression={comm.recipe!r} (what each rank has not sent "
        "yet) restart at zero and the step counts with them, so a resumed run drifts from the uninterrupted one. "
        "If this resumes a gradientflow run, save and load the state beside the model and optimizer: "
        'state["gradientflow"] = gradientflow.fsdp.comm_state(model), in dcp.save and dcp.load alike '
        "(docs/fsdp.md, Checkpoints). Loading weights to start a new run (fine-tuning) needs nothing.",
        stacklevel=2,
    )
