"""How strong a token must be (aps.wire.tokens.check_token): random tokens of 128 bits and
more pass, whatever their alphabet; tokens made of words, sequences and keyboard walks do
not, however long."""

from __future__ import annotations

import secrets

import pytest

from aps.errors import ConfigurationError
from aps.wire.tokens import MIN_GUESS_BITS, check_token, guess_bits, new_token


@pytest.mark.parametrize("make", [new_token, lambda: secrets.token_urlsafe(32), lambda: secrets.token_hex(20),
                                  lambda: secrets.token_hex(32), lambda: secrets.token_urlsafe(64)],
                         ids=["aps-token", "urlsafe-32", "hex-20", "hex-32", "urlsafe-64"])
def test_random_tokens_pass(make):
    for _ in range(20):
        check_token(make())


def test_most_random_tokens_of_32_hexadecimal_characters_pass_and_each_is_judged_alike():
    tokens = [secrets.token_hex(16) for _ in range(100)]
    passed = [token for token in tokens if guess_bits(token) >= MIN_GUESS_BITS]
    assert len(passed) >= 75, len(passed)  # (zxcvbn counts what it does not recognise at log2(10) a character)
    assert all(guess_bits(token) == guess_bits(token) for token in tokens[:5])


@pytest.mark.parametrize("token", [
    "correct-horse-battery-staple-42", "abcdefghijklmnopqrstuvwxyz0123456789",
    "qwertyuiopasdfghjklzxcvbnm1234567890!@#$%^&*()", "1qaz2wsx3edc4rfv5tgb6yhn7ujm8ik,9ol.0p;/",
    "Password1!Password2@Password3#", "2026-12-06T14:30:00Z-training-run-token",
])
def test_long_guessable_tokens_are_refused_and_say_why(token):
    assert guess_bits(token) < MIN_GUESS_BITS
    with pytest.raises(ConfigurationError, match="guessable|too weak|too repetitive") as refused:
        check_token(token)
    assert token not in str(refused.value) and "aps token" in str(refused.value)


def test_the_estimate_reads_a_bounded_prefix():
    check_token(new_token() * 50)  # (zxcvbn takes at most 72 characters: the first 64 count)
