"""Which of torch's DDP tests run by default and in CI (names from distributed_test.py, torch 2.13.0)."""

DEFAULT: tuple[str, ...] = ()
CI: tuple[str, ...] = ()
