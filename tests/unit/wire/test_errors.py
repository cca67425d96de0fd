"""Wire error codes: each registered by its class (``ServerError.__init_subclass__``), each
mapping to exactly one class, each surviving the trip through an error frame."""

from __future__ import annotations

import pickle

import pytest

import aps
from aps import errors
from aps.errors import ERROR_CODES, ErrorCode, ServerError, error_from_code
from aps.wire.protocol import decode_error, encode_error


def _server_errors(cls=ServerError):
    for sub in cls.__subclasses__():
        yield sub
        yield from _server_errors(sub)


def test_every_code_maps_to_exactly_one_class_and_that_class_carries_it():
    assert set(ERROR_CODES) == set(ErrorCode)
    registered = [cls for cls in _server_errors() if "code" in vars(cls) and cls in ERROR_CODES.values()]
    assert len(registered) == len(set(registered)) == len(ErrorCode)
    for code, cls in ERROR_CODES.items():
        assert cls.code is code
        assert cls.__module__ == "aps.errors"
        assert getattr(errors, cls.__name__) is cls and cls.__name__ in errors.__all__


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.name)
def test_each_code_round_trips_through_an_error_frame(code):
    cls = ERROR_CODES[code]
    sent = cls("what the server said")
    got_code, got_message = decode_error(encode_error(sent.code, sent.message))
    received = error_from_code(got_code, got_message)
    assert type(received) is cls and received.code is code and received.message == "what the server said"
    again = pickle.loads(pickle.dumps(received))  # across a multiprocessing queue too
    assert type(again) is cls and again.code is code and again.message == received.message


def test_an_unknown_code_is_a_plain_server_error_that_names_it():
    received = error_from_code(60000, "from a newer server")
    assert type(received) is ServerError and "60000" in str(received)


def test_a_second_class_for_a_taken_code_is_refused_and_changes_nothing():
    before = dict(ERROR_CODES)
    with pytest.raises(TypeError, match="RANK_TAKEN"):
        class Another(ServerError, code=ErrorCode.RANK_TAKEN):
            pass
    assert dict(ERROR_CODES) == before and ERROR_CODES[ErrorCode.RANK_TAKEN] is aps.RankTaken


def test_the_registry_is_read_only():
    with pytest.raises(TypeError):
        ERROR_CODES[ErrorCode.RANK_TAKEN] = ServerError  # type: ignore[index]


def test_a_subclass_without_a_code_inherits_its_parents_and_registers_nothing():
    before = dict(ERROR_CODES)

    class Narrower(aps.RankTaken):
        pass

    assert Narrower("x").code is ErrorCode.RANK_TAKEN and dict(ERROR_CODES) == before
