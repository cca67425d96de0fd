"""The project's container image, built and run by a test with podman, from Debian's archive only.

No container registry is needed: the base image is made here with ``debootstrap`` (Debian
bookworm, ``--variant=minbase``, plus ``python3 python3-venv python3-pip ca-certificates``),
imported into podman as :data:`BASE_TAG`, and the repository's ``Dockerfile`` is built on it
(``--build-arg BASE=...``, ``--pull=never``: nothing is pulled from a registry; the build
itself reaches Debian's archive with apt and PyPI with pip)::

    require_podman()                      # pytest.skip, with the reason, when it cannot work here
    size = build_image("localhost/aps-test:server")
    with Container("localhost/aps-test:server", "--port", "7450", options=["--network", "host"]) as c:
        c.wait_for_log("serving on")

What is made, and where:

- The base's root filesystem, as a tarball named by a digest of what it holds (suite,
  variant, packages, mirror), is cached in ``$APS_IMAGE_CACHE`` (default
  :data:`DEFAULT_CACHE`), with debootstrap's ``.deb`` cache beside it: a second
  :func:`ensure_base_image` on a machine whose podman lost the image imports the tarball
  again instead of bootstrapping. When the image already exists in podman (with the same
  digest in its ``aps.base`` label), nothing at all is done. Lock files in the cache
  directory let parallel test processes share one bootstrap, and take turns to build.
- podman images (:data:`BASE_TAG` and the tags the caller builds) and, while a test runs,
  its containers (labelled :data:`LABEL` ``=`` a per-process value, all removed by
  :meth:`Container.close`).

Nothing else of the system changes: podman's settings (the runtime, and ``default_ulimits``
that this machine can grant: podman's defaults ask more than a sandboxed root may set, and
runc fails with "error setting rlimits ... operation not permitted") go in a
``containers.conf`` of a private temporary directory, named to podman by ``CONTAINERS_CONF``
(which then replaces ``/etc/containers/containers.conf``, never edited). pip in the build
stage trusts what the host trusts: the host's CA bundle (:data:`HOST_CA`) is mounted read-only
over the image's during the build (where the machine reaches PyPI through an inspecting
proxy, Debian's bundle in the image would not know its CA). Every subprocess has a timeout:
on expiry it gets SIGTERM, then SIGKILL.

Needs root, and Debian's ``podman``, ``debootstrap`` and ``runc`` (``apt-get install podman
debootstrap runc``): :func:`require_podman` skips a test with the reason when something is
missing or podman cannot start a container here; :func:`podman_unavailable_reason` says why
without pytest.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import IO
from pathlib import Path

__all__ = [
    "BASE_PACKAGES",
    "BASE_TAG",
    "DEFAULT_CACHE",
    "HOST_CA",
    "LABEL",
    "Container",
    "ImageError",
    "base_digest",
    "build_image",
    "cache_dir",
    "ensure_base_image",
    "image_exists",
    "image_size",
    "leftover_containers",
    "podman",
    "podman_env",
    "podman_unavailable_reason",
    "require_podman",
]

#: The repository's root (its ``Dockerfile`` and build context), when this package runs from a
#: checkout (an installed one is given the checkout: ``build_image(context=...)``).
ROOT = Path(__file__).resolve().parents[2]
#: The base image's tag in podman's store.
BASE_TAG = "localhost/aps-base:bookworm"
SUITE = "bookworm"
VARIANT = "minbase"
#: What the Dockerfile needs of its base beyond minbase: Python 3.10+ with pip (and TLS roots).
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
#: Debian's archive (``$APS_DEBIAN_MIRROR`` names another mirror of it).
MIRROR = os.environ.get("APS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: Where the base's root filesystem is cached when ``$APS_IMAGE_CACHE`` is unset.
DEFAULT_CACHE = "/var/tmp/aps-image-cache"
#: The host's CA bundle, mounted over the image's while it builds (pip reaches PyPI with it).
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
#: The label on every container started here; its value is :data:`SESSION`.
LABEL = "aps.testing"
#: This process's value of :data:`LABEL`: what :func:`leftover_containers` looks for.
SESSION = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
#: Seconds for quick podman calls (inspect, exists, ps, stop, rm).
QUICK = 60.0
#: Seconds a subprocess has after SIGTERM (its timeout passed) before SIGKILL.
GRACE = 10.0
REQUIRED = ("podman", "debootstrap", "runc")


class ImageError(RuntimeError):
    """A step of making, building or running an image failed; the message says which and why."""


# Subprocesses ---------------------------------------------------------------
def _which(name: str) -> str | None:
    # debootstrap and runc live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")


def _run(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    stdout: int | IO[str] = subprocess.PIPE,
    what: str | None = None,
) -> subprocess.CompletedProcess:
    """Run ``argv`` (text, stdout captured unless ``stdout`` is a file, stderr captured) for at
    most ``timeout`` s: then SIGTERM, SIGKILL after :data:`GRACE` s, and :class:`ImageError`."""
    what = what or argv[0]
    proc = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise ImageError(f"{what} took over {timeout:.0f} s and was stopped: {' '.join(argv)}") from None
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check and done.returncode != 0:
        raise ImageError(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n{_tail(err)}")
    return done


def _tail(text: str | None, lines: int = 40) -> str:
    return "\n".join((text or "").strip().splitlines()[-lines:])


# podman's settings ------------------------------------------------------------
def _ulimits() -> list[str]:
    """``default_ulimits`` this process can grant a container: podman's defaults (nofile
    1048576, nproc past the machine's) fail under a root without CAP_SYS_RESOURCE. nproc is
    also kept to ``kernel.pid_max``, beyond which runc's setrlimit failed on such a machine."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else min(nofile, 1048576)
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 32768
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    return [f"nofile={nofile}:{nofile}", f"nproc={nproc}:{nproc}"]


