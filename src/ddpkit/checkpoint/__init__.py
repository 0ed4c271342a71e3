"""Checkpoints that survive crashes, kills and preemption, and resume as if nothing happened.

    >>> import tempfile, torch, ddpkit
    >>> from torch.utils.data import TensorDataset
    >>> with ddpkit.Job("single", device="cpu") as job:
    ...     model, optimizer = job.setup(torch.nn.Linear(4, 2), torch.optim.SGD, lr=0.1)
    ...     loader = job.train_loader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    ...     ckpt = job.checkpointer(tempfile.mkdtemp(), model=model, optimizer=optimizer, loader=loader)
    ...     print(ckpt.resume("auto"))                 # nothing saved yet: a fresh start
    ...     for x, y in loader:
    ...         job.backward(torch.nn.functional.cross_entropy(model(x), y))
    ...         stepped = job.step(optimizer)
    ...     print(ckpt.save().name)                    # every rank calls it; rank 0 writes in the background
    ...     ckpt.wait()                                # before exiting
    ...     print(ckpt.resume("auto").global_step, loader.epoch)
    None
    step-00000002.pt
    2 1

Files. ``atomic_save`` writes a temporary file in the target's folder, flushes and fsyncs it, then renames
it over the target: a crash at any moment leaves either the old file or the new one, never a torn one.
A checkpoint folder holds checkpoints named by the optimizer step, ``step-00000123.pt`` files (full) or
``step-00000123/`` folders (sharded), and ``latest``, a one-line pointer to the newest complete one,
replaced only after that checkpoint is on disk.

Full checkpoints (the default for single, dp, ddp and pipeline). The whole state is gathered to global
rank 0, which writes it in a background thread from a CPU copy taken at the step boundary: the other
ranks go on training instead of waiting (and timing out) on a slow disk.

Sharded checkpoints (the default for fsdp and zero; ``sharded=True`` for any strategy but pipeline).
Every rank writes its own part through torch.distributed.checkpoint (``ddpkit.checkpoint.sharded``) into a
``.tmp-step-…/`` folder; rank 0 then adds ``ddpkit.pt`` (the rest of the state and a CRC-32 of every
file) and renames the folder into place. ``async_save=True``: training waits only for the copy to host
memory, and the files are written in the background. A sharded checkpoint resumes on any world size.

Either way every rank contributes its own RNG states (torch, CUDA, numpy, python), gathered to rank 0.

Loading. ``torch.load(..., weights_only=True)`` only: a checkpoint is untrusted input and unpickling
runs code, so everything ddpkit writes is plain tensors, numbers, strings, lists and dicts. The
tutorials' formats load too: a plain state_dict, and ``{"model_state_dict", "optimizer_state_dict",
"epoch"}``, with or without DDP's ``module.`` prefix. A sharded checkpoint's files are checked against
their checksums before it is chosen, and its metadata is read without unpickling anything but DCP's own
records.

The pieces: ``files`` (atomic writes, reading without running code), ``format`` (the layouts and their
checks, RNG states), ``folder`` (names, ``latest``, choosing and pruning), ``checkpointer`` (saving),
``resume`` (reading back on every rank), ``sharded`` (torch.distributed.checkpoint folders), ``export``.
"""

from ddpkit.checkpoint.checkpointer import Checkpointer
from ddpkit.checkpoint.export import export_model
from ddpkit.checkpoint.files import (TEMP_PREFIX, atomic_save, atomic_write, is_sharded_checkpoint, load_checkpoint,
                                     load_file)
from ddpkit.checkpoint.folder import (FOLDER, MODEL_FILE, POINTER, checkpoint_name, find_resumable, list_checkpoints, prune,
                                      read_pointer, remove_partial_writes, set_aside, step_of, write_pointer)
from ddpkit.checkpoint.format import (FORMAT, KEY_FORMAT, KEY_MODEL, KEY_PROGRESS, Contents, check_model_state, check_optimizer_state, load_model_state,
                                      model_state_dict, read_contents, rng_state, set_rng_state, strip_prefix)
from ddpkit.checkpoint.resume import Resumed
from ddpkit.core.errors import CheckpointError

__all__ = ["FOLDER", "FORMAT", "KEY_FORMAT", "KEY_MODEL", "KEY_PROGRESS", "MODEL_FILE", "POINTER", "TEMP_PREFIX", "CheckpointError", "Checkpointer", "Contents", "Resumed", "atomic_save",
           "atomic_write", "check_model_state", "check_optimizer_state", "checkpoint_name", "export_model",
           "find_resumable", "is_sharded_checkpoint", "list_checkpoints", "load_checkpoint", "load_file",
           "load_model_state", "model_state_dict", "prune", "read_contents", "read_pointer", "remove_partial_writes", "rng_state",
           "set_aside", "set_rng_state", "step_of", "strip_prefix", "write_pointer"]
