"""A LightningModule as people write them (the digits MLP), and a worker process that trains
it with aps.lightning.Strategy (tests/integration/test_lightning.py): writes its test
accuracy and the sample indices it trained on, as JSON, to the path it is given."""

import json
import sys

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from aps import workloads


class Digits(L.LightningModule):
    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, momentum: float = 0.9) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.kind, self.lr, self.momentum = optimizer, lr, momentum
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen += index.tolist()
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self):
        if self.kind == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
        elif self.kind == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.RMSprop(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def loader(shuffle: bool = False, batch: int = 32, as_one_of: int | None = None) -> DataLoader:
    """The digits; ``as_one_of``: with the sampler Lightning gives each of that many DDP
    (or aps) workers' loaders, as rank 0 (shuffled, seed 0)."""
    data = workloads.load("digits", seed=0)
    dataset = TensorDataset(data.x_train, data.y_train, torch.arange(len(data.y_train)))
    if as_one_of is not None:
        sampler = DistributedSampler(dataset, num_replicas=as_one_of, rank=0, shuffle=True, seed=0)
        return DataLoader(dataset, batch_size=batch, sampler=sampler)
    return DataLoader(dataset, batch_size=batch, shuffle=shuffle)


def accuracy(module: Digits) -> float:
    data = workloads.load("digits", seed=0)
    with torch.no_grad():
        return float((module.net(data.x_test).argmax(1) == data.y_test).float().mean())


def trainer(strategy=None, epochs: int = 2, **options) -> L.Trainer:
    if strategy is not None:
        options["strategy"] = strategy
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, deterministic=True, **{"enable_checkpointing": False, **options})


if __name__ == "__main__":
    import aps.lightning

    if len(sys.argv) == 2:  # launched as the docs say: APS_ADDRESS, RANK and WORLD_SIZE from the launcher
        strategy, epochs = aps.lightning.Strategy(), 1
        out = f"{sys.argv[1]}/{strategy.global_rank}.json"
    else:
        address, rank, workers, out = sys.argv[1:5]
        strategy, epochs = aps.lightning.Strategy(address, rank=int(rank), num_workers=int(workers)), 4
    module = Digits()
    trainer(strategy, epochs=epochs).fit(module, loader(shuffle=True))
    with open(out, "w") as file:
        json.dump({"accuracy": accuracy(module), "seen": module.seen, "rank": strategy.global_rank,
                   "workers": strategy.world_size}, file)
