"""The failed-AUTH throttle (aps.server.admission.AuthThrottle) on a clock of its own, and
whom failures count against (auth_key: a local peer by its user, found in /proc/net/tcp)."""

from __future__ import annotations

import os
import socket

import pytest

from aps.server.admission import AuthThrottle
from aps.server import peers
from aps.server.peers import GONE, principal, tcp_peer_uid


def fail(throttle: AuthThrottle, key: str, now: float) -> float | None:
    """One attempt of ``key`` at ``now`` that turns out wrong: its wait, as the server would
    take it (checked at ``now + wait``)."""
    wait = throttle.wait(key, now)
    if wait is not None:
        throttle.checked(key)
        throttle.failed(key, now + wait)
    return wait


def test_a_principal_that_has_not_failed_is_never_held_back_by_others():
    throttle = AuthThrottle()
    now = 0.0
    for _ in range(200):  # one guesser, far past its own free tries and the server's budget
        wait = fail(throttle, "uid 65534", now)
        now += (wait or 0.0) + 0.001
    assert throttle.failures("uid 65534", now) == 200
    assert throttle.wait("uid 0", now) == 0.0 and throttle.wait("uid 1000", now) == 0.0
    assert throttle.wait("10.0.0.7", now) == 0.0


def test_one_principals_turns_double_up_to_the_cap_and_a_success_forgets_them():
    throttle = AuthThrottle()
    waits = []
    now = 0.0
    for _ in range(10):
        wait = fail(throttle, "uid 65534", now)
        waits.append(wait)
        now += wait
    assert waits[: AuthThrottle.FREE] == [0.0] * AuthThrottle.FREE
    expected = [min(AuthThrottle.BASE_S * 2 ** k, AuthThrottle.MAX_DELAY_S) for k in range(10 - AuthThrottle.FREE)]
    assert waits[AuthThrottle.FREE :] == pytest.approx(expected)
    throttle.succeeded("uid 65534")
    assert throttle.wait("uid 65534", now) == 0.0 and throttle.failures("uid 65534", now) == 0


def test_parallel_attempts_wait_as_if_those_before_them_failed_and_too_long_a_wait_is_refused():
    throttle = AuthThrottle()
    for _ in range(AuthThrottle.FREE):
        fail(throttle, "uid 65534", 0.0)
    waits = [throttle.wait("uid 65534", 0.0) for _ in range(12)]  # all sent at once, none answered yet
    given = [wait for wait in waits if wait is not None]
    assert given == sorted(given) and given[-1] <= AuthThrottle.MAX_WAIT_S
    gaps = [b - a for a, b in zip(given, given[1:])]
    assert gaps == pytest.approx([min(AuthThrottle.BASE_S * 2 ** k, AuthThrottle.MAX_DELAY_S)
                                  for k in range(len(gaps))])
    assert waits[len(given):] == [None] * (12 - len(given)) and len(given) < 12


def test_guesses_from_many_addresses_are_held_to_the_servers_rate_together():
    """Past the server's budget of failures, principals that have failed take the server's
    turns too: a thousand addresses guessing get no more than RATE checks a second between
    them, however many each is allowed alone."""
    throttle = AuthThrottle()
    addresses = [f"203.0.113.{n % 250}/{n}" for n in range(1000)]
    now, checks = 0.0, []
    for _ in range(AuthThrottle.FREE):  # each address's free tries (the first few: the price of the bound)
        for address in addresses:
            fail(throttle, address, now)
    for round_ in range(3):
        for address in addresses:
            wait = throttle.wait(address, now)
            if wait is not None:
                checks.append(now + wait)
                throttle.checked(address)
                throttle.failed(address, now + wait)
        now += 1.0
    checks.sort()
    span = checks[-1] - checks[0]
    assert len(checks) <= AuthThrottle.RATE * (span + AuthThrottle.MAX_WAIT_S) + AuthThrottle.BURST
    per_second = max(sum(1 for at in checks if t <= at < t + 1) for t in range(int(checks[-1]) + 1))
    assert per_second <= AuthThrottle.RATE + 1, per_second
    assert throttle.wait("uid 0", now) == 0.0  # and a principal that never failed goes first


def test_the_table_is_bounded_and_forgets():
    throttle = AuthThrottle()
    for n in range(AuthThrottle.MAX_PEERS + 100):
        throttle.failed(f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}", 0.0)
    assert len(throttle) == AuthThrottle.MAX_PEERS
    throttle.failed("uid 65534", 0.0)
    assert throttle.failures("uid 65534", AuthThrottle.FORGET_S + 1) == 0


def test_a_loopback_peer_counts_as_its_user_whatever_its_address():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        for source in ("127.0.0.1", "127.0.0.9"):
            client = socket.create_connection(listener.getsockname(), source_address=(source, 0))
            accepted, peer = listener.accept()
            try:
                assert peer[0] == source
                assert tcp_peer_uid(peer, accepted.getsockname()) == os.getuid()
                assert peers._read_table(peer, accepted.getsockname()) == os.getuid()  # (where sock_diag is not)
                assert principal(peer, accepted.getsockname()) == f"uid {os.getuid()}"
            finally:
                client.close()
                accepted.close()
    finally:
        listener.close()


def test_a_remote_peer_counts_as_its_address_or_its_ipv6_64():
    assert principal(("192.0.2.7", 5000), ("192.0.2.1", 7450)) == "192.0.2.7"
    assert principal(("2001:db8:1:2:aaaa::7", 5000, 0, 0), ("2001:db8::1", 7450, 0, 0)) == "2001:db8:1:2::/64"
    assert principal(("::ffff:192.0.2.7", 5000, 0, 0), ("::ffff:192.0.2.1", 7450, 0, 0)) == "192.0.2.7"


def test_a_closed_peer_is_no_one_not_root():
    """A socket its process closed lingers in the kernel's table as root's (TIME_WAIT, or
    orphaned while it closes): it is gone, and counts as no one."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        client = socket.create_connection(listener.getsockname())
        accepted, peer = listener.accept()
        local = accepted.getsockname()
        assert tcp_peer_uid(peer, local) == os.getuid()
        client.close()  # the client's end closes first: it lingers in TIME_WAIT once both have closed
        accepted.close()
        assert tcp_peer_uid(peer, local) == GONE and principal(peer, local) is None
        assert peers._read_table(peer, local) == GONE
    finally:
        listener.close()
