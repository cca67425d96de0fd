"""``--kernel-isa`` (``APS_KERNEL_ISA``) picks the instruction set of the update kernels; ``aps
status``, the statistics and ``/metrics`` say which runs; one this processor lacks is refused."""

from __future__ import annotations

import asyncio

import pytest

from aps import _core
from aps.cli.status import fetch_stats, format_stats

from .test_http import get, http_address, samples


@pytest.mark.parametrize("isa", _core.kernel_isas())
def test_the_kernels_instruction_set_is_the_one_asked_for_and_said(server_process, isa):
    server = server_process("--workers", "1", "--http-port", "0", env={"APS_KERNEL_ISA": isa})
    base = http_address(server)
    stats = fetch_stats(server.address)
    assert stats["server"]["kernels"] == {"isa": isa, "fused_multiply_add": _core.fused_multiply_add()}
    assert f"kernels {isa}" in format_stats(stats).splitlines()[0]
    fma = str(_core.fused_multiply_add()).lower()
    status, text, _ = asyncio.run(get(base + "metrics"))
    assert status == 200 and samples(text)[("aps_kernel_isa_info", (("fused_multiply_add", fma), ("isa", isa)))] == 1


def test_an_instruction_set_the_processor_lacks_or_that_does_not_exist_is_refused(server_process):
    from aps.errors import ConfigurationError
    from aps.server import Server

    with pytest.raises(ConfigurationError, match="--kernel-isa"):
        Server(workers=1, kernel_isa="sse9")
    missing = [isa for isa in _core.KERNEL_ISAS if isa not in _core.kernel_isas()]
    if missing:
        with pytest.raises(ConfigurationError, match=f"--kernel-isa {missing[0]}: this processor cannot run"):
            Server(workers=1, kernel_isa=missing[0])
    chosen = _core.kernel_isa()
    assert chosen == _core.kernel_isas()[-1]  # nothing changed
