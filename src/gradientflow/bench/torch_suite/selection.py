"""Which of torch's DDP tests run by default and in CI (names from distributed_test.py, torch 2.13.0)."""

# The CI-sized selection tests/compat/test_torch_suite.py runs on gradientflow (one pair of rank
# processes, ~1 s a test after the imports): one or two per behaviour fixed for issue 29.
CI: tuple[str, ...] = (
    "test_DistributedDataParallelCPU",
    "test_ddp_broadcast_buffer",
    "test_undefined_grad_parity_unused_parameters",
    "test_invalid_static_graph",
    "test_ddp_hook_parity_allreduce",
    "test_ddp_grad_div_uneven_inputs",
    "test_ddp_build_debug_param_to_name_mapping",
)

DEFAULT: tuple[str, ...] = ()
