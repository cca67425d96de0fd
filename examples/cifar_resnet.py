#!/usr/bin/env python
"""Train a torchvision ResNet-18 on CIFAR-10 with aps (for users who have the data).

Nothing is downloaded: point ``--data-dir`` at a directory that holds
``cifar-10-batches-py`` (what ``torchvision.datasets.CIFAR10`` reads).
``--fake-data`` trains on torchvision's random ``FakeData`` of the same shape
instead, to check a set-up without the dataset.

The ResNet-18 takes the usual CIFAR stem (a 3x3 first convolution, no max
pooling). Its BatchNorm running statistics are buffers, not parameters: they
stay local to each worker and are not averaged; only the trainable weights go
through the server. On a GPU (``--device cuda``) the model stays on the device
and each step stages the gradients and weights through pinned host memory.

As people train it: weight decay on the convolution and linear weights only
(none on BatchNorm and biases: two param groups), and a learning rate that
warms up linearly over the first epoch and then follows a cosine to zero,
stepped every iteration by ``torch.optim.lr_scheduler``. The server's
``--lr`` and ``--weight-decay`` are only its defaults: each worker sends its
groups' values when they change, and the server applies its gradients with
them.

Under ``aps launch``::

    aps launch --workers 4 --sync dssp --staleness 3 --max-staleness 15 \\
        --optimizer sgd --lr 0.1 --momentum 0.9 \\
        examples/cifar_resnet.py --data-dir ~/data --epochs 30 --lr 0.1 --weight-decay 5e-4

Against any server, one process per rank::

    python examples/cifar_resnet.py --address tcp://HOST:7450 --rank 0 --workers 4 --data-dir ~/data
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torchvision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset
from torchvision import transforms

import aps.torch

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def resnet18_cifar(classes: int = 10) -> nn.Module:
    model = torchvision.models.resnet18(num_classes=classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the weights of convolutions and linear layers; none on BatchNorm and biases."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def schedule(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``warmup`` steps, then a cosine to zero at step ``total``."""
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=max(1, warmup))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup))
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cosine], milestones=[max(1, warmup)])


def datasets(args):
    augment = transforms.Compose([
        transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(MEAN, STD),
    ])
    plain = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    if args.fake_data:
        train = torchvision.datasets.FakeData(args.fake_data, (3, 32, 32), 10, transform=augment)
        test = torchvision.datasets.FakeData(max(1, args.fake_data // 5), (3, 32, 32), 10, transform=plain,
                                             random_offset=args.fake_data)
        return train, test
    if not args.data_dir:
        raise SystemExit("give --data-dir (a directory with cifar-10-batches-py) or --fake-data N")
    try:
        train = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=augment, download=False)
        test = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=plain, download=False)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        raise SystemExit(f"{exc}: expected {args.data_dir}/cifar-10-batches-py (no download is attempted)") from None
    return train, test


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        correct += (model(images.to(device)).argmax(1).cpu() == labels).sum().item()
        total += len(labels)
    model.train()
    return correct / max(1, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="the server, tcp://HOST:PORT (default $APS_ADDRESS)")
    parser.add_argument("--rank", type=int, help="this worker's rank (default $RANK)")
    parser.add_argument("--workers", type=int, help="number of workers (default $WORLD_SIZE)")
    parser.add_argument("--data-dir", help="directory holding cifar-10-batches-py")
    parser.add_argument("--fake-data", type=int, default=0, metavar="N", help="train on N random images instead")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1, help="peak learning rate (after the warm-up)")
    parser.add_argument("--weight-decay", type=float, default=5e-4, help="on weights; none on BatchNorm and biases")
    parser.add_argument("--loader-workers", type=int, default=2)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by aps launch and torchrun: one GPU per worker
    gpus = torch.cuda.device_count()
    parser.add_argument("--device", default=f"cuda:{local_rank % gpus}" if gpus else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device(args.device)
    train_set, test_set = datasets(args)
    torch.manual_seed(args.seed)  # every worker builds the same model; rank 0's weights win anyway
    model = resnet18_cifar().to(device)
    optimizer = aps.torch.Optimizer(param_groups(model, args.weight_decay), args.address, args.rank, args.workers,
                                    model=model, lr=args.lr)
    rank, workers = optimizer.worker.rank, optimizer.worker.num_workers
    shard = Subset(train_set, range(rank, len(train_set), workers))
    loader = DataLoader(shard, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.loader_workers, generator=torch.Generator().manual_seed(args.seed + rank))
    total = len(loader) * args.epochs if not args.steps else min(args.steps, len(loader) * args.epochs)
    scheduler = schedule(optimizer, warmup=min(len(loader), total // 5), total=total)
    test_loader = DataLoader(test_set, batch_size=256, num_workers=args.loader_workers)
    start, steps = time.monotonic(), 0
    with optimizer:
        for epoch in range(1, args.epochs + 1):
            for images, labels in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(images.to(device)), labels.to(device))
                loss.backward()
                optimizer.step()
                scheduler.step()
                steps += 1
                if steps % 50 == 0:
                    print(f"rank {rank} step {steps}: loss {loss.item():.3f}, lr {scheduler.get_last_lr()[0]:.4g}",
                          flush=True)
                if steps == args.steps:
                    break
            accuracy = evaluate(model, test_loader, device)
            print(f"rank {rank} epoch {epoch}: {steps} steps, test accuracy {accuracy:.3f}, "
                  f"weights version {optimizer.version}, {time.monotonic() - start:.1f} s", flush=True)
            if steps == args.steps:
                break


if __name__ == "__main__":
    main()
