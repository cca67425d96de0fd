"""Another user of the same machine cannot keep a server from starting by taking the place its
Unix socket goes (``--unix-socket auto``: ``TMP/aps-UID/``), made first or made a link: the
server puts its socket in a fresh private directory and its workers still use shared memory;
where no private place can be made at all, it goes on over TCP, saying so. The second user is
``nobody``, run with ``setpriv`` (as root: skipped otherwise)."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import aps
from aps.testing import TOKEN
from aps.testing.users import SECOND_UID as NOBODY
from aps.testing.users import as_second_user, second_user_unavailable

pytestmark = pytest.mark.skipif(second_user_unavailable() is not None, reason=str(second_user_unavailable()))


def as_nobody(*command: str) -> None:
    subprocess.run(as_second_user(list(command)), check=True, timeout=30)


@pytest.fixture
def shared_tmp():
    """A directory every local user may create in, as /tmp is (mode 1777)."""
    root = tempfile.mkdtemp(prefix="aps-shared-")
    os.chmod(root, 0o1777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def serve(server_process, base: str, *flags: str):
    # (the token given: the server's own would go under $XDG_RUNTIME_DIR, where this test's workers do not look)
    return server_process("--workers", "1", "--sync", "asp", "--token", TOKEN, *flags,
                          env={"XDG_RUNTIME_DIR": base})


def train_over_shared_memory(server) -> None:
    with aps.Worker(server.address, 0, 1, transport="shm", token=TOKEN) as worker:
        worker.init({"w": np.zeros(4, np.float32)})
        worker.push_pull({"w": np.ones(4, np.float32)})
        assert worker.transport == "shm" and worker.version == 1


@pytest.mark.parametrize("made", ["directory", "link"])
def test_a_socket_directory_taken_by_another_user_does_not_stop_the_server(server_process, shared_tmp, made):
    taken = os.path.join(shared_tmp, f"aps-{os.getuid()}")
    if made == "directory":
        as_nobody("mkdir", "-m", "700", taken)
    else:  # a link to a private directory of root's: not a place of the server's choosing
        target = tempfile.mkdtemp(prefix="root-private-", dir=shared_tmp)
        as_nobody("ln", "-s", target, taken)
    assert os.lstat(taken).st_uid == NOBODY
    server = serve(server_process, shared_tmp)
    path = server.unix_path
    directory = os.path.dirname(path)
    assert path and os.path.dirname(directory) == shared_tmp and directory != taken, path
    info = os.lstat(directory)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert f"cannot use {taken}/{server.port}.sock" in server.log()
    train_over_shared_memory(server)
    assert server.stop() == 0
    assert not os.path.exists(directory)  # the server's own directory goes with it
    assert os.lstat(taken).st_uid == NOBODY  # the other user's is left as it was
    if made == "link":
        assert os.listdir(target) == []  # nothing was put, or swept, there


def test_with_no_private_place_at_all_the_server_goes_on_over_tcp(server_process, tmp_path):
    base = tmp_path / "a-file"  # $XDG_RUNTIME_DIR a file: no directory can be made under it
    base.write_text("")
    server = serve(server_process, str(base))
    assert "no shared memory; workers on this host use TCP" in server.log()
    with aps.Worker(server.address, 0, 1, token=TOKEN) as worker:  # transport="auto"
        worker.init({"w": np.zeros(4, np.float32)})
        assert worker.transport == "tcp"
    with pytest.raises(aps.ConfigurationError, match="offers it no Unix socket"):
        aps.Worker(server.address, 0, 1, transport="shm", token=TOKEN)


def test_an_explicit_socket_path_in_another_users_directory_is_a_clear_error(shared_tmp):
    theirs = os.path.join(shared_tmp, "theirs")
    as_nobody("mkdir", "-m", "700", theirs)
    result = subprocess.run([sys.executable, "-m", "aps", "serve", "--port", "0", "--unix-socket",
                             os.path.join(theirs, "aps.sock")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"{theirs} must belong to this user and be private" in result.stderr, result.stderr
