"""A torchft Manager for the replica workers of the tests (tests/_replica_worker.py, tests/_replica_group_worker.py):
one rank of a replica on loopback, its Lighthouse the test's.  Every replica starts from the same seed, so none is
healed at the start (``init_sync=False``); a replica waits 60 s at most for a quorum and retries a failed sync up to
20 times (the tests kill and stop replicas inside syncs)."""

from __future__ import annotations

from datetime import timedelta

from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo


def loopback_manager(
    lighthouse: str, replica: int, store_port: int, timeout: timedelta, rank: int = 0, world_size: int = 1
) -> Manager:
    """Rank ``rank`` of replica ``replica`` (of ``world_size`` ranks), its store on loopback at ``store_port``."""
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timeout,
        rank=rank,  # torchft's replica group: this rank of the replica's ranks
        world_size=world_size,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse,
        replica_id=f"replica_{replica}",
        hostname="127.0.0.1",
        init_sync=False,  # the same seed on every replica: the same initial model
        max_retries=20,
    )
