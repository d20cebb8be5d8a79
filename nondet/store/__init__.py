"""The HDF5 capture file: one per run, readable with plain h5py and h5ls.

Layout (format 1.x)::

    /                 attrs: nondet_format_version, nondet_version, label, command, script,
                      script_sha256, seed, started, rank, world_size, status, exit_code, steps,
                      nondet_strings_crc, nondet_digest (1.1+)
    /env              attrs: one string per environment key (versions, devices, threads, env vars)
    /facts            attrs: JSON values the recipe matcher uses
    /strings          utf-8 strings; op names, modules and sources are ids into it
    /steps            STEP_DTYPE rows, one per step (step -1 = state when training starts)
    /tensors          TENSOR_DTYPE rows: per-tensor fingerprints, for steps with op-level records
    /ops              OP_DTYPE rows (64 bytes each), in execution order
    /op_index         INDEX_DTYPE rows: where each step's ops start in /ops
    /dumps/<name>     full values of one op's outputs (written only to measure a difference)

Rows are appended and flushed in batches at most a quarter second apart (Note [Rows
stored in batches] in writer.py), so an interrupted run leaves a readable file whose
``status`` attribute is not "complete".

Note [Damage detection] (format 1.1): every table and dump has HDF5's fletcher32 filter,
and the file uses the 1.10 object format, whose metadata (superblock, object headers, chunk
indexes) carries checksums, so libhdf5 refuses a damaged block instead of returning it.
Two things HDF5 does not checksum are covered by our own attributes (plain integers, so
they live in a checksummed object header): the variable-length strings (``/strings`` and
string attributes live in the unchecksummed global heap) by ``nondet_strings_crc``, and
every attribute value by ``nondet_digest``. Format 1.0 files have neither and still open.
``open_capture`` verifies them.
"""

from nondet.records import SOURCE_TEXT_MARK
from nondet.store.reader import Capture, open_capture
from nondet.store.writer import (
    DIGEST_ATTR,
    FORMAT_MAJOR,
    FORMAT_VERSION,
    STRINGS_CRC_ATTR,
    TABLES,
    CaptureWriter,
)

__all__ = ["DIGEST_ATTR", "FORMAT_MAJOR", "FORMAT_VERSION", "SOURCE_TEXT_MARK",
           "STRINGS_CRC_ATTR", "TABLES", "Capture", "CaptureWriter", "open_capture"]
