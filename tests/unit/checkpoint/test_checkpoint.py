"""The on-disk checkpoint format: real files in a temporary directory."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy

import aps
from aps import checkpoint as ckpt
from aps.cli import main
from aps.errors import CheckpointError

# Not in alphabetical order: the layout's order must survive the file's sorted header.
WEIGHTS = {
    "fc2.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
    "fc1.bias": np.array([0.5, -1.5], dtype=np.float32),
    "scale": np.array(2.5, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.float32),
}
STATE = {
    "exp_avg/fc2.weight": np.full((2, 3), 0.25, dtype=np.float32),
    "step": np.array([7], dtype=np.int64),
    "aggregate": np.linspace(0, 1, 5),
}


def layout_of(weights):
    return {"names": list(weights), "shapes": [list(np.shape(a)) for a in weights.values()]}


def write(directory, sequence, version, *, weights=WEIGHTS, state=STATE, **fields):
    manifest = {"version": version, "sequence": sequence, "run_id": "run-1", "layout": layout_of(weights), **fields}
    return ckpt.write_checkpoint(directory, ckpt.checkpoint_name(sequence, version), manifest, weights, state)


def server_fields(**options):
    """The fields aps serve writes into a manifest (what a resume takes up), from a real engine."""
    from ...harness import Harness

    harness = Harness(**{"workers": 2, "sync": "ssp", "staleness": 2, **options})
    harness.join_all()
    harness.push(0, np.ones(harness.numel, np.float32), then_pull=True)
    fields, _ = harness.engine.durability.checkpoint_state()
    return {k: v for k, v in json.loads(json.dumps(fields)).items() if k not in ("version", "run_id", "layout")}


def write_resumable(directory, sequence, version, **fields):
    return write(directory, sequence, version, **{**server_fields(), **fields})


def set_manifest(path, data):
    """Replace a checkpoint's manifest and its checksum: a manifest written this way by a writer."""
    data = data.encode() if isinstance(data, str) else data
    (path / ckpt.MANIFEST_FILE).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    (path / ckpt.MANIFEST_SUM_FILE).write_text(f"{digest}  manifest.json\n")


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite_model(checkpoint_path, tensors):
    """Replace model.safetensors and fix the manifest's size and checksum, so only the tensors are wrong."""
    model = checkpoint_path / ckpt.MODEL_FILE
    safetensors.numpy.save_file(tensors, model)
    manifest = json.loads((checkpoint_path / ckpt.MANIFEST_FILE).read_text())
    data = model.read_bytes()
    manifest["files"][ckpt.MODEL_FILE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    set_manifest(checkpoint_path, json.dumps(manifest))


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# Round trip --------------------------------------------------------------------------------------


def test_round_trip_keeps_names_order_shapes_state_and_manifest(tmp_path):
    path = write(tmp_path, 3, 30, reason="periodic", sync={"name": "ssp", "staleness": 3})
    assert path == tmp_path / "checkpoint-00000003-v30"
    assert sorted(os.listdir(path)) == ["manifest.json", "manifest.sha256", "model.safetensors", "state.safetensors"]

    read = ckpt.read_checkpoint(path)
    assert list(read.weights) == list(WEIGHTS)
    for name, array in WEIGHTS.items():
        assert read.weights[name].dtype == np.float32 and read.weights[name].shape == array.shape
        np.testing.assert_array_equal(read.weights[name], array)
    assert set(read.state) == set(STATE)
    for name, array in STATE.items():
        assert read.state[name].dtype == array.dtype
        np.testing.assert_array_equal(read.state[name], array)

    assert read.version == 30 and read.sequence == 3
    assert read.layout == aps.Layout.from_arrays(WEIGHTS)
    np.testing.assert_array_equal(read.flat_weights(), np.concatenate([a.reshape(-1) for a in WEIGHTS.values()]))
    m = read.manifest
    assert m["format"] == "aps-checkpoint" and m["format_version"] == ckpt.FORMAT_VERSION == 2
    assert m["reason"] == "periodic" and m["sync"] == {"name": "ssp", "staleness": 3} and m["run_id"] == "run-1"
    caller_keys = [k for k in m if k not in ("format", "format_version", "files")]
    assert caller_keys == ["version", "sequence", "run_id", "layout", "reason", "sync"]  # the caller's order
    assert m == json.loads((path / "manifest.json").read_text())
    for name in (ckpt.MODEL_FILE, ckpt.STATE_FILE):
        data = (path / name).read_bytes()
        assert m["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # the manifest's own checksum, as sha256sum prints it (and checks it)
    digest = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
    assert (path / "manifest.sha256").read_text() == f"{digest}  manifest.json\n"
    if shutil.which("sha256sum"):
        assert subprocess.run(["sha256sum", "--quiet", "-c", "manifest.sha256"], cwd=path).returncode == 0


def test_empty_state_and_a_manifest_without_layout(tmp_path):
    weights = {"b": np.ones(2, np.float32), "a": np.full((2, 2), 3.0)}  # float64 is converted
    path = ckpt.write_checkpoint(tmp_path, "checkpoint-00000001-v0", {"version": np.int64(0)}, weights, {})
    read = ckpt.load_checkpoint(path)
    assert read.state == {}
    assert list(read.weights) == ["b", "a"] and read.weights["a"].dtype == np.float32
    assert read.manifest["layout"] == {"names": ["b", "a"], "shapes": [[2], [2, 2]]}
    assert read.version == 0 and type(read.manifest["version"]) is int


def test_model_file_is_a_plain_safetensors_state_dict(tmp_path):
    path = write(tmp_path, 1, 5)
    loaded = safetensors.numpy.load_file(path / ckpt.MODEL_FILE)
    assert set(loaded) == set(WEIGHTS)
    np.testing.assert_array_equal(loaded["fc2.weight"], WEIGHTS["fc2.weight"])
    torch_files = pytest.importorskip("safetensors.torch")
    state_dict = torch_files.load_file(str(path / ckpt.MODEL_FILE))
    assert tuple(state_dict["fc2.weight"].shape) == (2, 3) and str(state_dict["scale"].dtype) == "torch.float32"


def test_weights_must_match_the_manifests_layout(tmp_path):
    manifest = {"version": 1, "layout": {"names": ["fc1.bias"], "shapes": [[3]]}}
    with pytest.raises(CheckpointError, match="do not match the manifest's layout"):
        ckpt.write_checkpoint(tmp_path, "checkpoint-00000001-v1", manifest, {"fc1.bias": np.zeros(2)}, {})
    assert os.listdir(tmp_path) == []
    # The same names in another order are fine: the layout's order wins.
    manifest = {"version": 1, "layout": {"names": ["b", "a"], "shapes": [[1], [2]]}}
    path = ckpt.write_checkpoint(tmp_path, "x", manifest, {"a": np.zeros(2), "b": np.ones(1)}, {})
    assert list(ckpt.read_checkpoint(path).weights) == ["b", "a"]


def test_an_existing_checkpoint_is_never_overwritten(tmp_path):
    write(tmp_path, 1, 10)
    before = (tmp_path / "checkpoint-00000001-v10" / ckpt.MANIFEST_FILE).read_bytes()
    with pytest.raises(CheckpointError, match="already exists"):
        write(tmp_path, 1, 10, reason="again")
    assert (tmp_path / "checkpoint-00000001-v10" / ckpt.MANIFEST_FILE).read_bytes() == before
    assert ckpt.list_temporaries(tmp_path) == []


# A directory of checkpoints ------------------------------------------------------------------------


def test_list_next_sequence_and_prune(tmp_path):
    assert ckpt.list_checkpoints(tmp_path / "missing") == [] and ckpt.next_sequence(tmp_path / "missing") == 1
    assert ckpt.next_sequence(tmp_path) == 1
    for sequence, version in ((1, 10), (2, 20), (10, 5), (100_000_000, 7)):
        write(tmp_path, sequence, version)
    (tmp_path / "checkpoint-200000000-v1").mkdir()  # incomplete: no manifest
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["checkpoint-100000000-v7", "checkpoint-00000010-v5", "checkpoint-00000002-v20",
                     "checkpoint-00000001-v10"]
    assert ckpt.next_sequence(tmp_path) == 200_000_001  # incomplete names are taken too

    removed = ckpt.prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["checkpoint-00000002-v20", "checkpoint-00000001-v10"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == names[:2]
    assert not any(p.exists() for p in removed) and ckpt.list_temporaries(tmp_path) == []
    assert ckpt.prune(tmp_path, keep=5) == []
    assert len(ckpt.prune(tmp_path, keep=0)) == 2 and ckpt.list_checkpoints(tmp_path) == []
    with pytest.raises(ValueError):
        ckpt.prune(tmp_path, keep=-1)


def test_temporaries_are_ignored_and_removed(tmp_path):
    write(tmp_path, 1, 10)
    crashed = tmp_path / f".tmp-checkpoint-00000002-v20-{dead_pid()}-0123abcd"
    crashed.mkdir()
    (crashed / ckpt.MANIFEST_FILE).write_text("{}")  # even with a manifest it is no checkpoint
    writing = tmp_path / f".tmp-checkpoint-00000003-v30-{os.getpid()}-89abcdef"
    writing.mkdir()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-00000001-v10"]
    assert ckpt.next_sequence(tmp_path) == 2
    assert ckpt.list_temporaries(tmp_path) == [crashed, writing]

    assert ckpt.remove_temporaries(tmp_path) == [crashed]  # a live writer's is kept
    assert not crashed.exists() and writing.exists()
    assert (tmp_path / "checkpoint-00000001-v10").is_dir()


# Damaged checkpoints ------------------------------------------------------------------------------------


def test_a_flipped_byte_is_a_checksum_mismatch(tmp_path):
    path = write(tmp_path, 1, 10)
    flip_last_byte(path / ckpt.MODEL_FILE)
    with pytest.raises(CheckpointError, match="corrupt: checksum mismatch in model.safetensors") as info:
        ckpt.read_checkpoint(path)
    assert str(path) in str(info.value)
    read = ckpt.read_checkpoint(path, verify=False)  # sizes hold: reads, unverified
    assert read.weights["fc2.weight"].shape == (2, 3)


def test_a_truncated_file_says_truncated_even_unverified(tmp_path):
    path = write(tmp_path, 1, 10)
    data = (path / ckpt.STATE_FILE).read_bytes()
    (path / ckpt.STATE_FILE).write_bytes(data[:-10])
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=rf"truncated: state.safetensors has {len(data) - 10} bytes"):
            ckpt.read_checkpoint(path, verify=verify)
    (path / ckpt.STATE_FILE).write_bytes(data + b"x")
    with pytest.raises(CheckpointError, match="corrupt: state.safetensors has"):
        ckpt.read_checkpoint(path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / "manifest.json").unlink(), "incomplete: manifest.json is missing"),
        (lambda p: set_manifest(p, '{"format": "aps-che'), "manifest.json is not valid JSON"),
        (lambda p: set_manifest(p, b"\xff\xfe{}"), "manifest.json is not UTF-8"),
        (lambda p: set_manifest(p, "[1, 2]"), "manifest.json is not a JSON object"),
        (lambda p: set_manifest(p, '{"format": "other"}'), "is not an aps checkpoint"),
        (lambda p: (p / "manifest.json").write_text("{}"), "corrupt: checksum mismatch in manifest.json"),
        (lambda p: (p / "manifest.sha256").unlink(), "incomplete: manifest.sha256 is missing"),
        (lambda p: (p / "manifest.sha256").write_text("0" * 63 + "  manifest.json\n"),
         "corrupt: manifest.sha256 does not hold a SHA-256 line for manifest.json"),
        (lambda p: (p / "model.safetensors").unlink(), "incomplete: model.safetensors is missing"),
        (lambda p: (p / "state.safetensors").unlink(), "incomplete: state.safetensors is missing"),
        (lambda p: shutil.rmtree(p), "does not exist"),
    ],
    ids=["no-manifest", "garbage-manifest", "binary-manifest", "list-manifest", "other-format", "edited-manifest",
         "no-manifest-sum", "bad-manifest-sum", "no-model", "no-state", "no-checkpoint"],
)
def test_damage_is_a_clear_checkpoint_error(tmp_path, damage, message):
    path = write(tmp_path, 1, 10)
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        ckpt.read_checkpoint(path)


