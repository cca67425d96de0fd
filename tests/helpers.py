"""The shared test helpers live in :mod:`aps.testing` (bench/ uses them too); this
module keeps ``from tests.helpers import ...`` working."""

from aps.testing import (  # noqa: F401
    FIND,
    SPAWN,
    TOKEN,
    RawClient,
    RawShmClient,
    ServerProcess,
    SteadyCluster,
    mapped_memfds,
    memfd_inodes,
    run_processes,
    wait_for,
)
