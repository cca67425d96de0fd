"""Local SGD on the virtual clock: the settings that ask for it, how many steps each worker
takes between syncs (fixed, or dynamic from the rates a server would measure), and the
pseudo-gradients the virtual workers push."""

import numpy as np
import pytest

from aps.errors import ConfigurationError
from aps.lab.clock import IterationTimes, LocalSteps, VirtualCluster
from aps.lab.settings import DELAYED_NESTEROV_OUTER, DILOCO_OUTER, parse_setting
from aps.config import ServerConfig
from aps.layout import Layout


def test_local_settings_carry_the_steps_the_outer_step_and_dynamic():
    diloco = parse_setting("bsp+local:50")
    assert (diloco.local_every, diloco.dynamic) == (50, False)
    assert diloco.options == {"sync": "bsp", **DILOCO_OUTER}
    async_local = parse_setting("asp+local:10+dn+dylu")
    assert (async_local.local_every, async_local.dynamic) == (10, True)
    assert async_local.options == {"sync": "asp", **DELAYED_NESTEROV_OUTER}
    assert parse_setting("asp").local_every is None
    for bad in ("asp+dn", "asp+dylu", "asp+local:0", "asp+local:x", "asp+local:2+local:3", "asp+local:2+dn+dn"):
        with pytest.raises(ConfigurationError, match="bad sync setting"):
            parse_setting(bad)


def test_dynamic_steps_follow_the_rates_a_server_keeps():
    steps = LocalSteps(20, 2, True)
    for _ in range(2):  # rank 0: 20 steps a second; rank 1: 20 steps in 2.5 s
        steps.synced(0, steps.current[0], 1.0)
        steps.synced(1, steps.current[1], 2.5)
    assert steps.current == [20, 8]  # ceil(20 * 8 / 20)
    fixed = LocalSteps(20, 2, False)
    fixed.synced(1, 20, 2.5)
    assert fixed.current == [20, 20] and fixed.steps == [0, 20]


@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_dynamic_local_updates_give_the_slow_worker_fewer_steps_under_every_policy(sync):
    """(Its rate counts its own time, not its waits at a BSP barrier.)"""
    config = ServerConfig(workers=2, sync=sync, heartbeat_timeout=0, optimizer="sgd", lr=0.7, momentum=0.9,
                          nesterov=True)
    cluster = VirtualCluster(config, IterationTimes([1.0, 2.5]), Layout(("w",), ((1,),)), np.zeros(1, np.float32),
                             local=(10, True))
    while cluster.next_time <= 200.0:
        cluster.step()
    assert cluster.local.current == [10, 4]  # ceil(10 / 2.5)


def test_each_sync_takes_the_time_of_its_steps():
    """Synchronization only (no gradients): under ASP each worker syncs every H of its iterations."""
    config = ServerConfig(workers=2, sync="asp", heartbeat_timeout=0, optimizer="delayed-nesterov", lr=0.7,
                          momentum=0.9)
    times = IterationTimes([1.0, 2.0])
    cluster = VirtualCluster(config, times, Layout(("w",), ((1,),)), np.zeros(1, np.float32), local=(5, False))
    while cluster.next_time <= 40.0:
        cluster.step()
    assert cluster.per_worker == [8, 4]  # every 5 s and every 10 s
    assert cluster.local.steps == [40, 20]


def test_a_virtual_worker_pushes_the_pseudo_gradient_of_its_inner_steps():
    from aps.lab.virtual import VirtualTrainer
    from aps.workloads.data import load

    data = load("digits", seed=0)
    local = VirtualTrainer(data, 2, batch_size=16, init_seed=0, seed=3, inner=(0.1, 0.0))
    plain = VirtualTrainer(data, 2, batch_size=16, init_seed=0, seed=3)
    weights = local.initial.copy()
    pseudo = np.empty_like(weights)
    local.compute(1, weights, pseudo, 3)
    expected, grad = weights.copy(), np.empty_like(weights)
    for _ in range(3):  # the same batches, in order: inner SGD by hand
        plain.compute(1, expected, grad)
        expected -= np.float32(0.1) * grad
    np.testing.assert_array_equal(pseudo, weights - expected)
    with pytest.raises(ValueError, match="one gradient an iteration"):
        plain.compute(0, weights, grad, 2)


def test_local_settings_are_named_for_what_they_run():
    from aps.lab.compare import label

    assert label("bsp+local:50") == "BSP local H=50"
    assert label("asp+local:10+dn+dylu") == "ASP local H=10 delayed Nesterov dynamic H"


