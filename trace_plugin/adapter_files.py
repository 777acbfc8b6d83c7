"""An adapter's files: one home for what training writes, the improver checks and the
gateway loads.

A LoRA adapter is a PEFT directory: ``adapter_config.json`` and the tensors in
``adapter_model.safetensors``. Here are those names, the checks an adapter passes before it
serves (complete, finite, adapting only modules the base model has), safetensors read and
written with numpy (no torch: the gateway composes mixtures for vLLM without it), and the
two digests, each named for what it covers: ``files_digest`` (config and weights: what
a backend reads, so the gateway's "one name, one set of files" rule) and
``weights_digest`` (the weights alone: an ``Expert``'s stored ``adapter_sha256``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

from trace_plugin.errors import TracePluginError
from trace_plugin.model_files import safetensors_header

WEIGHTS = "adapter_model.safetensors"  # PEFT's file name for an adapter's tensors
CONFIG = "adapter_config.json"
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


class AdapterError(TracePluginError, ValueError):
    """A request about adapters that cannot be honoured; carries an HTTP status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def check_complete(weights: Path, path: str | Path) -> None:
    """Refuse a safetensors file shorter than its header says: an adapter still being written
    (or cut off) would otherwise fail inside the server with a less helpful message."""
    try:
        with weights.open("rb") as f:
            size, header = safetensors_header(f)
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise AdapterError(f"{path}/{WEIGHTS} is not a safetensors file ({exc})") from exc
    have, want = weights.stat().st_size, 8 + size + end
    if have < want:
        raise AdapterError(
            f"{path}/{WEIGHTS} is incomplete ({have} of {want} bytes): still being written, or cut off"
        )


def files_digest(path: Path) -> str:
    """A digest of what a backend reads from an adapter directory: its config and weights."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", WEIGHTS, "adapter_model.bin"):
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0")
            with file.open("rb") as f:
                while chunk := f.read(2**20):
                    digest.update(chunk)
    return digest.hexdigest()


def weights_digest(adapter_dir: Path) -> str:
    """The SHA-256 of an adapter's weights file, as ``Expert.adapter_sha256`` holds it."""
    return file_sha256(Path(adapter_dir) / WEIGHTS)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


PEFT_PREFIX = "base_model.model."  # PEFT's name for the wrapped model, before each module's path


def check_weights(path: Path, modules: Collection[str] | None = None) -> None:
    """Refuse an adapter that would load and then serve nothing useful: NaN or Inf weights
    (it answers ``""``), or LoRA weights for modules the base model lacks (``modules``: its
    module names; a layer 999, a module of another architecture), which a loader skips in
    silence. Only safetensors weights are read."""
    if not (path / WEIGHTS).is_file():
        return
    try:
        tensors = read_safetensors(path / WEIGHTS)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: {exc}") from exc
    broken = sorted(name for name, array in tensors.items() if not np.isfinite(array).all())
    if broken:
        raise AdapterError(f"adapter {path.name} holds NaN or Inf weights: {', '.join(broken[:3])}", 422)
    if modules is not None:
        lora = {n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for n in tensors if ".lora_" in n}
        unknown = sorted(lora - set(modules))
        if unknown:
            raise AdapterError(
                f"adapter {path.name} has weights for modules the base model lacks: {', '.join(unknown[:3])}",
                422,
            )


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor in a safetensors file, as numpy arrays (bf16 widened to float32)."""
    with open(path, "rb") as f:
        try:
            _, header = safetensors_header(f)
        except ValueError as exc:
            raise ValueError(f"{path.name}: {exc}") from exc
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[start:end]
        if info["dtype"] == "BF16":  # the upper half of a float32
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _DTYPES:
            array = np.frombuffer(raw, _DTYPES[info["dtype"]])
        else:
            raise ValueError(f"{path.name}: tensor {name} has dtype {info['dtype']}")
        tensors[name] = array.reshape(info["shape"])
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Float32 tensors as a safetensors file."""
    header: dict[str, Any] = {}
    offset = 0
    for name, array in tensors.items():
        size = array.size * 4
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())