def _edit_manifest(path, **changes):
    manifest = json.loads((path / ckpt.MANIFEST_FILE).read_text())
    manifest.update(changes)
    set_manifest(path, json.dumps(manifest))


def test_manifest_fields_are_checked(tmp_path):
    path = write(tmp_path, 1, 10)
    _edit_manifest(path, format_version=3)
    with pytest.raises(CheckpointError, match="format version 3; this aps reads up to version 2"):
        ckpt.read_checkpoint(path)
    _edit_manifest(path, format_version=2, files={"model.safetensors": {"bytes": 1, "sha256": "x"}})
    with pytest.raises(CheckpointError, match="does not list model.safetensors and state.safetensors"):
        ckpt.read_checkpoint(path)
    path = write(tmp_path, 2, 20)
    _edit_manifest(path, layout={"names": ["a"], "shapes": [["x"]]})
    with pytest.raises(CheckpointError, match="manifest.json has no valid layout"):
        ckpt.read_checkpoint(path)
    with pytest.raises(CheckpointError, match="is not a directory"):
        ckpt.read_checkpoint(path / ckpt.MODEL_FILE)


def test_model_tensors_must_match_the_layout_and_be_float32(tmp_path):
    path = write(tmp_path, 1, 10)
    tensors = dict(WEIGHTS)
    tensors["fc1.bias"] = np.zeros(3, np.float32)
    rewrite_model(path, tensors)
    with pytest.raises(CheckpointError, match=r"tensor 'fc1.bias' in model.safetensors has shape \(3,\)"):
        ckpt.read_checkpoint(path)
    del tensors["fc1.bias"]
    rewrite_model(path, tensors)
    with pytest.raises(CheckpointError, match="lacks tensor 'fc1.bias'"):
        ckpt.read_checkpoint(path)
    rewrite_model(path, {**WEIGHTS, "fc1.bias": np.zeros(2, np.float64)})
    with pytest.raises(CheckpointError, match="'fc1.bias' in model.safetensors is float64, not float32"):
        ckpt.read_checkpoint(path)
    rewrite_model(path, {**WEIGHTS, "stray": np.zeros(1, np.float32)})
    with pytest.raises(CheckpointError, match=r"does not list: \['stray'\]"):
        ckpt.read_checkpoint(path)
    (path / ckpt.MODEL_FILE).write_bytes(b"\x00" * 7)
    _edit_manifest(path, files={ckpt.MODEL_FILE: {"bytes": 7, "sha256": hashlib.sha256(b"\x00" * 7).hexdigest()},
                                ckpt.STATE_FILE: json.loads((path / ckpt.MANIFEST_FILE).read_text())["files"][
                                    ckpt.STATE_FILE]})
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read"):
        ckpt.read_checkpoint(path)