@functools.cache
def _conf_dir() -> str:
    directory = tempfile.mkdtemp(prefix="aps-podman-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    limits = ", ".join(json.dumps(item) for item in _ulimits())
    runtime = _which("runc") or "runc"
    Path(directory, "containers.conf").write_text(
        "# aps.testing.image: podman's settings for the tests (CONTAINERS_CONF), not the system's\n"
        f"[containers]\ndefault_ulimits = [{limits}]\n"
        f'[engine]\nruntime = "runc"\n[engine.runtimes]\nrunc = [{json.dumps(runtime)}]\n'
    )
    return directory


def podman_env() -> dict[str, str]:
    """The environment podman runs with here: this process's, with ``CONTAINERS_CONF``
    naming a private containers.conf (runc, ulimits this machine can grant)."""
    return dict(os.environ, CONTAINERS_CONF=os.path.join(_conf_dir(), "containers.conf"))


def podman(
    *args: str, timeout: float = QUICK, check: bool = True, stdout: int | IO[str] = subprocess.PIPE
) -> subprocess.CompletedProcess:
    """``podman ARGS`` with :func:`podman_env`, for at most ``timeout`` s."""
    return _run(
        [_which("podman") or "podman", *args],
        timeout=timeout,
        env=podman_env(),
        check=check,
        stdout=stdout,
        what=f"podman {args[0] if args else ''}".strip(),
    )


# Can it work here? -------------------------------------------------------------
@functools.cache
def podman_unavailable_reason() -> str | None:
    """Why podman cannot build and run this project's image here, or None when it can: not
    root, a command missing, or podman unable to start a container (tried once per process:
    ``true`` in a throwaway container whose root is the host's, under a private overlay)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "building the image needs root (debootstrap, podman's store in /var/lib/containers)"
    missing = [name for name in REQUIRED if _which(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install podman debootstrap runc)"
    if not os.path.isfile(HOST_CA):
        return f"no CA bundle at {HOST_CA} for pip in the build (Debian: apt-get install ca-certificates)"
    try:
        podman("version", "--format", "{{.Client.Version}}", timeout=30)
        done = podman(
            "run",
            "--rm",
            "--network",
            "none",
            "--label",
            f"{LABEL}={SESSION}",
            "--rootfs",
            "/:O",
            "/bin/true",
            timeout=90,
            check=False,
        )
    except (OSError, ImageError) as exc:
        return f"podman does not answer here: {exc}"
    if done.returncode != 0:
        return f"podman cannot run a container here (exit {done.returncode}): {_tail(done.stderr, 5)}"
    return None


def require_podman() -> None:
    """``pytest.skip`` the calling test, with the reason, when podman cannot work here."""
    reason = podman_unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(reason)


# Images -------------------------------------------------------------------
def cache_dir() -> Path:
    """``$APS_IMAGE_CACHE``, or :data:`DEFAULT_CACHE`: made if missing."""
    path = Path(os.environ.get("APS_IMAGE_CACHE") or DEFAULT_CACHE)
    path.mkdir(parents=True, exist_ok=True)
    return path


def base_digest() -> str:
    """What the base holds, in 16 hex digits: its cache file's name and its ``aps.base`` label."""
    what = json.dumps([SUITE, VARIANT, sorted(BASE_PACKAGES), MIRROR])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def image_exists(tag: str) -> bool:
    return podman("image", "exists", tag, check=False).returncode == 0


def image_size(tag: str) -> int:
    """The image's size in bytes, as ``podman images`` counts it (all its layers)."""
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())


