"""Crash-safe files: write to a temporary name, fsync, rename, fsync the folder.

The coordinator's checkpoints and a site's saved state both rely on it (here, the layer both
processes share): after ``kill -9`` at any instant a file holds either its previous content or
its new one, never a torn mix. Tensors are streamed into safetensors files tensor by tensor
(hashed on the way), so saving costs no memory beyond the tensors themselves (for a 50M-parameter
model ``safetensors.torch.save``'s blob and byte copies made the checkpoint the coordinator's
memory peak), and loading never unpickles (a file cannot run code).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

__all__ = [
    "SAFETENSORS_DTYPES",
    "atomic_write",
    "atomic_write_safetensors",
    "file_sha256",
    "fsync_dir",
    "model_file_metadata",
]

_HASH_BLOCK = 16 << 20
"""Bytes read at a time when verifying a file's checksum."""

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch dtype -> safetensors dtype name, for the dtypes checkpoints and site states hold."""


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_with(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through ``.NAME.tmp-PID``, fsync, rename, fsync the folder; a failed write
    removes the temporary file (a crash leaves it for the owner's clean-up)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (see the module docstring)."""
    _atomic_write_with(path, lambda f: f.write(data))


def _safetensors_header(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[torch.Tensor]]:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    ordered = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {tensor.dtype}; supported: "
                f"{', '.join(str(d) for d in SAFETENSORS_DTYPES)}"
            )
        cpu = tensor.detach().to("cpu").contiguous()
        nbytes = cpu.numel() * cpu.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[cpu.dtype],
            "shape": list(cpu.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        ordered.append(cpu)
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ordered


def atomic_write_safetensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> str:
    """Write ``tensors`` to ``path`` as a safetensors file, atomically; returns its SHA-256.
    ``metadata``: the file's ``__metadata__`` (string to string, as safetensors defines it)."""
    if sys.byteorder != "little":  # pragma: no cover - geoloco runs on little-endian machines
        raise RuntimeError("safetensors files are little-endian; this machine is not")
    digest = hashlib.sha256()

    def write(f: IO[bytes]) -> None:
        header, ordered = _safetensors_header(tensors, metadata)
        f.write(header)
        digest.update(header)
        for tensor in ordered:
            if tensor.numel() == 0:
                continue
            view = tensor.reshape(-1).view(torch.uint8).numpy().data
            f.write(view)
            digest.update(view)

    _atomic_write_with(path, write)
    return digest.hexdigest()


def model_file_metadata(round_number: int, digest: str, workload: dict[str, Any]) -> dict[str, str]:
    """The ``__metadata__`` of a model file the coordinator exports or a site saves at its end
    (a ``state_dict`` of the global weights): ``format = pt`` (what Hugging Face's loaders look
    for), the round the weights are of, their digest and the run's ``[workload]`` table."""
    return {
        "format": "pt",
        "geoloco_round": str(round_number),
        "geoloco_weights_digest": digest,
        "geoloco_workload": json.dumps(workload, sort_keys=True),
    }


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in blocks (a multi-GB tensor file is never held in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()