# Resuming and loading -----------------------------------------------------------------------------------


def test_find_resumable_names_the_next_older_intact_checkpoint(tmp_path):
    paths = [write_resumable(tmp_path, s, 10 * s) for s in (1, 2, 3)]
    assert ckpt.find_resumable(tmp_path).path == paths[2]
    flip_last_byte(paths[2] / ckpt.MODEL_FILE)
    with pytest.raises(CheckpointError) as info:
        ckpt.find_resumable(tmp_path)
    assert str(info.value) == (
        f"checkpoint {paths[2]} is corrupt: checksum mismatch in model.safetensors; the next older one, "
        f"{paths[1]}, is intact: resume from it with --resume {paths[1]}"
    )
    with pytest.raises(CheckpointError, match=f"{paths[1]}, is intact: load it by its path"):
        ckpt.load_checkpoint(tmp_path)
    (paths[1] / ckpt.STATE_FILE).write_bytes(b"")  # the next older one is damaged too: skip it
    with pytest.raises(CheckpointError, match=f"the next older one, {paths[0]}, is intact"):
        ckpt.find_resumable(tmp_path)
    assert ckpt.find_resumable(paths[0]).version == 10  # a checkpoint itself
    with pytest.raises(CheckpointError, match=f"checksum mismatch.*the next older one, {paths[0]}, is intact"):
        ckpt.find_resumable(paths[2])  # named by its path: the older ones in its directory are offered too
    (paths[0] / ckpt.MANIFEST_FILE).write_text("{")
    with pytest.raises(CheckpointError, match="no older checkpoint in .* is intact either"):
        ckpt.find_resumable(tmp_path)