def _label(tag: str, name: str) -> str:
    done = podman("image", "inspect", "--format", f'{{{{index .Config.Labels "{name}"}}}}', tag, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive flock on ``path``, waited for at most ``timeout`` s."""
    with open(path, "a") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ImageError(f"{path} stayed locked for {timeout:.0f} s (another build?)") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    found = []
    with open("/proc/self/mounts") as fh:
        for line in fh:
            point = line.split()[1].encode().decode("unicode_escape")
            if point == str(root) or point.startswith(prefix):
                found.append(point)
    return found


def _remove_tree(root: Path) -> None:
    """Remove a bootstrap's tree, first unmounting what a stopped debootstrap left mounted
    inside it (/proc, /sys): never descend into the host's."""
    for point in sorted(_mounts_under(root), key=len, reverse=True):
        _run(["umount", "--lazy", point], timeout=QUICK, check=False)
    left = _mounts_under(root)
    if left:
        raise ImageError(f"{root} still has mounts ({', '.join(left)}): left in place")
    shutil.rmtree(root, ignore_errors=True)


def _bootstrap(tarball: Path, debs: Path, timeout: float) -> None:
    """debootstrap the base's root filesystem and pack it into ``tarball`` (written whole or not at all)."""
    debs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bootstrap-", dir=tarball.parent))
    root = work / "root"
    try:
        _run(
            [
                _which("debootstrap") or "debootstrap",
                f"--variant={VARIANT}",
                f"--include={','.join(BASE_PACKAGES)}",
                f"--cache-dir={debs}",
                SUITE,
                str(root),
                MIRROR,
            ],
            timeout=timeout,
            what="debootstrap",
        )
        for leftover in [*root.glob("var/cache/apt/archives/*.deb"), *root.glob("var/lib/apt/lists/*_*")]:
            leftover.unlink()
        partial = work / "rootfs.tar"
        _run(["tar", "--numeric-owner", "--xattrs", "-C", str(root), "-cf", str(partial), "."], timeout=600, what="tar")
        os.replace(partial, tarball)
    finally:
        _remove_tree(work)


def ensure_base_image(tag: str = BASE_TAG, *, timeout: float = 1200.0) -> str:
    """Make the Debian base image ``tag`` unless podman holds it already; return ``tag``.

    From the cached root filesystem when there is one (``podman import``), else from
    debootstrap (which caches it): see the module's docstring."""
    digest = base_digest()
    if image_exists(tag) and _label(tag, "aps.base") == digest:
        return tag
    cache = cache_dir()
    with _locked(cache / ".lock", timeout):
        if image_exists(tag) and _label(tag, "aps.base") == digest:  # made meanwhile by another process
            return tag
        tarball = cache / f"{SUITE}-{VARIANT}-{digest}.tar"
        if not tarball.exists():
            _bootstrap(tarball, cache / "debs", timeout)
        podman(
            "import",
            "--quiet",
            "--change",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change",
            f"LABEL aps.base={digest}",
            "--change",
            'CMD ["/bin/bash"]',
            str(tarball),
            tag,
            timeout=600,
        )
    return tag


def build_image(
    tag: str,
    *,
    variant: str = "server",
    base: str | None = None,
    context: str | os.PathLike = ROOT,
    timeout: float = 1800.0,
    log: str | os.PathLike | None = None,
) -> int:
    """Build the repository's Dockerfile as ``tag`` (``VARIANT=variant``) on ``base`` (the
    Debian base, made first when None), and return the image's size in bytes. podman's
    output goes to ``log`` (a temporary file when None); a failure says its last lines."""
    if base is None:
        base = ensure_base_image(timeout=timeout)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_locked(cache_dir() / ".build.lock", timeout))  # one build at a time here
        before = _image_id(tag)
        fh: IO[str] = stack.enter_context(
            tempfile.NamedTemporaryFile("w+", prefix="aps-image-build-", suffix=".log")
            if log is None
            else open(log, "w+")
        )
        done = podman(
            "build",
            "--pull=never",
            "--layers",
            "--force-rm",
            "--build-arg",
            f"BASE={base}",
            "--build-arg",
            f"VARIANT={variant}",
            "--volume",
            f"{HOST_CA}:{HOST_CA}:ro",
            "--file",
            str(Path(context, "Dockerfile")),
            "--tag",
            tag,
            str(context),
            timeout=timeout,
            check=False,
            stdout=fh,
        )
        if done.returncode != 0:
            fh.seek(0)
            raise ImageError(
                f"podman build of {tag} failed (exit {done.returncode}):\n{_tail(fh.read())}\n{_tail(done.stderr, 10)}"
            )
    if before and before != _image_id(tag):  # the tag's previous image, now untagged: not left behind
        podman("image", "rm", before, check=False)
    return image_size(tag)


