"""A gradient refused as not finite is refused saying where: the tensors of the model that hold
NaN or infinity (by the names the worker gave them), how many elements and the first one; a
finite gradient whose update would overflow is said to be finite. The server logs the refusal
once, and nothing changes."""

import numpy as np
import pytest

import aps

F = np.float32


def model():
    return {"a": np.zeros(3, F), "b": np.zeros((2, 3), F), "c": np.zeros(2, F)}


def nan_in_b_and_c():
    grads = {name: np.zeros_like(value) for name, value in model().items()}
    grads["b"][1, 2] = np.nan
    grads["b"][0, 1] = np.inf  # (the first in flat order: b[0, 1])
    grads["c"][:] = np.nan
    return grads


@pytest.mark.parametrize("sync", ["asp", "bsp"])  # applied alone, and added to a round
def test_the_refusal_names_the_tensors_and_the_server_says_it_once(server_process, client, sync):
    server = server_process("--workers", "1", "--sync", sync, "--lr", "0.5")
    with client(server.address, 0, 1) as worker:
        worker.init(model())
        with pytest.raises(aps.NonFiniteGradient) as raised:
            worker.push(nan_in_b_and_c())
        message = str(raised.value)
        assert "in 'b' (2 of 6 elements; b[0, 1] is inf), 'c' (2 of 2 elements; c[0] is nan)" in message, message
        assert "'a'" not in message and "changed nothing" in message
        weights = worker.pull()
        assert worker.version == 0 and all(not value.any() for value in weights.values())
    log = server.log()
    assert log.count("NaN or infinity") == 1, log  # one line: the connection's, with its rank
    assert "(rank 0): NON_FINITE_GRADIENT: the gradient holds NaN or infinity in 'b'" in log, log


def test_a_compressed_gradient_is_named_alike(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    with aps.Worker(server.address, 0, 1, transport="tcp", compression="bf16") as worker:
        worker.init(model())
        grads = {name: np.zeros_like(value) for name, value in model().items()}
        grads["c"][1] = -np.inf
        with pytest.raises(aps.NonFiniteGradient, match=r"in 'c' \(1 of 2 elements; c\[1\] is -inf\)"):
            worker.push(grads)


def test_many_tensors_are_counted_past_the_first_three(server_process):
    server = server_process("--workers", "1", "--sync", "asp")
    names = [f"layer{i}" for i in range(6)]
    with aps.Worker(server.address, 0, 1, transport="tcp") as worker:
        worker.init({name: np.zeros(2, F) for name in names})
        with pytest.raises(aps.NonFiniteGradient) as raised:
            worker.push({name: np.full(2, np.nan, F) for name in names})
    assert "'layer0'" in str(raised.value) and "'layer2'" in str(raised.value) and "'layer3'" not in str(raised.value)
    assert "and 3 more tensors" in str(raised.value)


def test_a_finite_gradient_whose_update_overflows_is_said_to_be_finite(server_process):
    server = server_process("--workers", "1", "--sync", "asp", "--lr", "1e30")
    with aps.Worker(server.address, 0, 1, transport="tcp") as worker:
        worker.init(model())
        grads = {name: np.full_like(value, 1e10) for name, value in model().items()}  # lr * 1e10: beyond float32
        with pytest.raises(aps.NonFiniteGradient, match="the gradient is finite, but the update would make a weight"):
            worker.push(grads)
        assert worker.pull()["a"].tolist() == [0.0, 0.0, 0.0]
