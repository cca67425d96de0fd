"""``aps launch``: an embedded server and N worker processes, torn down completely."""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("torch")

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts")


def launch(*args, log_dir, env=None, **popen):
    cmd = [sys.executable, "-m", "aps", "launch", "--host", "127.0.0.1", "--no-progress", "--log-dir", str(log_dir),
           *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})), **popen)


def finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"aps launch did not finish:\n{out}\n{err}") from None
    return proc.returncode, out, err


def read_pids(pid_dir, workers, timeout=60.0):
    """The pids the stubborn workers recorded: each worker and the child it started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [os.path.join(pid_dir, f"{rank}.pids") for rank in range(workers)]
        if all(os.path.exists(f) for f in files):
            return [int(pid) for f in files for pid in Path(f).read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"the workers did not start: {os.listdir(pid_dir)}")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_all_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.05)
    left = [pid for pid in pids if not gone(pid)]
    for pid in left:  # do not leak them into the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"orphans left behind: {left}"


@pytest.mark.slow  # (a whole launched example run: about 20 s beside the suite)
def test_launch_runs_the_builtin_example(tmp_path):
    proc = launch("--workers", "2", "--sync", "bsp", "--lr", "0.05", "--example", "digits", "--epochs", "1",
                  log_dir=tmp_path)
    code, out, err = finish(proc)
    assert code == 0, err
    assert re.match(r"aps: serving on tcp://127\.0\.0\.1:\d+; 2 workers", out)
    assert re.search(r"^aps: dashboard on http://127\.0\.0\.1:\d+/$", out, re.M), out  # on by default
    assert "all 2 workers finished" in out
    for rank in range(2):
        log = (tmp_path / f"worker-{rank}.log").read_text()
        assert re.search(rf"rank {rank}: \d+ iterations", log), log
    assert "test accuracy" in (tmp_path / "worker-0.log").read_text()


@pytest.mark.slow  # (two launched runs of uneven workers: about 18 s)
def test_step_time_and_slowdown_emulate_uneven_devices(tmp_path):
    proc = launch("--workers", "2", "--sync", "asp", "--step-time", "0.05", "--slowdown", "1,3",
                  os.path.join(SCRIPTS, "paced.py"), log_dir=tmp_path)
    code, out, err = finish(proc)
    assert code == 0, err
    clocks = [int(re.search(r"clock (\d+)", (tmp_path / f"worker-{r}.log").read_text()).group(1)) for r in range(2)]
    # 1.5 s at 50 ms and at 150 ms an iteration: about 30 and 10 (sleeping never shortens an iteration)
    assert clocks[0] <= 31 and clocks[1] <= 11
    assert clocks[0] > 1.8 * clocks[1], clocks


def test_a_crashing_worker_stops_everything(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = launch("--workers", "3", "--sync", "asp", os.path.join(SCRIPTS, "stubborn.py"), log_dir=tmp_path,
                  env={"PID_DIR": str(pid_dir), "CRASH_RANK": "1"})
    pids = read_pids(pid_dir, 3)
    code, out, err = finish(proc, timeout=60)
    assert code == 3
    assert "worker 1 exited with status 3; stopping the others" in err
    assert "crashing on purpose" in err  # the tail of its log
    assert_all_gone(pids)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
def test_interrupting_the_launcher_leaves_no_process_behind(tmp_path, signum):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = launch("--workers", "2", "--sync", "asp", os.path.join(SCRIPTS, "stubborn.py"), log_dir=tmp_path,
                  env={"PID_DIR": str(pid_dir)})
    pids = read_pids(pid_dir, 2)
    proc.send_signal(signum)
    code, out, err = finish(proc, timeout=60)
    assert code == 128 + signum  # 130 for Ctrl-C
    assert f"{signal.Signals(signum).name}: stopping the workers and the server" in err
    assert_all_gone(pids)


@pytest.mark.parametrize("replicas", [1, 2], ids=["embedded-server", "replica-set"])
def test_a_launcher_killed_with_sigkill_leaves_no_server_or_worker_behind(tmp_path, replicas):
    """SIGKILL gives the launcher no chance to stop anything: the kernel tells its workers, its
    replicas and its etcd (SIGTERM, PR_SET_PDEATHSIG), and each stops."""
    if replicas > 1 and shutil.which("etcd") is None:
        pytest.skip("needs etcd (Debian's etcd-server)")
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = launch("--workers", "2", "--sync", "asp", "--replica-count", str(replicas),
                  os.path.join(SCRIPTS, "stubborn.py"), log_dir=tmp_path, env={"PID_DIR": str(pid_dir)})
    pids = read_pids(pid_dir, 2)
    workers, grandchildren = pids[0::2], pids[1::2]  # (each worker's own child is the script's to stop)
    started = {child.pid for child in psutil.Process(proc.pid).children()} - set(workers)
    assert len(started) == 0 if replicas == 1 else len(started) >= 3, started  # the replicas and etcd
    proc.kill()
    proc.communicate()
    try:
        assert_all_gone(workers + sorted(started), timeout=20)
    finally:
        for pid in grandchildren:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_workers_that_ignore_sigterm_are_killed_and_a_second_signal_hurries(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = launch("--workers", "2", "--sync", "asp", os.path.join(SCRIPTS, "stubborn.py"), log_dir=tmp_path,
                  env={"PID_DIR": str(pid_dir), "IGNORE_SIGTERM": "1"})
    pids = read_pids(pid_dir, 2)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the launcher is in its grace period: the workers ignore SIGTERM
    assert proc.poll() is None and not any(gone(pid) for pid in pids)
    proc.send_signal(signal.SIGINT)  # a second signal: SIGKILL now, not after the grace period
    code, out, err = finish(proc, timeout=60)
    assert code == 128 + signal.SIGTERM
    assert_all_gone(pids)


def test_bad_launch_arguments_are_refused(tmp_path, capsys):
    from aps.cli import main

    for args, message in [
        (["--workers", "2", "--step-time", "0.1", "--slowdown", "1,2,3", "--example", "digits"],
         "--slowdown needs 2 positive numbers"),
        (["--workers", "2", "--example", "cifar"], "--example takes one of"),
        (["--workers", "2", str(tmp_path / "missing.py")], "no such script"),
        (["--workers", "2"], "give a training script, or --example NAME"),
        (["--workers", "2", "--step-time", "0.1", "--slowdown", "1,x", "--example", "digits"],
         "--slowdown needs 2 positive numbers"),
        (["--workers", "2", "--step-time", "0.1", "--jitter", "-1", "--example", "digits"], "--jitter must be >= 0"),
        (["--workers", "2", "--slowdown", "1,2", "--example", "digits"], "give it too"),
        (["--workers", "2", "--shards", "3", "--port", "7450", "--http-port", "7451", "--example", "digits"],
         "keep them at least 3 apart"),
        (["--workers", "2", "--shards", "2", "--shard", "1", "--example", "digits"], "give --shards K, not --shard"),
        (["--workers", "2", "--replica-count", "0", "--example", "digits"], "--replica-count must be at least 1"),
        (["--workers", "2", "--replicas", "127.0.0.1:7450,127.0.0.1:7451", "--example", "digits"],
         "give --replica-count R, not --replicas or --advertise"),
        (["--workers", "2", "--coordinator", "etcd://127.0.0.1:2379", "--example", "digits"],
         "give --replica-count too"),
    ]:
        # through the command's entry point in this process: refused before anything starts
        with pytest.raises(SystemExit) as exited:
            main(["launch", "--host", "127.0.0.1", "--no-progress", "--log-dir", str(tmp_path), *args])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err, (args, err)
    code, out, err = finish(launch("--workers", "2", log_dir=tmp_path), timeout=30)  # and as a process of its own
    assert code == 2 and "give a training script, or --example NAME" in err, err


def test_launch_with_replicas_and_no_etcd_says_what_it_needs(tmp_path, capsys, monkeypatch):
    from aps.cli import main
    from aps.lab import etcd

    monkeypatch.setattr(etcd, "etcd_available", lambda: False)
    with pytest.raises(SystemExit) as exited:
        main(["launch", "--no-progress", "--log-dir", str(tmp_path), "--workers", "2", "--replica-count", "2",
              "--example", "digits"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--replica-count needs a coordinator: --coordinator etcd://HOST:PORT" in err
    assert os.listdir(tmp_path) == []  # refused before anything started


@pytest.mark.slow  # (a launched run that waits 7 s for a late worker)
def test_launch_says_which_workers_have_not_joined(tmp_path):
    """A worker that is slow to join leaves the others waiting: the launcher and the workers say who is missing."""
    proc = launch("--workers", "2", "--sync", "asp", os.path.join(SCRIPTS, "late.py"), log_dir=tmp_path,
                  env={"LATE_S": "7"})
    code, out, err = finish(proc)
    assert code == 0, err
    assert f"aps: waiting for workers to join: 1 of 2 workers joined; missing rank 1 (see {tmp_path}/worker-1.log)" in err
    log = (tmp_path / "worker-0.log").read_text()
    assert "rank 0: waiting for the other workers at tcp://127.0.0.1:" in log
    assert "1 of 2 workers joined; missing rank 1" in log and "rank 0 done" in log


def test_launch_writes_its_logs_where_asked_or_to_a_new_temporary_directory(tmp_path):
    cmd = [sys.executable, "-m", "aps", "launch", "--host", "127.0.0.1", "--no-progress", "--workers", "1",
           "--sync", "asp", os.path.join(SCRIPTS, "late.py")]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path) == []  # nothing in the working directory
    log_dir = re.search(r"logs in (\S+)", done.stdout).group(1)
    try:
        assert os.path.dirname(log_dir) == tempfile.gettempdir()
        assert "rank 0 done" in Path(log_dir, "worker-0.log").read_text()
    finally:
        shutil.rmtree(log_dir)


@pytest.mark.slow
def test_launch_with_shards_trains_across_several_servers(tmp_path):
    proc = launch("--workers", "2", "--shards", "2", "--sync", "bsp", "--lr", "0.05", "--example", "digits",
                  "--epochs", "1", log_dir=tmp_path)
    code, out, err = finish(proc)
    assert code == 0, err
    assert re.match(r"aps: serving on tcp://127\.0\.0\.1:\d+,tcp://127\.0\.0\.1:\d+ \(2 shards\); 2 workers", out)
    assert len(re.findall(r"^aps: dashboard on http://127\.0\.0\.1:\d+/ \(shard [01]\)$", out, re.M)) == 2
    for rank in range(2):
        log = (tmp_path / f"worker-{rank}.log").read_text()
        assert re.search(rf"rank {rank}: \d+ iterations", log), log
    assert "test accuracy" in (tmp_path / "worker-0.log").read_text()


def test_launch_prints_each_workers_last_line_as_it_finishes(tmp_path):
    """What a run came to: each worker's last line of output (its result), as it ends."""
    script = tmp_path / "train.py"
    script.write_text(
        "import os\n"
        "import numpy as np\n"
        "import aps\n"
        "with aps.Worker.from_env() as worker:\n"
        "    worker.init({'w': np.zeros(4, np.float32)})\n"
        "    worker.push_pull(worker.grads)\n"
        "print('some progress', flush=True)\n"
        "print(f\"rank {os.environ['RANK']}: final loss 0.0{os.environ['RANK']}\\n\", flush=True)\n"
    )
    code, out, err = finish(launch("--workers", "2", "--sync", "asp", "--no-dashboard", str(script),
                                   log_dir=tmp_path / "logs"), timeout=60)
    assert code == 0, err
    for rank in range(2):
        assert f"aps: worker {rank} finished: rank {rank}: final loss 0.0{rank}\n" in out, out
    assert out.index("finished: rank") < out.index("all 2 workers finished")