def test_find_resumable_in_a_new_directory_is_none(tmp_path):
    assert ckpt.find_resumable(tmp_path) is None
    assert ckpt.find_resumable(tmp_path / "not-yet") is None
    (tmp_path / "checkpoint-00000001-v10").mkdir()  # incomplete
    assert ckpt.find_resumable(tmp_path) is None
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.find_resumable(tmp_path / "checkpoint-00000009-v90")  # a checkpoint asked for by name
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="neither a checkpoint nor a directory"):
        ckpt.find_resumable(tmp_path / "file")


def test_load_checkpoint_takes_a_checkpoint_or_its_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        aps.load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        aps.load_checkpoint(tmp_path / "missing")
    older, newer = write(tmp_path, 1, 10), write(tmp_path, 2, 20)
    assert isinstance(aps.load_checkpoint(tmp_path), aps.Checkpoint)
    assert aps.load_checkpoint(tmp_path).path == newer
    assert aps.load_checkpoint(str(older)).version == 10


# Writing where it cannot ----------------------------------------------------------------------------------


def test_a_directory_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("a regular file")
    directory = tmp_path / "file" / "ckpts"
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint to {directory}: Not a directory"):
        write(directory, 1, 10)
    with pytest.raises(CheckpointError, match=f"cannot write checkpoints to {directory}: Not a directory"):
        ckpt.check_writable(directory)


