"""PyTorch integration: an aps-backed drop-in for the optimizer of a standard loop.

::

    model = Net()
    opt = aps.torch.Optimizer(model, "tcp://ps-host:7450", rank=0, num_workers=4)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()  # push the gradients, wait for the gate, load the new weights

The server applies the update (its ``--optimizer``) with the values of this
worker's param groups, which any ``torch.optim.lr_scheduler`` may change:
this object is a ``torch.optim.Optimizer`` that moves gradients, weights and,
when they change, the groups' values. On the CPU, the model's parameters and their
``.grad`` become views into the worker's flat buffers (the gradient buffer is
shared memory when the server shares the host), so ``backward()`` writes the
gradients where the push reads them and a pull writes the new weights straight
into the model: ``step()`` copies nothing it does not have to. A model on a
GPU keeps its tensors there; ``step()`` then stages through the worker's host
buffers (pinned memory): one device-to-host copy of the gradients and one
host-to-device copy of the weights per step.

Only trainable parameters go through the server, laid out group by group;
they may be float32, bfloat16 or float16 (16-bit ones train on float32 master
weights kept by the server).
Buffers (BatchNorm running statistics and the like) stay local to each worker.
Embedding tables too large for a worker live on the server: :class:`Embedding` and
:class:`EmbeddingBag` (aps/torch/embedding.py) take the place of torch's sparse
embeddings, and ``step()`` pushes their rows' gradient with the dense one.

Address, rank and worker count default to ``APS_ADDRESS``, ``RANK`` and
``WORLD_SIZE`` (what ``torchrun`` and ``aps launch`` set). Under ``aps
launch --step-time T --slowdown ...``, ``step()`` also pads each iteration to
this worker's multiple of ``T`` to emulate GPUs of different speeds: the
padding is sleep, not work.

:class:`LocalSGD` is the other way to train: the user's own optimizer steps
locally, and every H steps the server's optimizer (the outer one) takes the
workers' pseudo-gradients (DiLoCo under BSP, asynchronous local SGD otherwise).
"""

from __future__ import annotations

from .checkpoint import load_state_dict
from .embedding import Embedding, EmbeddingBag
from .local_sgd import LocalSGD
from .optimizer import Optimizer
from .pacing import Pacer
from .sampler import ElasticSampler

__all__ = ["ElasticSampler", "Embedding", "EmbeddingBag", "LocalSGD", "Optimizer", "Pacer", "load_state_dict"]
