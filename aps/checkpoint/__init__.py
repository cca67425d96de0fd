"""The on-disk checkpoint format: a directory of safetensors files and a JSON manifest.

A checkpoint directory (``aps serve --checkpoint-dir``) holds one directory per
checkpoint, named ``checkpoint-{sequence:08d}-v{version}``, each with three files:

``model.safetensors``
    The model's weights: one float32 tensor per model tensor, with its shape.
    ``safetensors.torch.load_file`` returns it as a PyTorch state dict.
``state.safetensors``
    Every other array (optimizer state such as ``exp_avg/fc.weight``, an
    accumulated gradient ...), named by the writer. It may hold no tensor.
``manifest.json``
    Everything that is not an array (version, clocks, configuration ...), plus
    the format, its version and each file's size and SHA-256 (``sha256sum``
    agrees), so a reader can tell a complete checkpoint from a torn or corrupt one.
``manifest.sha256``
    The SHA-256 of ``manifest.json`` itself, as ``sha256sum manifest.json``
    prints it (so ``sha256sum -c manifest.sha256`` checks it): the manifest
    holds the run's options, version, clocks and what each rank pushed last,
    and a flipped bit there must not change a resumed run silently. Format
    version 1 (before this file existed) is still read, with a warning that
    its manifest cannot be verified; from version 2 a missing one is refused.

A checkpoint is written into a temporary directory (``.tmp-{name}-{pid}-{random}``),
manifest (then its checksum) last, every file and the directory fsynced, then
renamed into place: a crash leaves either a complete checkpoint or a temporary
that :func:`remove_temporaries` deletes, never a torn one. Reading checks the
manifest against its checksum, each file's size and (unless asked not to) its
checksum, and the model tensors against the manifest's layout before loading
anything; :func:`find_resumable` also checks the type of every field a resume
uses (:func:`check_resumable`). Only regular files are opened (a FIFO or a
device in a checkpoint's place is refused, never waited on), and a read that
makes no progress for :data:`READ_STALL_S` seconds (a hung network file system)
is given up with a clear error.

The modules: ``format`` (names, constants, :class:`Checkpoint`, writing), ``reading``
(every read, checked), ``directory`` (listing, pruning, locks, finding the one to resume
from) and ``resume`` (what a resume takes from a manifest, each field checked).

Example::

    ckpt = aps.load_checkpoint("ckpts")  # the newest checkpoint in ckpts/
    ckpt.version, ckpt.weights["fc.weight"].shape
"""

from __future__ import annotations

from .format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_FILE,
    MANIFEST_MAC_FILE,
    MANIFEST_SUM_FILE,
    MODEL_FILE,
    READ_STALL_S,
    STATE_FILE,
    Checkpoint,
    check_writable,
    checkpoint_key,
    checkpoint_name,
    write_checkpoint,
)
from .reading import (
    file_problems,
    read_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from .directory import (
    LINEAGE_FILE,
    directory_bytes,
    find_resumable,
    is_checkpoint,
    list_checkpoints,
    list_temporaries,
    load_checkpoint,
    lock_directory,
    lock_run_directory,
    next_sequence,
    prune,
    read_lineage,
    record_incarnation,
    remove_temporaries,
)
from .resume import (
    check_resumable,
)

__all__ = [
    "Checkpoint",
    "FORMAT",
    "FORMAT_VERSION",
    "LINEAGE_FILE",
    "MANIFEST_FILE",
    "MANIFEST_MAC_FILE",
    "MANIFEST_SUM_FILE",
    "MODEL_FILE",
    "READ_STALL_S",
    "STATE_FILE",
    "check_resumable",
    "check_writable",
    "checkpoint_key",
    "checkpoint_name",
    "lock_directory",
    "lock_run_directory",
    "directory_bytes",
    "file_problems",
    "find_resumable",
    "is_checkpoint",
    "list_checkpoints",
    "list_temporaries",
    "load_checkpoint",
    "next_sequence",
    "prune",
    "read_checkpoint",
    "read_lineage",
    "read_manifest",
    "record_incarnation",
    "remove_temporaries",
    "verify_checkpoint",
    "write_checkpoint",
]