def _image_id(tag: str) -> str:
    done = podman("image", "inspect", "--format", "{{.Id}}", tag, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


# Containers ----------------------------------------------------------------
class Container:
    """A container of ``image`` running ``command`` in the background (``podman run -d``,
    labelled :data:`LABEL`), stopped and removed by :meth:`close` (or the ``with`` block's
    end), by the id podman gave it."""

    def __init__(self, image: str, *command: str, options: Sequence[str] = (), timeout: float = 120.0) -> None:
        done = podman("run", "--detach", "--label", f"{LABEL}={SESSION}", *options, image, *command, timeout=timeout)
        self.id = done.stdout.strip().splitlines()[-1]
        self.image = image

    def logs(self) -> str:
        """What it wrote, stdout and stderr together."""
        done = podman("logs", self.id, check=False)
        return (done.stdout or "") + (done.stderr or "")

    def state(self) -> dict:
        done = podman("container", "inspect", "--format", "{{json .State}}", self.id, check=False)
        return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}

    def running(self) -> bool:
        return bool(self.state().get("Running"))

    def exists(self) -> bool:
        return podman("container", "exists", self.id, check=False).returncode == 0

    def wait_for_log(self, text: str, timeout: float = 60.0) -> str:
        """Wait until its output holds ``text``; :class:`ImageError` (with the output) if it
        exits first or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while True:
            out = self.logs()
            if text in out:
                return out
            if not self.running():
                out = self.logs()
                if text in out:
                    return out
                raise ImageError(
                    f"container {self.id[:12]} exited ({self.state().get('ExitCode')}) "
                    f"before saying {text!r}:\n{_tail(out)}"
                )
            if time.monotonic() > deadline:
                raise ImageError(f"container {self.id[:12]} did not say {text!r} in {timeout:.0f} s:\n{_tail(out)}")
            time.sleep(0.2)

    def close(self, grace: int = 10) -> None:
        """Stop it (SIGTERM, SIGKILL after ``grace`` s) and remove it."""
        podman("stop", "--time", str(grace), self.id, timeout=grace + QUICK, check=False)
        podman("rm", "--force", self.id, check=False)
        if self.exists():
            raise ImageError(f"container {self.id[:12]} is still there after podman rm")

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftover_containers(session: str = SESSION) -> list[str]:
    """The ids of the containers this process started (label :data:`LABEL` = ``session``) that still exist."""
    done = podman("ps", "--all", "--quiet", "--no-trunc", "--filter", f"label={LABEL}={session}")
    return done.stdout.split()
