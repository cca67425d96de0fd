"""The language-model workload: the stdlib corpus split by file, training windows, and the
byte-level transformer (causal, tied, seeded)."""

import math
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aps.workloads.text import ByteLM, held_out_loss, lm_batch, stdlib_corpus  # noqa: E402


def _tree(root: pathlib.Path, files: dict[str, bytes]) -> pathlib.Path:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_the_corpus_splits_by_whole_file_and_leaves_out_tests_and_installed_packages(tmp_path):
    files = {f"pkg{i // 10}/mod{i}.py": f"# file {i}\n".encode() * 3 for i in range(200)}
    files |= {"test/test_x.py": b"SKIPPED", "site-packages/y.py": b"SKIPPED", "notes.txt": b"SKIPPED"}
    corpus = stdlib_corpus(root=str(_tree(tmp_path, files)))
    assert corpus.train_files + corpus.held_out_files == 200
    assert 5 <= corpus.held_out_files <= 40  # (a tenth, by a hash of each path)
    train, held_out = corpus.train.tobytes(), corpus.held_out.tobytes()
    assert b"SKIPPED" not in train + held_out
    for i in range(200):  # every file whole on one side only
        text = f"# file {i}\n".encode() * 3
        assert (text in train) != (text in held_out), i
    again = stdlib_corpus(root=str(tmp_path))
    np.testing.assert_array_equal(again.held_out, corpus.held_out)  # (stable: no randomness)
    with pytest.raises(ValueError, match="no Python sources"):
        stdlib_corpus(root=str(_tree(tmp_path / "empty", {"a.txt": b"x"})))


def test_this_pythons_stdlib_is_a_corpus_of_megabytes():
    corpus = stdlib_corpus()
    assert len(corpus.train) > 2_000_000 and len(corpus.held_out) > 100_000
    assert b"def " in corpus.held_out.tobytes()


def test_a_batch_is_windows_and_the_bytes_after_them():
    data = np.arange(200, dtype=np.uint8)
    tokens, targets = lm_batch(data, 8, 16, np.random.default_rng(0))
    assert tokens.shape == targets.shape == (8, 16) and tokens.dtype == torch.int64
    assert torch.equal(targets[:, :-1], tokens[:, 1:]) and torch.equal(targets[:, -1], tokens[:, -1] + 1)


def test_the_model_is_causal_seeded_and_starts_near_uniform():
    model = ByteLM(width=32, layers=2, heads=4, context=16, seed=3)
    assert torch.equal(model.embed.weight, ByteLM(width=32, layers=2, heads=4, context=16, seed=3).embed.weight)
    assert not torch.equal(model.embed.weight, ByteLM(width=32, layers=2, heads=4, context=16, seed=4).embed.weight)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10])  # the first 10 positions see no later byte
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    targets = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = held_out_loss(model, (tokens, targets), batch=1)
    assert abs(loss - math.log(256)) < 0.2
    with pytest.raises(ValueError, match="multiple of heads"):
        ByteLM(width=30, heads=4)


def test_a_few_steps_of_adamw_lower_the_held_out_loss():
    corpus = stdlib_corpus()
    model = ByteLM(width=32, layers=1, heads=2, context=32, seed=0)
    rng = np.random.default_rng(0)
    windows = lm_batch(corpus.held_out, 32, 32, np.random.default_rng(1))
    before = held_out_loss(model, windows)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        model.loss(*lm_batch(corpus.train, 8, 32, rng)).backward()
        opt.step()
    assert held_out_loss(model, windows) < before - 0.5