def test_a_real_comparison_starts_the_outer_step_and_tells_the_workers_their_inner_one():
    from types import SimpleNamespace

    from aps.lab.compare import Run, _local_order, _server_config

    args = SimpleNamespace(lr=0.05, momentum=0.5, http_port=None)
    config = _server_config("asp+local:10+dn+dylu", "none", 4, args)
    assert (config.optimizer, config.lr, config.momentum, config.sync) == ("delayed-nesterov", 0.7, 0.9, "asp")
    assert _local_order(Run("asp+local:10+dn+dylu", "none", "c", [1.0] * 4), args) == (10, True, 0.05, 0.5)
    assert _local_order(Run("asp", "none", "c", [1.0] * 4), args) is None
    assert _server_config("asp", "none", 4, args).lr == 0.05
    assert _local_order(Run("bsp+local:10", "none", "c", [1.0] * 4, compression="bf16"), args) == (10, False, 0.05, 0.5)
    with pytest.raises(ConfigurationError, match="compresses its pushes only"):
        _local_order(Run("bsp+local:10", "none", "c", [1.0] * 4, compression="bf16+pulls"), args)


def test_quantized_settings_push_int8_or_int4_under_any_policy_and_once():
    from aps.lab.compare import Run, _compression, label

    assert parse_setting("bsp+local:50+int4").compression == "int4"
    assert parse_setting("asp+int8").compression == "int8" and parse_setting("asp").compression is None
    assert label("bsp+local:50+int8") == "BSP local H=50 int8"
    for bad in ("asp+int8+int4", "asp+int8+int8", "asp+int2"):
        with pytest.raises(ConfigurationError, match="bad sync setting"):
            parse_setting(bad)
    assert _compression(Run("asp+int4", "none", "c", [1.0])) == "int4"
    assert _compression(Run("asp", "none", "c", [1.0], compression="bf16")) == "bf16"
    with pytest.raises(ConfigurationError, match="takes no --compression"):
        _compression(Run("asp+int4", "none", "c", [1.0], compression="bf16"))


@pytest.mark.parametrize("inner", [None, (0.1, 0.0)])
@pytest.mark.parametrize("compression", ["int8", "int4"])
def test_a_virtual_worker_pushes_what_the_server_decodes_and_keeps_the_rest_for_the_next(inner, compression):
    """Error feedback as aps.Worker does it: each push is the quantized (gradient + residual),
    decoded as the server's kernels decode it; the residual is what that left out; the bytes
    are the payloads'."""
    from aps.lab.virtual import VirtualTrainer
    from aps.wire.protocol import DType
    from aps.wire.quantized import Quantized, dequantize, quantize, quantized_nbytes
    from aps.workloads.data import load

    dtype = int(DType.INT8Q if compression == "int8" else DType.INT4Q)
    data = load("digits", seed=0)
    quantized = VirtualTrainer(data, 2, batch_size=16, init_seed=0, seed=3, inner=inner, compression=compression)
    plain = VirtualTrainer(data, 2, batch_size=16, init_seed=0, seed=3, inner=inner)
    weights = plain.initial.copy()
    residual = np.zeros_like(weights)
    for _ in range(3):
        sent, exact = np.empty_like(weights), np.empty_like(weights)
        quantized.compute(1, weights, sent)
        plain.compute(1, weights, exact)
        payload, decoded = quantize(exact + residual, dtype)
        np.testing.assert_array_equal(sent, decoded)
        np.testing.assert_array_equal(dequantize(Quantized(payload, len(weights), dtype)), decoded)
        residual = exact + residual - decoded
        assert residual.any()
        np.testing.assert_array_equal(quantized._residuals[1], residual)
        weights = weights - np.float32(0.1) * sent
    assert quantized.pushed_bytes == 3 * quantized_nbytes(len(weights), dtype)
    assert plain.pushed_bytes == 3 * 4 * len(weights)


def test_a_local_settings_iterations_per_second_are_its_inner_steps_not_its_syncs():
    from aps.lab.virtual import train_virtual

    # (--iterations counts them too: 60 inner steps are 12 syncs of 5)
    record = train_virtual(parse_setting("asp+local:5"), [1.0, 2.0], dataset="digits", iterations=60, seed=0)
    assert record["pushes"] == 12 and record["steps"] == 5 * 12
    assert record["iterations_per_s"] == pytest.approx(60 / record["simulated_s"])
    plain = train_virtual(parse_setting("asp"), [1.0, 2.0], dataset="digits", iterations=12, seed=0)
    assert plain["iterations_per_s"] == pytest.approx(12 / plain["simulated_s"])
