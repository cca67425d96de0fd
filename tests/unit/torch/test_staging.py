"""The model's tensors over a worker's flat buffers, without a server (a stand-in worker
holding the buffers a real one holds after init): views where the dtype and device allow,
staged copies where not, and the gradients put back where the push reads them."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import pytest
import torch

from aps.errors import ConfigurationError, NotInitialized
from aps.layout import Layout
from aps.torch.staging import FlatModel


class Buffers:
    """What a worker holds once initialized: the layout, the flat buffers, the gradient views;
    with ``compression`` and ``half`` its 16-bit buffers too (aps.Worker.half_buffers)."""

    def __init__(self, params: list[torch.Tensor], compression: str | None = None, half: bool = False) -> None:
        self.layout = Layout.from_arrays({f"p{i}": np.zeros(tuple(p.shape), np.float32) for i, p in enumerate(params)})
        self.flat_weights = np.arange(self.layout.numel, dtype=np.float32)
        self.flat_grad = np.zeros(self.layout.numel, np.float32)
        self.grads: Mapping[str, np.ndarray] = MappingProxyType(self.layout.views(self.flat_grad))
        self.compression = compression
        self._half = (np.zeros(self.layout.numel, np.uint16), np.zeros(self.layout.numel, np.uint16)) if half else None

    def half_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        if self._half is None:
            raise ConfigurationError("half_buffers needs compress_pulls")
        return self._half


def parameters(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, 3, dtype=dtype)), torch.nn.Parameter(torch.zeros(4, dtype=dtype))]


def test_float32_parameters_on_the_cpu_are_views_of_the_workers_buffers():
    params = parameters()
    worker = Buffers(params)
    flat = FlatModel(worker, params, torch.device("cpu"), staging=False)
    assert len(flat.viewed) == 2 and flat.staged == [] and flat.push_buffer is worker.grads
    assert params[1].tolist() == [6.0, 7.0, 8.0, 9.0]  # the worker's weights, with no copy
    worker.flat_weights[:] = -1.0  # a pull lands in the model
    assert params[0].min().item() == params[0].max().item() == -1.0
    params[0].sum().backward()  # backward writes where the push reads
    assert worker.flat_grad[:6].tolist() == [1.0] * 6 and params[0].grad.data_ptr() == worker.flat_grad.ctypes.data
    assert flat.weights() is worker.flat_weights
    flat.zero_grad()
    assert not worker.flat_grad.any()


def test_staged_parameters_are_copied_both_ways():
    params = parameters()
    worker = Buffers(params)
    flat = FlatModel(worker, params, torch.device("cpu"), staging=True)
    assert flat.viewed == [] and len(flat.staged) == 2
    assert params[0].data_ptr() != worker.flat_weights.ctypes.data and params[1].tolist() == [6.0, 7.0, 8.0, 9.0]
    params[1].grad = torch.full((4,), 2.0)
    flat.gather_grads()  # (a parameter without a gradient pushes zeros)
    assert worker.flat_grad.tolist() == [0.0] * 6 + [2.0] * 4
    worker.flat_weights[:] = 5.0
    flat.load_weights()
    assert params[0].tolist() == [[5.0] * 3] * 2
    params[1].data.fill_(3.0)
    weights = flat.weights()
    assert weights is not worker.flat_weights and weights.tolist() == [5.0] * 6 + [3.0] * 4
    flat.zero_grad()
    assert params[1].grad.tolist() == [0.0] * 4


def test_a_16_bit_model_is_staged_unless_the_worker_holds_16_bit_buffers():
    params = parameters(torch.bfloat16)
    worker = Buffers(params)  # float32 buffers: the weights are rounded into the model at each pull
    flat = FlatModel(worker, params, torch.device("cpu"), staging=False)
    assert flat.viewed == [] and len(flat.staged) == 2
    worker.flat_weights[6] = 1.0 + 2**-10  # rounded to nearest even in bfloat16
    flat.load_weights()
    assert params[1][0].item() == 1.0 and params[1].dtype == torch.bfloat16
    params = parameters(torch.bfloat16)
    worker = Buffers(params, compression="bf16", half=True)
    flat = FlatModel(worker, params, torch.device("cpu"), staging=False)
    half_weights, half_grads = worker.half_buffers()
    assert len(flat.viewed) == 2 and flat.push_buffer is half_grads
    half_weights[6] = 0x3F80  # 1.0 in bfloat16: the 16-bit weights are the model's
    assert params[1][0].item() == 1.0
    params[1].sum().backward()
    assert half_grads[6:].tolist() == [0x3F80] * 4
    with pytest.raises(ConfigurationError):  # (without compressed pulls, the weights come back float32)
        Buffers(params, compression="bf16").half_buffers()


def test_gradients_that_went_around_the_buffers_are_put_back():
    params = parameters()
    worker = Buffers(params)
    flat = FlatModel(worker, params, torch.device("cpu"), staging=False)
    worker.flat_grad[:] = 9.0
    params[0].grad = None  # model.zero_grad(set_to_none=True)
    params[1].grad = torch.full((4,), 2.0)  # code that set a .grad of its own
    flat.adopt_stray_grads()
    assert worker.flat_grad.tolist() == [0.0] * 6 + [2.0] * 4
    assert all(p.grad is grads for p, (_, _, grads) in zip(params, flat.viewed))
    moved = params[0].data.clone()
    params[0].data = moved  # (what model.to("cpu:N") does to the storage): attached again
    flat.adopt_stray_grads()
    assert params[0].data_ptr() == worker.flat_weights.ctypes.data
    params[0].data = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ConfigurationError, match="moved to another dtype or device"):
        flat.adopt_stray_grads()


def test_gradscalers_scale_is_taken_out_of_every_gradient():
    params = parameters()
    worker = Buffers(params)
    flat = FlatModel(worker, params, torch.device("cpu"), staging=False)
    worker.flat_grad[:] = 8.0
    flat.unscale(torch.tensor(4.0))
    assert worker.flat_grad.tolist() == [2.0] * 10


def test_a_worker_without_a_model_has_no_buffers_to_bind():
    worker = Buffers(parameters())
    worker.layout = None
    with pytest.raises(NotInitialized):
        FlatModel(worker, parameters(), torch.device("cpu"), staging=False)