@pytest.mark.slow  # (a launched example run with two replica sets and a private etcd: about 30 s)
@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (Debian's etcd-server)")
def test_launch_with_replicas_trains_through_the_death_of_a_primary(tmp_path):
    """--replica-count 2 with two shards: four server processes and a private etcd. kill -9 of
    shard 0's primary mid-run: its backup takes over, the launcher starts the dead replica
    again (it rejoins as a backup), the workers finish every iteration, and nothing is left."""
    proc = launch("--workers", "2", "--shards", "2", "--replica-count", "2", "--sync", "bsp", "--lr", "0.05",
                  "--step-time", "0.05", "--example", "digits", "--epochs", "4", log_dir=tmp_path)
    lines = []
    while not any(line.startswith("aps: shard 1 replica set:") for line in lines):
        line = proc.stdout.readline()
        assert line, f"aps launch ended early:\n{''.join(lines)}\n{proc.stderr.read()}"
        lines.append(line)
    text = "".join(lines)
    # (on a Unix socket in a directory of its own, not on a loopback port another user could reach)
    coordinator = re.search(r"^aps: coordinator: a private etcd on unix://(/\S+/aps-etcd-\w+)/etcd:1", text, re.M)
    assert coordinator, text
    assert re.search(r"^aps: serving on tcp://127\.0\.0\.1:\d+,tcp://127\.0\.0\.1:\d+ \(2 shards\)", text, re.M)
    sets = {int(m[1]): m[2] for m in re.finditer(r"^aps: shard (\d) replica set: (.*)$", text, re.M)}
    pids = {shard: [int(pid) for pid in re.findall(r"pid (\d+)", members)] for shard, members in sets.items()}
    primary = int(re.search(r"pid (\d+) \(primary\)", sets[0])[1])
    assert all(len(p) == 2 for p in pids.values()) and primary in pids[0], sets
    worker_log = tmp_path / "worker-0.log"
    deadline = time.monotonic() + 90
    while "epoch 1:" not in (worker_log.read_text() if worker_log.exists() else ""):  # training is under way
        assert time.monotonic() < deadline and proc.poll() is None, "the workers never finished an epoch"
        time.sleep(0.1)
    os.kill(primary, signal.SIGKILL)
    started = set()  # every process the launcher started (etcd, the replicas, the one started again)
    while proc.poll() is None and time.monotonic() < deadline + 90:
        try:
            started |= {child.pid for child in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    code, out, err = finish(proc, timeout=60)
    assert code == 0, f"{out}\n{err}"
    assert re.search(r"aps: shard 0 replica \d \(127\.0\.0\.1:\d+\) exited with status -9: starting it again; "
                     r"it rejoins as a backup", out), out
    for rank in range(2):  # every iteration of 4 epochs, each worker half of the 1,437 training digits a batch of 32
        log = (tmp_path / f"worker-{rank}.log").read_text()
        assert re.search(rf"rank {rank}: 88 iterations", log), log
    assert "epoch 4: test accuracy" in (tmp_path / "worker-0.log").read_text()
    assert "back at tcp://127.0.0.1:" in (tmp_path / "worker-0.log").read_text() + (tmp_path / "worker-1.log").read_text()
    dead = pids[0].index(primary)
    survivor = (tmp_path / f"shard-0-replica-{1 - dead}.log").read_text()
    assert "waiting for its primary" in survivor and "took over from" in survivor, survivor
    back = (tmp_path / f"shard-0-replica-{dead}.log").read_text()  # (both its starts)
    assert "following primary" in back.split("primary at term")[-1], back  # back as a backup
    assert survivor.count("holds the whole state") >= 1, survivor  # the dead replica, back and caught up
    assert "its primary retired it (the run is over)" in back, back  # stopped in order at the end: no failover
    assert_all_gone(started | {pid for p in pids.values() for pid in p})
    assert not os.path.exists(coordinator[1])  # (the etcd's socket directory is gone with it)
