import pytest

from aps.errors import ConfigurationError
from aps.wire.net import format_address, parse_address


@pytest.mark.parametrize(
    "text, host, port",
    [
        ("tcp://127.0.0.1:7450", "127.0.0.1", 7450),
        ("127.0.0.1:80", "127.0.0.1", 80),
        ("tcp://node-3.cluster:1", "node-3.cluster", 1),
        ("tcp://[::1]:9000", "::1", 9000),
    ],
)
def test_parse(text, host, port):
    address = parse_address(text)
    assert (address.host, address.port) == (host, port)
    assert parse_address(str(address)) == address


@pytest.mark.parametrize("text", ["", "tcp://", "tcp://host", "udp://h:1", "tcp://h:0", "tcp://h:70000", "tcp://h:x", "tcp://[::1]9"])
def test_parse_errors(text):
    with pytest.raises(ConfigurationError):
        parse_address(text)


def test_format_ipv6():
    assert format_address("::1", 5) == "tcp://[::1]:5"
