"""The replication link's frames and handshake (aps.server.replica_link) and the
coordinator's record (aps.server.coordinator), without processes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aps.config import ServerConfig
from aps.errors import ConfigurationError
from aps.server.coordinator import Coordinator, CoordinatorUnavailable, Record
from aps.server.replica_link import LinkRefused, accept_primary, connect_backup, decode_state, encode_state


def _joined(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


def test_a_state_frame_carries_the_manifest_and_every_array_exactly():
    arrays = {
        "weights": np.arange(10, dtype=np.float32),
        "state:momentum": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
        "state:tables/t/ids": np.array([3, 1, 2], np.int64),
    }
    number, manifest, got = decode_state(_joined(encode_state(7, {"version": 3}, arrays)))
    assert number == 7 and manifest == {"version": 3}
    assert list(got) == list(arrays)
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype and np.array_equal(got[name], array)


@pytest.mark.parametrize("cut", ["short", "long", "dtype", "json"])
def test_a_state_frame_that_does_not_hold_together_is_refused(cut):
    body = _joined(encode_state(1, None, {"weights": np.ones(4, np.float32)}))
    if cut == "short":
        body = body[:-1]
    elif cut == "long":
        body += b"\0"
    elif cut == "dtype":
        body = body.replace(b"float32", b"object\0\0")
    else:
        body = b"\0\0\0\x05{nope"
    with pytest.raises(LinkRefused):
        decode_state(body)


def test_the_handshake_needs_the_token_on_both_sides():
    async def run(primary_token: bytes, backup_token: bytes) -> tuple[object, object]:
        outcome: dict[str, object] = {}

        async def backup(reader, writer):
            try:
                hello, answer = await accept_primary(reader, writer, backup_token, 5)
                answer(True)
                outcome["backup"] = hello
            except LinkRefused as exc:
                outcome["backup"] = exc
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(backup, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await connect_backup(reader, writer, primary_token, {"primary": "a:1", "term": 3}, 5)
            primary: object = "ok"
        except LinkRefused as exc:
            primary = exc
        writer.close()
        await asyncio.sleep(0.05)
        server.close()
        return primary, outcome.get("backup")

    primary, backup = asyncio.run(run(b"k" * 16, b"k" * 16))
    assert primary == "ok" and backup == {"primary": "a:1", "term": 3}
    primary, backup = asyncio.run(run(b"k" * 16, b"x" * 16))
    assert isinstance(primary, LinkRefused) and isinstance(backup, LinkRefused)


def test_a_record_aps_did_not_write_is_refused():
    assert Record.decode(b'{"primary":"a:1","backups":["b:2"],"run":"x"}', 5) == Record("a:1", ("b:2",), 5, {"run": "x"})
    for raw in (b"nope", b'{"primary":1,"backups":[]}', b'{"backups":[]}', b"[]"):
        with pytest.raises(CoordinatorUnavailable):
            Record.decode(raw, 1)


def test_a_coordinator_that_is_not_there_changes_nothing_and_says_so():
    async def run():
        coordinator = Coordinator("etcd://127.0.0.1:1", "x")
        try:
            await coordinator.read()
        finally:
            await coordinator.close()

    with pytest.raises(CoordinatorUnavailable, match="127.0.0.1:1"):
        asyncio.run(run())
    with pytest.raises(ConfigurationError, match="etcd://"):
        Coordinator("zookeeper://h:1", "x")


@pytest.mark.parametrize(
    "options, says",
    [
        ({"replicas": "127.0.0.1:7001,127.0.0.1:7002", "port": 7001, "token": "Zq3vN8wLk2pR7sT1yU5xC9bM4dF6gH0j"}, "--coordinator"),
        ({"replicas": "127.0.0.1:7001,127.0.0.1:7002", "port": 7001, "coordinator": "etcd://h:1"}, "token"),
        ({"failover_timeout": 0.0}, "--failover-timeout"),
    ],
)
def test_replica_options_that_cannot_work_are_refused(options, says):
    with pytest.raises(ConfigurationError, match=says):
        ServerConfig(**options)


def test_a_backups_answer_names_its_primary_and_is_a_connection_error():
    import aps
    from aps.errors import ErrorCode, error_from_code

    said = error_from_code(ErrorCode.NOT_PRIMARY, aps.NotPrimary.SAYS + "10.0.0.2:7450")
    assert isinstance(said, aps.NotPrimary) and isinstance(said, ConnectionError)
    assert said.primary == "10.0.0.2:7450"
    assert error_from_code(ErrorCode.NOT_PRIMARY, aps.NotPrimary.SAYS).primary is None
