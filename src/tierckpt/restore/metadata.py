"""Read DCP's ``.metadata`` without running code from it.

``.metadata`` is a pickle, and torch's ``FileSystemReader.read_metadata`` ``pickle.load``\\s
it: anyone who can write a checkpoint's directory or bucket can plant a ``__reduce__`` that
runs on load — and since such a writer can rewrite ``manifest.json`` and ``COMPLETE`` too,
no CRC check stops them (only signing does). Here the pickle may name only the globals a
real ``Metadata`` pickles, each resolved from a fixed table (nothing is imported, nothing
is looked up by name on a module):

- the dataclasses of ``torch.distributed.checkpoint.metadata`` (and its private
  ``_MEM_FORMAT_ENCODING``, how ``TensorProperties`` stores a memory format), DCP's
  ``filesystem._StorageInfo`` and ``torch.Size``: value constructors;
- torch's dtypes (globals such as ``torch.float32``: values, not callables) and
  ``torch.serialization._get_layout`` (how a ``torch.layout`` pickles: a name lookup);
- ``pathlib.PosixPath``: plain ``dcp.save`` stores its checkpoint id as one.

The table was taken from real pickles (tierckpt's writer: a module with Adam, bf16 and
int64 tensors, the per-rank state blob, FSDP2 on two ranks; torch's ``FileSystemWriter``)
under torch 2.13. No builtin or ``copyreg`` helper is needed: protocols 2+ build
dataclasses with opcodes. Any other global raises
:class:`~tierckpt.errors.UnsafeCheckpointError` before it is resolved; a file that is not
a pickled ``Metadata`` (truncated, garbage, another top-level type) raises
:class:`~tierckpt.errors.IntegrityError`.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from tierckpt._torch.dcp import MEM_FORMAT_ENCODING, StorageInfo, get_layout
from tierckpt.errors import IntegrityError, UnsafeCheckpointError
from tierckpt.format import checksum
from tierckpt.format.manifest import FileEntry

_MD = "torch.distributed.checkpoint.metadata"
ALLOWED: Mapping[tuple[str, str], Any] = MappingProxyType({
    **{(_MD, c.__name__): c for c in (
        _md.Metadata, _md.TensorStorageMetadata, _md.BytesStorageMetadata,
        _md.ChunkStorageMetadata, _md.TensorProperties, _md.MetadataIndex, _md.StorageMeta,
        MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): get_layout,
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
    ("pathlib", "PosixPath"): pathlib.PosixPath,
})
"""Every global a ``.metadata`` pickle may name, ``(module, qualname)`` → the object."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler whose globals come from :data:`ALLOWED` only."""

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            refused = f"{module}.{name}"
            raise UnsafeCheckpointError(
                f"{self._source}: refusing to unpickle {refused}: this .metadata references "
                "a class outside DCP's checkpoint metadata — it may have been planted; the "
                "file was not loaded; delete or quarantine the checkpoint and check who can "
                "write to the bucket", refused=refused, source=self._source)
        return found


def load_metadata(data: bytes, *, source: str) -> Metadata:
    """Unpickle DCP ``Metadata`` from ``data`` admitting only :data:`ALLOWED` globals.
    ``source`` (a path or URL) names the file in errors. Raises
    :class:`UnsafeCheckpointError` for any other global, :class:`IntegrityError` when
    ``data`` is not a well-formed pickled ``Metadata``."""
    try:
        md = _MetadataUnpickler(data, source).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # only allowlisted constructors ran: any failure is a bad file
        raise IntegrityError(f"{source}: not a readable DCP metadata pickle "
                             f"({type(e).__name__}: {e})") from e
    if not isinstance(md, Metadata) or not isinstance(
            getattr(md, "state_dict_metadata", None), dict) or not isinstance(
            getattr(md, "storage_meta", None), StorageMeta | None):
        raise IntegrityError(f"{source}: holds a pickled {type(md).__name__}, not a "
                             "well-formed DCP Metadata")
    return md


def read_metadata_file(path: str | os.PathLike[str], *, load_id: str | None,
                       expect: FileEntry | None = None) -> Metadata:
    """``.metadata`` (or a rank's ``__<r>.metadata``) at ``path`` through
    :func:`load_metadata`, then what torch's ``FileSystemReader.read_metadata`` adds: a
    ``StorageMeta`` when the file has none, and its ``load_id``. With ``expect`` (the
    manifest's entry) the bytes must have its size and CRC32C before they are unpickled,
    else :class:`IntegrityError`."""
    with open(path, "rb") as f:
        data = f.read()
    if expect is not None:
        crc = checksum.extend(0, data)
        if len(data) != expect.size or crc != expect.crc32c:
            raise IntegrityError(
                f"{os.fspath(path)}: {len(data)} bytes with CRC32C {checksum.to_hex(crc)}, "
                f"the manifest says {expect.size} bytes with {checksum.to_hex(expect.crc32c)}")
    md = load_metadata(data, source=os.fspath(path))
    if md.storage_meta is None:
        md.storage_meta = StorageMeta()
    md.storage_meta.load_id = load_id
    return md
