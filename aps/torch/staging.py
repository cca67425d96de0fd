"""Where the model's tensors meet the worker's flat buffers.

On the CPU, a float32 parameter and its ``.grad`` become views into the worker's flat
weight and gradient buffers: ``backward()`` writes where a push reads, a pull writes
straight into the model. A model all of one 16-bit type over TCP with compressed pulls
becomes views into the worker's 16-bit buffers. Any other parameter (on a GPU, or of a
dtype its buffer does not hold) is staged: its gradient copied into the host buffer
before a push, the weights copied back after the pull, through pinned memory on a GPU.
:class:`FlatModel` is that binding, held by :class:`aps.torch.Optimizer`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..client.worker import Worker
from ..errors import ConfigurationError, NotInitialized

__all__ = ["HALF", "FlatModel"]

#: The 16-bit parameter dtypes and the ``compression`` that sends them as they are.
HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}

log = logging.getLogger("aps.torch")


def _pin(*tensors: torch.Tensor) -> list[int]:
    """Page-lock host buffers so copies to and from the GPU run at full speed
    (best effort). Returns the addresses pinned, for :func:`_unpin`."""
    cudart = torch.cuda.cudart()
    pinned = []
    for tensor in tensors:
        status = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
        if int(status) == 0:
            pinned.append(tensor.data_ptr())
        else:
            log.warning(
                "could not pin a %d-byte host buffer (CUDA error %s): copies will be slower",
                tensor.numel() * tensor.element_size(),
                int(status),
            )
    return pinned


def _unpin(addresses: list[int]) -> None:
    cudart = torch.cuda.cudart()
    for address in addresses:
        cudart.cudaHostUnregister(address)


class FlatModel:
    """The trainable parameters ``params`` (in the layout's order, on ``device``) over the
    flat buffers of ``worker`` (initialized): views where they can be, staged copies where
    not (``staging``: every parameter is, as on a GPU).

    Raises:
        NotInitialized: the worker has no model yet.
    """

    def __init__(
        self, worker: Worker, params: Sequence[torch.nn.Parameter], device: torch.device, staging: bool
    ) -> None:
        layout = worker.layout
        if layout is None:
            raise NotInitialized("the worker has no model yet: call init(params) first")
        self.worker, self.params, self.device, self.staging = worker, list(params), device, staging
        self.layout = layout
        self._pinned: list[int] = []
        #: (parameter, weights, gradient) of the parameters that are views into the buffers.
        self.viewed: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        #: (parameter, weights, gradient) of those staged: copied each step.
        self.staged: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        #: What a push sends: the worker's gradient views, or its 16-bit gradient buffer.
        self.push_buffer: Mapping[str, np.ndarray] | np.ndarray = worker.grads
        self._host_grads = torch.empty(0)
        try:
            self.attach()
        except BaseException:
            self.close()
            raise

    def _flat_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        weights, grads = self.worker.flat_weights, self.worker.flat_grad
        if weights is None or grads is None:
            raise NotInitialized("the worker has no model yet: call init(params) first")
        return weights, grads

    def attach(self) -> None:
        """Make the model's parameters and gradients views into the worker's buffers, or set
        up their staging copies; the model then holds the worker's weights."""
        flat_weights, flat_grad = self._flat_buffers()
        host_weights = torch.from_numpy(flat_weights)
        self._host_grads = torch.from_numpy(flat_grad)
        if self.device.type == "cuda":
            self._pinned = _pin(host_weights, self._host_grads)
        weight_views = self.views(host_weights)
        grad_views = self.views(self._host_grads)
        # Float32 parameters on the CPU become views into the worker's buffers. A model all
        # of one 16-bit type, over TCP, becomes views into the worker's 16-bit buffers: the
        # gradients go as they are and the weights arrive rounded by the server (the float32
        # master weights stay there). Any other parameter (on a GPU, or 16-bit in another
        # setting) is copied each step.
        self.push_buffer = self.worker.grads
        half_dtype = self.params[0].dtype
        half: tuple[np.ndarray, np.ndarray] | None = None
        if (
            not self.staging
            and half_dtype in HALF
            and all(p.dtype == half_dtype for p in self.params)
            and self.worker.compression == HALF[half_dtype]
        ):
            try:
                half = self.worker.half_buffers()
            except ConfigurationError:  # the weights come back float32 (compress_pulls=False): copy them
                half = None
        if half is not None:
            half_weights, half_grads = half
            weight_views = self.views(torch.from_numpy(half_weights.view(np.int16)).view(half_dtype))
            self._host_grads = torch.from_numpy(half_grads.view(np.int16)).view(half_dtype)
            grad_views = self.views(self._host_grads)
            self.push_buffer = half_grads
        views = list(zip(self.params, weight_views, grad_views))
        self.viewed = [] if self.staging else [v for v in views if v[0].dtype == v[1].dtype]
        self.staged = [v for v in views if self.staging or v[0].dtype != v[1].dtype]
        for param, weights, grads in self.viewed:
            param.data = weights  # the model's storage is the worker's weight buffer
            param.grad = grads  # backward() accumulates into the (shared) gradient buffer
        self.load_weights()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of the flat ``flat``, in its shape."""
        layout = self.layout
        return [flat[o : o + s].view(p.shape) for p, o, s in zip(self.params, layout.offsets, layout.sizes)]

    def weights(self) -> np.ndarray:
        """The model's trainable parameters now, as one flat float32 vector in the layout's
        order: the worker's weight buffer itself when every parameter is a float32 view of it."""
        if not self.staged and self.push_buffer is self.worker.grads:
            return self._flat_buffers()[0]
        flat = np.empty(self.layout.numel, np.float32)
        for view, param in zip(self.views(torch.from_numpy(flat)), self.params):
            view.copy_(param.detach())  # widened exactly, from any device
        return flat

    def zero_grad(self) -> None:
        """Zero the gradients in place (the views' buffer at once, the staged ones each)."""
        if self.viewed:
            self._host_grads.zero_()
        for param, _, _ in self.staged:
            if param.grad is not None:
                param.grad.zero_()

    def unscale(self, grad_scale: torch.Tensor) -> None:
        """Divide the gradients by GradScaler's scale, in their own dtype, as its ``unscale_`` does."""
        inv_scale = grad_scale.double().reciprocal().float()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in self.params:
            if param.grad is not None:
                by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for grads in by_dtype.values():
            torch._foreach_mul_(grads, inv_scale.to(grads[0].device))

    def adopt_stray_grads(self) -> None:
        """Put back into the buffers what went around them since the last step."""
        # model.zero_grad() (set_to_none, the torch default) or other code may have replaced
        # a .grad: copy it back into the buffer and re-attach. model.to("cpu:N") (accelerate)
        # replaces the storage of the parameters and of their .grad, the views: attach again,
        # or no step would reach the model.
        if any(param.data_ptr() != weights.data_ptr() for param, weights, _ in self.viewed):
            moved = [(param, param.grad) for param, _, _ in self.viewed]
            if any(p.dtype != w.dtype or p.device != w.device for p, w, _ in self.viewed):
                raise ConfigurationError(
                    "the model was moved to another dtype or device after the optimizer was "
                    "made: make the optimizer after moving the model"
                )
            self.attach()
            for (_, grad), (_, _, grads) in zip(moved, self.viewed):
                grads.copy_(grad) if grad is not None else grads.zero_()
        for param, _, grads in self.viewed:
            grad = param.grad
            if grad is grads:
                continue
            if grad is None:
                grads.zero_()
            elif grad.data_ptr() != grads.data_ptr():
                grads.copy_(grad)
            param.grad = grads

    def gather_grads(self) -> None:
        """The staged parameters' gradients into the host buffer the push reads."""
        if not self.staged:
            return
        for param, _, grads in self.staged:
            if param.grad is None:
                grads.zero_()
            else:
                grads.copy_(param.grad, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":  # the push reads the host buffer next
            torch.cuda.synchronize(self.device)

    def load_weights(self) -> None:
        """The pulled weights into the staged parameters."""
        if not self.staged:
            return
        for param, weights, _ in self.staged:
            param.data.copy_(weights, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":  # the next pull overwrites the host buffer
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Let go of the pinned host memory."""
        if self._pinned:
            _unpin(self._pinned)
            self._pinned = []