def test_check_writable_creates_the_directory_and_leaves_nothing(tmp_path):
    directory = tmp_path / "a" / "b"
    ckpt.check_writable(directory)
    assert directory.is_dir() and os.listdir(directory) == []


def test_a_failed_write_leaves_no_temporary(tmp_path, monkeypatch):
    write(tmp_path, 1, 10)

    def read_only(src, dst):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "rename", read_only)  # the one os module, which the writer renames with
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint to {tmp_path}: Read-only file system"):
        write(tmp_path, 2, 20)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-00000001-v10"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tiny_tmpfs):
    big = {"w": np.ones(64 * 1024, np.float32)}  # 256 KiB into 64 KiB
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint to {tiny_tmpfs}: No space left on device"):
        write(tiny_tmpfs, 1, 10, weights=big)
    assert os.listdir(tiny_tmpfs) == []
    write(tiny_tmpfs, 1, 10, weights={"w": np.ones(16, np.float32)})  # the space came back
    assert ckpt.list_checkpoints(tiny_tmpfs) == [tiny_tmpfs / "checkpoint-00000001-v10"]


# PyTorch ------------------------------------------------------------------------------------------------


def _torch_model():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return torch, torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def test_torch_load_state_dict_copies_into_the_model(tmp_path):
    torch, model = _torch_model()
    import aps.torch as aps_torch

    rng = np.random.default_rng(1)
    weights = {name: rng.standard_normal(tuple(p.shape)).astype(np.float32) for name, p in model.named_parameters()}
    write(tmp_path, 1, 10, weights=weights)
    storage = model[0].weight.data_ptr()
    running_mean = model[1].running_mean.clone()
    loaded = aps_torch.load_state_dict(model, tmp_path)
    assert loaded.version == 10
    for name, param in model.named_parameters():
        np.testing.assert_array_equal(param.detach().numpy(), weights[name])
    assert model[0].weight.data_ptr() == storage  # in place
    assert torch.equal(model[1].running_mean, running_mean)  # buffers are not in checkpoints


