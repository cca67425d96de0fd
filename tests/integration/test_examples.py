"""The PyTorch examples, alone against an ``aps serve`` address and under ``aps launch``."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("torchvision")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "examples")


def run(cmd, env=None, timeout=240):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


@pytest.mark.slow  # (many processes, a long run: the slow call of .ci/run)
def test_mnist_cnn_against_a_running_server(server_process):
    server = server_process("--workers", "2", "--sync", "ssp", "--staleness", "2", "--lr", "0.05")
    script = os.path.join(EXAMPLES, "mnist_cnn.py")
    procs = [
        subprocess.Popen([sys.executable, script, "--address", server.address, "--rank", str(rank), "--workers", "2",
                          "--dataset", "digits", "--epochs", "2", "--batch-size", "16"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        outputs.append(out)
    accuracies = [float(a) for a in re.findall(r"epoch 2: .*test accuracy ([0-9.]+)", outputs[0])]
    assert accuracies and accuracies[0] > 0.7  # 175 updates train the CNN far past chance (0.1): about 0.85


@pytest.mark.slow  # (a launched run of the CNN: about 10 s alone, 30 s beside the suite)
def test_mnist_cnn_under_aps_launch(tmp_path):
    done = run([sys.executable, "-m", "aps", "launch", "--host", "127.0.0.1", "--workers", "2", "--sync", "dssp",
                "--staleness", "1", "--max-staleness", "4", "--lr", "0.05", "--no-progress", "--log-dir", str(tmp_path),
                os.path.join(EXAMPLES, "mnist_cnn.py"), "--dataset", "digits", "--epochs", "1"])
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        assert f"rank {rank} epoch 1: loss" in (tmp_path / f"worker-{rank}.log").read_text()


@pytest.mark.slow
def test_cifar_resnet_on_fake_data_under_aps_launch(tmp_path):
    done = run([sys.executable, "-m", "aps", "launch", "--host", "127.0.0.1", "--workers", "2", "--sync", "bsp",
                "--lr", "0.01", "--momentum", "0.9", "--no-progress", "--log-dir", str(tmp_path),
                os.path.join(EXAMPLES, "cifar_resnet.py"), "--fake-data", "16", "--batch-size", "4", "--steps", "2",
                "--loader-workers", "0"])
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        log = (tmp_path / f"worker-{rank}.log").read_text()
        assert re.search(rf"rank {rank} epoch 1: 2 steps, test accuracy [0-9.]+, weights version 2\b", log), log


@pytest.mark.slow  # (torch and torchvision imported in a fresh process to say it: about 14 s)
def test_cifar_resnet_without_data_says_what_is_missing(tmp_path):
    done = run([sys.executable, os.path.join(EXAMPLES, "cifar_resnet.py"), "--address", "tcp://127.0.0.1:9",
                "--rank", "0", "--workers", "1", "--data-dir", str(tmp_path)])
    assert done.returncode != 0
    assert "cifar-10-batches-py (no download is attempted)" in done.stderr
