"""aps.torch.ElasticSampler and the counters under it (CLAIM): within an epoch every sample is
seen exactly once, however the workers come and go."""

import collections
import itertools

import numpy as np
import pytest

import aps
from aps.cli.checkpoint import request_checkpoint
from aps.errors import MalformedFrame
from aps.torch.sampler import ElasticSampler

MODEL = {"w": np.zeros(4, np.float32)}


def worker(address, transport="tcp"):
    w = aps.Worker(address, transport=transport)
    w.init(MODEL)
    return w


def test_a_claim_hands_each_value_out_once_and_counters_are_the_runs(server_process, transport):
    server = server_process("--workers", "1:3", "--sync", "asp")
    a, b = worker(server.address, transport), worker(server.address, transport)
    try:
        got = [a.claim("jobs"), b.claim("jobs"), a.claim("jobs", 5), b.claim("jobs")]
        assert got == [0, 1, 2, 7]
        assert b.claim("jobs", 0) == 8 and a.claim("other") == 0
        with pytest.raises(aps.ConfigurationError, match="name"):
            a.claim("x" * 257)
        with pytest.raises(aps.ConfigurationError, match="2\\*\\*53"):
            a.claim("jobs", -1)
        a.claim("big", 1 << 53)
        with pytest.raises(MalformedFrame, match="2\\*\\*53"):
            a.claim("big")
        assert a.claim("jobs", 0) == 8  # a refused claim changed nothing, and the connection goes on
    finally:
        a.close()
        b.close()


def test_counters_are_kept_in_checkpoints(server_process, tmp_path):
    server = server_process("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path))
    with worker(server.address) as w:
        w.claim("data/0", 3)
        request_checkpoint(server.address)
    server.stop()
    resumed = server_process("--workers", "1", "--sync", "asp", "--checkpoint-dir", str(tmp_path), "--resume")
    with aps.Worker(resumed.address, 0, 1) as w:
        w.init(MODEL)
        assert w.claim("data/0") == 3


def test_every_sample_is_seen_once_per_epoch_across_joins_and_leaves(server_process):
    server = server_process("--workers", "1:4", "--sync", "asp")
    size, chunk = 1000, 32
    seen: dict[int, collections.Counter] = {}
    for epoch in range(2):
        counts = seen[epoch] = collections.Counter()
        live = {}  # name -> (worker, iterator, sampler)

        def join(name):
            w = worker(server.address)
            sampler = ElasticSampler(size, w, chunk=chunk, seed=7)
            sampler.set_epoch(epoch)
            live[name] = (w, iter(sampler), sampler)

        def take(name, count):
            """The next ``count`` samples of worker ``name`` (fewer at the epoch's end)."""
            for sample in itertools.islice(live[name][1], count):
                counts[sample] += 1

        join("a")
        join("b")
        for step in itertools.count():
            if step == 3:
                join("c")  # joins mid-epoch
            if step == 5:  # b leaves at the end of a chunk
                w, it, sampler = live["b"]
                while not sampler.chunk_done:
                    counts[next(it)] += 1
                w.leave()
                del live["b"]
            if step == 8:
                join("d")
            before = sum(counts.values())
            for name in list(live):
                take(name, chunk // 2 + 5 * (ord(name) - ord("a")))  # uneven speeds
            if sum(counts.values()) == before:
                break
        for w, _, _ in live.values():
            w.close()
        assert sorted(counts) == list(range(size)) and set(counts.values()) == {1}, "a sample skipped or repeated"
    orders = [ElasticSampler(size, None, seed=7).order(e) for e in range(2)]
    assert not np.array_equal(*orders)  # a new order each epoch


def test_a_sampler_refuses_bad_arguments():
    for bad in ({"size": -1}, {"chunk": 0}, {"name": "a/b"}, {"name": ""}):
        options = {"size": 10, **bad}
        with pytest.raises(aps.ConfigurationError):
            ElasticSampler(options.pop("size"), None, **options)
    with pytest.raises(aps.ConfigurationError):
        ElasticSampler(10, None).set_epoch(-1)


def test_a_dataloader_takes_it_as_its_sampler(server_process):
    torch = pytest.importorskip("torch")
    server = server_process("--workers", "1:2", "--sync", "asp")
    dataset = torch.utils.data.TensorDataset(torch.arange(100))
    with worker(server.address) as a, worker(server.address) as b:
        loaders = [torch.utils.data.DataLoader(dataset, batch_size=10, sampler=ElasticSampler(100, w, chunk=20))
                   for w in (a, b)]
        seen = [int(x) for pair in itertools.zip_longest(*loaders) for batch in pair if batch is not None
                for x in batch[0]]
    assert sorted(seen) == list(range(100))