def test_torch_load_state_dict_strict_names_the_parameters(tmp_path):
    torch, model = _torch_model()
    import aps.torch as aps_torch

    weights = {name: np.full(tuple(p.shape), 0.5, np.float32) for name, p in model.named_parameters()}
    del weights["2.bias"]
    weights["extra.weight"] = np.zeros(1, np.float32)
    path = write(tmp_path, 1, 10, weights=weights)
    before = model[2].bias.detach().clone()
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: 2\.bias; not parameters of the "
                                              r"model: extra\.weight"):
        aps_torch.load_state_dict(model, path)
    assert not torch.equal(model[0].weight, torch.full_like(model[0].weight, 0.5))  # nothing loaded

    aps_torch.load_state_dict(model, path, strict=False)
    assert torch.equal(model[0].weight, torch.full_like(model[0].weight, 0.5))
    assert torch.equal(model[2].bias, before)

    weights = {name: np.zeros(tuple(p.shape), np.float32) for name, p in model.named_parameters()}
    weights["0.bias"] = np.zeros(5, np.float32)
    path = write(tmp_path, 2, 20, weights=weights)
    with pytest.raises(CheckpointError, match=r"parameter '0\.bias' has shape \(5,\), the model's is \(4,\)"):
        aps_torch.load_state_dict(model, path, strict=False)


# The aps checkpoint command -----------------------------------------------------------------------------


