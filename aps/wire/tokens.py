"""Tokens: how strong one is, making one, and the per-user token files of loopback servers.

A server on a loopback address started without ``--token``, ``--token-file`` or
``--insecure`` makes a token of its own and writes it to a file only this user
can read, keyed by the address it listens on (the way Jupyter does); workers,
``aps status`` and ``aps checkpoint`` of the same user find it there
(:func:`find_token`). Another local user can reach the port, but not the file.

Both ends use this module: it imports nothing of aps but the errors.
"""

from __future__ import annotations

import errno
import math
import os
import secrets
import stat
import string
from collections import Counter

from ..errors import ConfigurationError

__all__ = [
    "MIN_GUESS_BITS",
    "MIN_TOKEN_BITS",
    "check_token",
    "guess_bits",
    "recognised",
    "find_token",
    "new_token",
    "remove_token_file",
    "token_bits",
    "token_dir",
    "token_path",
    "write_token_file",
]

#: Tokens estimated weaker than this are refused (a guess per nanosecond for 10^22 years).
MIN_TOKEN_BITS = 128
#: ... and tokens that zxcvbn (Dropbox's estimator: dictionary words, names, keyboard
#: walks, sequences, repeats, dates, l33t) finds guessable in fewer than 2^this tries
#: (:func:`guess_bits`).
MIN_GUESS_BITS = 100
#: What zxcvbn recognises that tells a token a person made: words and names (and their l33t),
#: keyboard walks, runs like abcdef or 13579, repeats.
_PEOPLE_MAKE = frozenset({"dictionary", "spatial", "sequence", "repeat"})
#: zxcvbn reads at most this many characters of a token (its work grows with the length;
#: it takes at most 72).
_ESTIMATED_CHARS = 64
#: What a refusal tells the operator to do.
HOW_TO_MAKE_ONE = "make one with `aps token`"

_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
_HEX = frozenset(string.hexdigits.lower())
_HEX_UPPER = frozenset(string.digits + "ABCDEF")
# The character classes of the estimate, with the number of characters each holds.
_CLASSES = (
    (frozenset(string.ascii_lowercase), 26),
    (frozenset(string.ascii_uppercase), 26),
    (frozenset(string.digits), 10),
    (frozenset(string.punctuation), 32),
    (frozenset(" "), 1),
)


def new_token() -> str:
    """A new random token: 32 bytes from the OS's generator, URL-safe base64 (43 characters, 256 bits),
    never starting with ``-`` (``aps serve --token -x...`` would read it as an option)."""
    while True:
        token = secrets.token_urlsafe(32)
        if not token.startswith("-"):
            return token


def token_bits(token: str) -> float:
    """A conservative estimate of the entropy of ``token``, in bits.

    ``length x log2(alphabet)``, where the alphabet is the union of the character
    classes the token uses (lowercase, uppercase, digits, punctuation, the space;
    16 for a hexadecimal token; a character outside them counts for a class of 32), and
    the length is that of the token's shortest repeating unit (``abcabc`` counts
    as ``abc``). As if every character were drawn at random from that alphabet: a
    word or a date scores higher than it deserves, which is why the limit is high.
    """
    if not token:
        return 0.0
    chars = set(token)
    if chars <= _HEX or chars <= _HEX_UPPER:
        alphabet = 16
    else:
        alphabet = sum(size for members, size in _CLASSES if chars & members)
        if chars - set().union(*(members for members, _ in _CLASSES)):
            alphabet += 32
    return _period(token) * math.log2(max(alphabet, 2))


def guess_bits(token: str) -> float:
    """log2 of the guesses zxcvbn (Dropbox's estimator) says an attacker who knows how
    people make secrets needs for ``token``'s first :data:`_ESTIMATED_CHARS` characters:
    a token made of words, names, keyboard walks, sequences, repeats, dates or l33t scores
    what those are worth, not what its length suggests."""
    return _estimate(token)[0]


def recognised(token: str) -> float:
    """The share of ``token``'s first :data:`_ESTIMATED_CHARS` characters that zxcvbn takes for
    something people make secrets of (a word, a walk, a run, a repeat): high for a token a
    person made, low for a random one (a random token of 32 hexadecimal characters has about
    a tenth)."""
    return _estimate(token)[1]


def _estimate(token: str) -> tuple[float, float]:
    from zxcvbn import zxcvbn

    part = token[:_ESTIMATED_CHARS]
    if not part:
        return 0.0, 1.0
    found = zxcvbn(part)
    # (dates and years are left out: a random token of hexadecimal or decimal digits is full
    # of what reads as one)
    covered = sum(len(match["token"]) for match in found["sequence"] if match["pattern"] in _PEOPLE_MAKE)
    return float(found["guesses_log10"]) / math.log10(2), covered / len(part)


