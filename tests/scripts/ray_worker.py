"""The training loop Ray Train runs in each worker (tests/integration/test_ray.py): the digits MLP
on an aps server through aps.ray, each worker its part of the data, a checkpoint each epoch."""

import os
import tempfile

import ray.train
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import aps.ray
from aps import workloads


def train_loop(config: dict) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    context = ray.train.get_context()
    data = workloads.load("digits", seed=0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    if config.get("plain"):  # the same loop with torch's own optimizer, for comparison
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        saved = None
    else:
        optimizer = aps.ray.optimizer(model, config["server"], transport="tcp")
        saved = aps.ray.restore(model, optimizer, config.get("resume"))  # (None: Ray's own, when it restarts a run)
    joined_at = 0 if config.get("plain") else optimizer.version  # (the server's version this start went on from)
    start = saved["epoch"] + 1 if saved else 0
    dataset = TensorDataset(data.x_train, data.y_train)
    sampler = DistributedSampler(dataset, num_replicas=context.get_world_size(), rank=context.get_world_rank(),
                                 shuffle=False)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(start, config["epochs"]):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            accuracy = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
        weights = {name: p.detach().clone().tolist() for name, p in model.named_parameters()} \
            if config.get("return_weights") else None
        metrics = {"epoch": epoch, "started_at": start, "joined_at": joined_at, "loss": loss.item(),
                   "accuracy": accuracy, "weights": weights}
        if config.get("plain"):  # (Ray keeps the metrics reported with a checkpoint)
            folder = tempfile.mkdtemp(prefix="plain-")
            torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
            continue
        aps.ray.report(optimizer, metrics, checkpoint=aps.ray.checkpoint(model, optimizer, epoch=epoch))
        fail = config.get("fail")  # {"epoch": E, "rank": R, "marker": PATH}: that worker fails once, after epoch E
        if fail and (fail["epoch"], fail["rank"]) == (epoch, context.get_world_rank()) \
                and not os.path.exists(fail["marker"]):
            open(fail["marker"], "w").close()
            raise RuntimeError(f"injected failure of rank {fail['rank']} after epoch {epoch}")
    if not config.get("plain"):
        optimizer.close()