def test_cli_inspect_prints_the_manifest_and_verifies(tmp_path, capsys):
    path = write(tmp_path, 4, 40, reason="shutdown", created=1_700_000_000.0,
                 sync={"name": "ssp", "staleness": 3}, optimizer={"name": "adam", "lr": 0.001})
    assert main(["checkpoint", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {path}" in out
    assert "version    40" in out and "sequence   4" in out and "shutdown" in out and "run-1" in out
    assert "ssp staleness=3" in out and "adam lr=0.001" in out and "2023-11-1" in out
    assert "4 tensors, 9 parameters" in out
    assert out.count(" ok") == 3 and "model.safetensors" in out and "state.safetensors" in out
    assert "manifest.json" in out and "ok (manifest.sha256)" in out

    assert main(["checkpoint", "inspect", str(tmp_path), "--json"]) == 0  # a directory: its newest
    assert json.loads(capsys.readouterr().out) == ckpt.read_manifest(path)

    # What aps serve writes: the run's options under "config", the time as ISO text.
    config = {"workers": 4, "sync": "dssp", "staleness": 3, "max_staleness": 15, "softsync_n": None}
    path = write(tmp_path, 5, 50, config=config, created="2025-01-02T03:04:05+00:00", weights={"w": np.ones(1)})
    assert main(["checkpoint", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "dssp staleness=3 max_staleness=15\n" in out and "workers    4" in out
    assert "2025-01-02T03:04:05+00:00" in out and "1 tensor, 1 parameter\n" in out

    # The curves the workers logged (the manifest's index; the points in state.safetensors).
    scalars = [[0, "loss", 3, 1, 3], [0, "lr", 3, 1, 3], [1, "loss", 2, 1, 2]]
    path = write(tmp_path, 6, 60, scalars=scalars, weights={"w": np.ones(1)})
    assert main(["checkpoint", "inspect", str(path)]) == 0
    assert "logged     3 curves of 2 ranks: loss, lr\n" in capsys.readouterr().out
    for odd in (5, True, {"0": 1}, [[0, "a\x1b[31mred", 1, 1, 1], [[[]]], "x"]):  # (inspect trusts no manifest)
        path = write(tmp_path, 7 + len(str(odd)), 70, scalars=odd, weights={"w": np.ones(1)})
        assert main(["checkpoint", "inspect", str(path)]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and ("logged     1 curve of 1 rank: \n" in out if isinstance(odd, list)
                                       else "logged" not in out)


def test_cli_inspect_of_a_corrupt_checkpoint_exits_1(tmp_path, capsys):
    path = write(tmp_path, 1, 10)
    flip_last_byte(path / ckpt.MODEL_FILE)
    with pytest.raises(SystemExit) as exited:
        main(["checkpoint", "inspect", str(path)])
    assert exited.value.code == 1
    captured = capsys.readouterr()
    assert "checksum mismatch in model.safetensors" in captured.out  # the file's status line
    assert captured.err == f"aps checkpoint: checkpoint {path} is corrupt: checksum mismatch in model.safetensors\n"
    assert main(["checkpoint", "inspect", "--no-verify", str(path)]) == 0
    assert "checksum not verified" in capsys.readouterr().out


def test_cli_list_newest_first_with_temporaries(tmp_path, capsys):
    for sequence in (1, 2, 3):
        write(tmp_path, sequence, 10 * sequence, created=1_700_000_000.0 + sequence)
    (tmp_path / f".tmp-checkpoint-00000004-v40-{dead_pid()}-0123abcd").mkdir()
    assert main(["checkpoint", "list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["checkpoint", "version", "created", "size"]
    assert [line.split()[0] for line in lines[1:4]] == [
        "checkpoint-00000003-v30", "checkpoint-00000002-v20", "checkpoint-00000001-v10"]
    assert lines[1].split()[1] == "30" and lines[1].endswith("B")
    assert lines[4].startswith("1 temporary directory") and ".tmp-checkpoint-00000004-v40" in lines[4]

    (tmp_path / "empty").mkdir()
    assert main(["checkpoint", "list", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.startswith("no checkpoints in")
    with pytest.raises(SystemExit) as exited:
        main(["checkpoint", "list", str(tmp_path / "missing")])
    assert exited.value.code == 1
    assert capsys.readouterr().err == f"aps checkpoint: {tmp_path / 'missing'} does not exist\n"


def test_the_lineage_journal_keeps_the_newest_and_with_a_key_only_what_it_signed(tmp_path):
    from aps.checkpoint import LINEAGE_FILE, checkpoint_key, read_lineage, record_incarnation

    ids = [f"{n:016x}" for n in range(70)]
    for n, incarnation in enumerate(ids[:3]):
        record_incarnation(tmp_path, incarnation, new_run=n == 0)
    assert read_lineage(tmp_path) == ids[:3]
    record_incarnation(tmp_path, ids[3], new_run=True)  # a new run's journal starts with it
    assert read_lineage(tmp_path) == ids[3:4]
    key = checkpoint_key(b"a token of the operator's")
    for incarnation in ids:
        record_incarnation(tmp_path, incarnation, key=key, run_id="run")
    assert read_lineage(tmp_path, key=key, run_id="run") == ids[-64:]
    assert read_lineage(tmp_path, key=key, run_id="another run") == []
    with open(tmp_path / LINEAGE_FILE, "a") as journal:  # a line written by someone without the key
        journal.write("deadbeefdeadbeef\n" f"{'ab' * 8} {'0' * 64}\n")
    assert read_lineage(tmp_path, key=key, run_id="run") == ids[-64:]
    assert oct((tmp_path / LINEAGE_FILE).stat().st_mode & 0o777) == oct(0o600)