def check_token(token: str, what: str = "--token") -> None:
    """Raise ConfigurationError unless ``token`` looks strong enough: at least
    :data:`MIN_TOKEN_BITS` by :func:`token_bits`, at least 8 different characters, no
    character making up more than a third of it, and, when zxcvbn finds most of it made of
    what people make secrets of (:func:`recognised`: half or more), at least
    :data:`MIN_GUESS_BITS` by :func:`guess_bits`. (zxcvbn counts what it does not recognise
    at log2(10) bits a character, whatever the alphabet: its estimate alone would refuse
    random tokens of 128 bits, as 22 base64 or 24 alphanumeric characters.)"""
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        raise ConfigurationError(
            f"{what} is too weak: about {bits:.0f} bits of entropy, at least {MIN_TOKEN_BITS} are needed "
            f"(a short token is guessed in seconds); {HOW_TO_MAKE_ONE}"
        )
    counts = Counter(token)
    if len(counts) < 8 or max(counts.values()) * 3 > len(token):
        raise ConfigurationError(f"{what} is too repetitive to be a secret; {HOW_TO_MAKE_ONE}")
    guessed, share = _estimate(token)
    if share >= 0.5 and guessed < MIN_GUESS_BITS:
        raise ConfigurationError(
            f"{what} is guessable: zxcvbn's estimate of how people make secrets finds {share:.0%} of it made of "
            f"words, keyboard walks, sequences or dates, and it falls in about 2^{guessed:.0f} guesses "
            f"(at least 2^{MIN_GUESS_BITS} are needed); {HOW_TO_MAKE_ONE}"
        )


def _period(text: str) -> int:
    """The length of the shortest unit ``text`` repeats, at least twice (``abcabcab``: 3), or
    its own length when it repeats none (a random token that merely ends as it began is not
    a repetition)."""
    n = len(text)
    # The prefix function of Knuth-Morris-Pratt: n - border is the smallest period.
    border = [0] * n
    k = 0
    for i in range(1, n):
        while k and text[i] != text[k]:
            k = border[k - 1]
        if text[i] == text[k]:
            k += 1
        border[i] = k
    period = n - border[-1]
    return period if 2 * period <= n else n


# Token files ------------------------------------------------------------------------------
def token_dir() -> str:
    """Where this user's servers keep their token files: ``$APS_RUNTIME_DIR``, else
    ``$XDG_RUNTIME_DIR/aps`` when that runtime directory is this user's alone (as systemd
    makes it; one that others can write to is passed over, or another user could make
    ``aps`` in it first), else ``~/.aps``, each with ``tokens`` below it."""
    base = os.environ.get("APS_RUNTIME_DIR")
    if not base:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        base = (
            os.path.join(runtime, "aps")
            if runtime and _own_private(runtime)
            else os.path.join(os.path.expanduser("~"), ".aps")
        )
    return os.path.join(base, "tokens")


def _own_private(path: str) -> bool:
    try:
        info = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def token_path(host: str, port: int) -> str:
    """The token file of a server listening on ``host:port``."""
    name = host.strip("[]").lower().replace(":", "_").replace("/", "_")
    return os.path.join(token_dir(), f"{name}-{port}.token")


def _private_dir(path: str, *, create: bool) -> bool:
    """True when ``path`` is a directory of this user's that nobody else may write to
    (created 0700 with ``create``); raises ConfigurationError when it exists and is not."""
    if create:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigurationError(f"cannot create {path} for the token file: {exc.strerror or exc}") from None
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise ConfigurationError(f"{path} must be a directory of this user's that no one else can write to")
    return True


def write_token_file(host: str, port: int, token: str) -> str:
    """Write ``token`` to the token file of ``host:port``, readable by this user only
    (mode 0600, from its creation); returns its path. A file left there by a server
    that is gone (it held this port) is replaced."""
    path = token_path(host, port)
    _private_dir(os.path.dirname(path), create=True)
    partial = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    except FileExistsError:
        os.unlink(partial)
        return write_token_file(host, port, token)
    except OSError as exc:
        raise ConfigurationError(f"cannot write the token file {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (token + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, path)  # readers see the whole token or none
    return path


def remove_token_file(path: str, token: str | None) -> None:
    """Remove the token file ``path`` if it still holds ``token`` (at a clean shutdown;
    None: whatever it holds)."""
    try:
        if token is None or _read(path) == token:
            os.unlink(path)
    except (OSError, ConfigurationError):
        pass


def find_token(host: str, port: int, *, other_loopback_names: bool = True) -> bytes | None:
    """The token a server of this user on ``host:port`` wrote, or None: its own file,
    and for a loopback name (``other_loopback_names``), the files of the other loopback
    names at the same port. A file that another user could have written (or planted) is
    refused with an error."""
    names = [host.strip("[]").lower()]
    if other_loopback_names and (names[0] in _LOOPBACK_NAMES or names[0].startswith("127.")):
        names += [name for name in _LOOPBACK_NAMES if name != names[0]]
    for name in names:
        path = token_path(name, port)
        try:
            if not _private_dir(os.path.dirname(path), create=False):
                return None
            token = _read(path)
        except FileNotFoundError:
            continue
        if token:
            return token.encode("utf-8")
    return None


def _read(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigurationError(f"{path} is a symbolic link: not a token file of this user's") from None
        if isinstance(exc, FileNotFoundError):
            raise
        raise ConfigurationError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise ConfigurationError(
                f"{path} must be a regular file of this user's, readable by no one else (mode 0600)"
            )
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()
