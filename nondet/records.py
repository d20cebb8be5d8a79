"""Record layouts shared by the capture (child), the store (HDF5) and the comparison.

Rows are NumPy structured arrays so they cross the pipe as raw bytes and land in HDF5
as compound datasets that plain h5py reads back. An op record is exactly 64 bytes.
A fingerprint of 0 means "absent" (no batch in this step, an output not fingerprinted).
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

import numpy as np

#: Strings with this prefix are not names but the text of a source line:
#: "<mark><file:line>\n<the line's text>" (see session.SourceLocator). Here, not in the
#: store: the recorded run interns them and never imports the store (h5py).
SOURCE_TEXT_MARK = "\x1fsource\x1f"


class Phase(IntEnum):
    INIT = 0
    DATA = 1
    FORWARD = 2
    BACKWARD = 3
    OPTIMIZER = 4
    COMM = 5
    OTHER = 6

    @property
    def label(self) -> str:
        return self.name.lower()


class Kind(IntEnum):
    OP = 0  # an executed op
    ENTRY = 1  # a tensor that entered from outside the captured ops (batch, NumPy, ...)
    PROBE = 2  # nondet.probe(tensor, name)


class Flag(IntFlag):
    NONE = 0
    VIEW = 1  # output aliases an input: not fingerprinted, cannot inject a difference
    UNINIT_OUTPUT = 2  # output is uninitialized memory (empty & co.): never compared
    READS_UNINIT = 4  # some input is (possibly) uninitialized memory and is read
    OVERWRITES_UNINIT = 8  # an uninitialized input is fully overwritten (its value is ignored)
    UNHASHABLE = 16  # an output could not be fingerprinted (meta, nested, subclass)
    RNG = 32  # the op draws random numbers
    INPLACE = 64  # the op mutates an input
    CUDA = 256  # first output on a CUDA device
    OTHER_DEVICE = 512  # first output on neither CPU nor CUDA (mps, xpu, ...)
    #: called with accumulate=True (index_put_, put_): whether repeated indices are summed
    #: or overwritten decides the fix (put_ overwriting has no deterministic kernel)
    ACCUMULATES = 1024


def device_of(flags: int) -> str:
    if flags & Flag.CUDA:
        return "cuda"
    if flags & Flag.OTHER_DEVICE:
        return "other"
    return "cpu"


#: Entry descriptions are stored as "<entry kind>:<what>" in the op-name string table.
ENTRY_KINDS = ("dataloader", "numpy", "python_value", "external", "rng_state", "probe",
               "tf_data", "variable")

#: A graph op is named "<op type>@<node name>" (``BiasAddGrad@gradient_tape/dense/BiasAddGrad``);
#: runs are aligned and recipes matched on the op type, so renamed nodes do not count as a
#: difference. Eager and torch ops have no node name.
NODE_SEP = "@"


def split_node(name: str) -> tuple[str, str | None]:
    """``(op type, node name or None)`` of an op record's name."""
    op_type, sep, node = name.partition(NODE_SEP)
    return (op_type, node) if sep else (name, None)


OP_DTYPE = np.dtype(
    [
        ("step", "<i4"),
        ("index", "<i4"),  # position in the step's record stream (ops and entries)
        ("kind", "u1"),
        ("phase", "u1"),
        ("flags", "<u2"),
        ("name", "<i4"),  # string id: "aten.mm.default", "MatMul@dense/MatMul", "dataloader:batch"
        ("module", "<i4"),  # string id: "encoder.layers.3.attn" ("" = the root module)
        ("source", "<i4"),  # string id: "train.py:27" (-1 = unknown)
        ("out_fp", "<u8"),  # combined fingerprint of all outputs (incl. mutated inputs)
        ("in_fp", "<u8"),  # combined fingerprint of initialized tensor inputs
        ("taint_fp", "<u8"),  # combined fingerprint of uninitialized inputs that are read
        ("scalar_fp", "<u8"),  # fingerprint of non-tensor arguments (Python numbers)
        ("numel", "<i8"),  # elements of the first output
    ]
)
assert OP_DTYPE.itemsize == 64

STEP_DTYPE = np.dtype(
    [
        ("step", "<i4"),  # -1 = the init row (state when training starts)
        ("data_fp", "<u8"),  # batches and NumPy-made tensors that entered in this step
        ("loss_fp", "<u8"),  # the tensor(s) backward() was called on
        ("loss", "<f8"),  # its value (NaN if not a scalar)
        ("grads_fp", "<u8"),
        ("params_fp", "<u8"),  # after the update
        ("buffers_fp", "<u8"),  # e.g. batch-norm running statistics
        ("optim_fp", "<u8"),  # optimizer state after the update
        ("rng_fp", "<u8"),  # framework, NumPy and Python RNG states at the step end
        ("probes_fp", "<u8"),
        ("params_sum", "<f8"),  # sum of all parameter values: shows how a difference grows
        ("wall", "<f8"),  # seconds since the run started, less time held by lockstep
        ("n_records", "<i4"),  # op records captured in this step (0 outside the op window)
    ]
)

#: Step-row fields in the order a difference is attributed to a phase.
STEP_COMPONENTS: tuple[tuple[str, Phase], ...] = (
    ("data_fp", Phase.DATA),
    ("loss_fp", Phase.FORWARD),
    ("grads_fp", Phase.BACKWARD),
    ("params_fp", Phase.OPTIMIZER),
    ("buffers_fp", Phase.FORWARD),
    ("optim_fp", Phase.OPTIMIZER),
    ("probes_fp", Phase.OTHER),
    ("rng_fp", Phase.OTHER),
)


class Group(IntEnum):
    """What a per-tensor step row describes."""

    PARAM = 0
    GRAD = 1
    BUFFER = 2
    OPTIM = 3
    DATA = 4
    PROBE = 5


TENSOR_DTYPE = np.dtype(
    [
        ("step", "<i4"),
        ("group", "u1"),
        ("name", "<i4"),  # string id, e.g. "encoder.weight"
        ("fp", "<u8"),
        ("sum", "<f8"),
        ("maxabs", "<f8"),
        ("numel", "<i8"),
    ]
)

#: One row per collective record (frameworks/torch/comm.py): what the op record's 64 bytes
#: cannot hold. ``index`` is the collective's op record in its step. Sizes are -1 when unknown.
COMM_DTYPE = np.dtype(
    [
        ("step", "<i4"),
        ("index", "<i4"),  # the collective's op record (same step)
        ("backend", "<i4"),  # string id: "gloo", "nccl", ... (-1 = unknown)
        ("group_size", "<i4"),  # ranks in the process group (-1 = unknown)
        ("bucket", "<i4"),  # DDP's gradient bucket index (-1 = not a DDP bucket)
        ("nbytes", "<i8"),  # bytes of the call's tensors (a DDP bucket: its byte size)
        ("output", "u1"),  # CommOutput: when (whether) its output was fingerprinted
    ]
)


class CommOutput(IntEnum):
    """When a collective's output fingerprint (the op record's ``out_fp``) was taken."""

    NOT_READ = 0  # the script did not wait for it in its step (or nondet could not see it)
    AFTER_WAIT = 1  # right after ``Work.wait()`` returned
    AFTER_BACKWARD = 2  # a DDP bucket: after the backward pass (DDP waits for its buckets)
    ON_DEVICE = 3  # NCCL: hashed on the device, ordered after the collective's stream work


INDEX_DTYPE = np.dtype([("step", "<i4"), ("start", "<i8"), ("count", "<i8")])

INIT_STEP = -1
