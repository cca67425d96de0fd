"""Another user of this host, for tests and the chaos soak: the attacks a second local user
can make (guessing the token on loopback, a server on a dead server's port) are tried as
one. As root, :func:`as_second_user` runs a program as ``nobody`` with ``setpriv``."""

from __future__ import annotations

import os
import shutil
import tempfile

__all__ = ["SECOND_UID", "as_second_user", "second_user_env", "second_user_unavailable"]

#: ``nobody``: the second user.
SECOND_UID = 65534


def second_user_unavailable() -> str | None:
    """Why no program can be run as a second user here, or None when one can."""
    if os.geteuid() != 0:
        return "running a program as another user needs root (setpriv --reuid)"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    return None


def as_second_user(argv: list[str]) -> list[str]:
    """``argv`` run as user ``nobody`` (uid and gid 65534, no supplementary groups)."""
    return ["setpriv", f"--reuid={SECOND_UID}", f"--regid={SECOND_UID}", "--clear-groups", "--", *argv]


def second_user_env(home: str | None = None) -> dict[str, str]:
    """An environment for the second user's programs: this one's, without the token or the
    runtime directories of the first user, with a home of its own (made when not given)."""
    if home is None:
        home = tempfile.mkdtemp(prefix="aps-second-user-")
        os.chown(home, SECOND_UID, SECOND_UID)
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("APS_TOKEN", "APS_RUNTIME_DIR", "XDG_RUNTIME_DIR")
    }
    env.update(HOME=home, PYTHONDONTWRITEBYTECODE="1")
    return env
