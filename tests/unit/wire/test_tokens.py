"""How strong a token must be (aps.wire.tokens.check_token): random tokens of 128 bits and
more pass, whatever their alphabet; tokens made of words, sequences and keyboard walks do
not, however long."""

from __future__ import annotations

import base64
import random
import string
import uuid

import pytest

from aps.errors import ConfigurationError
from aps.wire.tokens import MIN_GUESS_BITS, check_token, guess_bits, new_token, recognised, token_bits


_ALNUM = string.ascii_letters + string.digits
_RNG = random.Random(45)  # (random tokens as the OS's generator makes them, the same at every run)
_MAKE = {
    "aps-token": lambda: base64.urlsafe_b64encode(_RNG.randbytes(32)).rstrip(b"=").decode(),
    "hex-16": lambda: _RNG.randbytes(16).hex(),  # openssl rand -hex 16
    "hex-32": lambda: _RNG.randbytes(32).hex(),
    "uuid4": lambda: uuid.UUID(bytes=_RNG.randbytes(16), version=4).hex,
    "alphanumeric-24": lambda: "".join(_RNG.choice(_ALNUM) for _ in range(24)),  # pwgen -s 24
    "urlsafe-64": lambda: base64.urlsafe_b64encode(_RNG.randbytes(64)).rstrip(b"=").decode(),
}


@pytest.mark.parametrize("kind", sorted(_MAKE))
def test_random_tokens_of_128_bits_and_more_pass(kind):
    """(zxcvbn alone counts the characters it does not recognise at log2(10) bits each, and
    would refuse many of them)"""
    for _ in range(80):
        check_token(_MAKE[kind]())
    check_token(new_token())


def test_a_token_that_ends_as_it_began_is_not_a_repetition():
    assert token_bits("770519744257f51cc5483102f45bc8c7") == 128
    assert token_bits("abcdef12" * 4) == 32


@pytest.mark.parametrize("token", [
    "correct-horse-battery-staple-42", "abcdefghijklmnopqrstuvwxyz0123456789",
    "qwertyuiopasdfghjklzxcvbnm1234567890!@#$%^&*()", "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.0p;/",
    "Password1!Password2@Password3#", "azertyuiopqsdfghjklmwxcvbn0123456789",
])
def test_long_guessable_tokens_are_refused_and_say_why(token):
    assert guess_bits(token) < MIN_GUESS_BITS and recognised(token) >= 0.5
    with pytest.raises(ConfigurationError, match="guessable|too weak|too repetitive") as refused:
        check_token(token)
    assert token not in str(refused.value) and "aps token" in str(refused.value)


def test_the_estimate_reads_a_bounded_prefix():
    check_token(new_token() * 50)  # (zxcvbn takes at most 72 characters: the first 64 count)
