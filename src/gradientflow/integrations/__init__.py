"""Where DDP users already are: PyTorch Lightning and Hugging Face accelerate.

- :mod:`gradientflow.integrations.lightning`: ``Trainer(strategy="gradientflow")`` (or
  ``strategy=GradientFlowStrategy(density=0.1)``), a subclass of Lightning's ``DDPStrategy``.
- :mod:`gradientflow.integrations.lightning_fsdp`: ``GradientFlowHSDPStrategy()``, Lightning's
  ``ModelParallelStrategy`` for HSDP with :func:`gradientflow.fsdp.fully_shard` in ``configure_model``.
- :mod:`gradientflow.integrations.accelerate`: ``GradientFlowAccelerator(...)``, an ``Accelerator``
  whose ``prepare`` wraps with gradientflow and whose ``save_state`` / ``load_state`` carry every
  rank's communication state.

Each module imports its client when it is imported, never before: ``import gradientflow`` imports
neither client (it only arranges, through :mod:`._autoregister`, that Lightning learns the
``"gradientflow"`` strategy name when Lightning itself is imported).  Layering: above ``wrapper/``.
"""
