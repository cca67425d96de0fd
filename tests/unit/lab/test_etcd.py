"""The private etcd's Unix-socket directory (aps.lab.etcd): private, and short enough for a
socket's path whatever the temporary directory is."""

import os
import shutil
import stat
import tempfile
from pathlib import Path

from aps.lab.etcd import _CLIENT_SOCKET, Etcd


def test_the_socket_directory_is_private_and_its_path_fits_a_socket(tmp_path, monkeypatch):
    """In the etcd's own directory (the launcher's log directory) when its path fits a socket's,
    else in the temporary directory, else in /tmp; 0700 wherever it is."""
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # (tmp_path may be too long: popen-gw0/...)
    try:
        etcd = Etcd(short / "etcd", unix=True)
        made = etcd._make_socket_dir()
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700 and made.parent == short / "etcd"
    finally:
        shutil.rmtree(short)
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # (a log directory, and a TMPDIR, as long as some clusters give)
    deep.mkdir(parents=True)
    far = Etcd(deep, unix=True)
    made = far._make_socket_dir()
    try:
        assert made.parent == Path(tempfile.gettempdir()) and len(str(made / _CLIENT_SOCKET)) < 108
    finally:
        made.rmdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = far._make_socket_dir()
    try:
        assert str(made).startswith("/tmp/aps-etcd-") and len(str(made / _CLIENT_SOCKET)) < 108
    finally:
        made.rmdir()
    assert os.listdir(deep) == []  # (the ones too long for a socket were removed)
