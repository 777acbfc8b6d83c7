"""Composing LoRA adapters: a weighted mixture as one exactly equivalent adapter on disk.

A mixture W' = W + Σ_c α_c s_c B_c A_c (s_c: adapter c's scaling, alpha/r) is, per layer,
one LoRA of rank Σ r_c: A = [α_1 s_1 A_1; α_2 s_2 A_2; ...] stacked by rows, B = [B_1 B_2 ...]
side by side, and scaling 1 (PEFT's ``add_weighted_adapter(combination_type="cat")``).
A per-layer mixture (the learned gate's) folds each layer's own α into that layer's A.
It is written as an ordinary PEFT adapter directory, so both backends load it the way
they load any adapter: vLLM through its runtime LoRA API, the embedded backend into PEFT,
where it batches with other adapters through the mixed-batch path. The exactness is
algebraic, not approximate; the float error is one multiplication per A.

Reads and writes safetensors with numpy (bf16 and f16 tensors widened to float32), so the
gateway needs no torch to compose for vLLM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trace_plugin.adapter_files import CONFIG, WEIGHTS, AdapterError, read_safetensors, write_safetensors

_A, _B = ".lora_A.weight", ".lora_B.weight"
_LAYER = re.compile(r"\.layers\.(\d+)\.")  # a decoder layer's index in a module's name

Weight = float | Sequence[float]  # one weight, or one per decoder layer


def compose_adapter(parts: Sequence[tuple[Path, Weight]], out: Path) -> Path:
    """Write the adapter for ``Σ weight · adapter`` over ``parts`` to ``out``, replacing it.

    A part's weight is one number, or one per decoder layer (``weight[l]`` for the modules
    of ``layers.l``). Every part must be a plain LoRA: no DoRA, no bias or saved modules,
    one rank and one alpha for all its layers. A layer that only some parts adapt gets
    zero blocks from the others.
    """
    if not parts:
        raise AdapterError("a composed adapter needs at least one part")
    loaded = [(_lora(path), weight) for path, weight in parts]
    modules = sorted({m for (_, _, tensors), _ in loaded for m in tensors})
    rank = sum(config["r"] for (config, _, _), _ in loaded)
    weights: dict[str, np.ndarray] = {}
    for module in modules:
        a_blocks, b_blocks = [], []
        a0, b0 = next(t[module] for (_, _, t), _ in loaded if module in t)
        for (config, scaling, tensors), weight in loaded:
            r = config["r"]
            a, b = tensors.get(module) or (np.zeros((r, a0.shape[1])), np.zeros((b0.shape[0], r)))
            a_blocks.append(a * (_weight_of(module, weight) * scaling))
            b_blocks.append(b)
        weights[module + _A] = np.concatenate(a_blocks, axis=0).astype(np.float32)
        weights[module + _B] = np.concatenate(b_blocks, axis=1).astype(np.float32)
    first = loaded[0][0][0]
    config = {
        **first,
        "r": rank,
        "lora_alpha": rank,  # scaling 1: the weights and scalings are inside A
        "use_rslora": False,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "rank_pattern": {},
        "alpha_pattern": {},
        "lora_dropout": 0.0,
        "inference_mode": True,
    }
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / CONFIG).write_text(json.dumps(config, indent=2))
    write_safetensors(partial / WEIGHTS, weights)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return out


def _weight_of(module: str, weight: Weight) -> float:
    if isinstance(weight, int | float):
        return float(weight)
    found = _LAYER.search(module)
    if found is None or int(found[1]) >= len(weight):
        raise AdapterError(f"per-layer weights for {len(weight)} layers do not cover the module {module}")
    return float(weight[int(found[1])])


def _lora(path: Path) -> tuple[dict[str, Any], float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """An adapter's config, scaling and per-module (A, B), refused unless it is a plain LoRA."""
    try:
        config = json.loads((path / CONFIG).read_text())
        tensors = read_safetensors(path / WEIGHTS)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot compose {path}: {exc}") from exc
    plain = (
        not config.get("use_dora")
        and config.get("bias", "none") == "none"
        and not config.get("modules_to_save")
        and not config.get("rank_pattern")
        and not config.get("alpha_pattern")
        and not config.get("fan_in_fan_out")
    )
    if not plain or not isinstance(config.get("r"), int) or config["r"] <= 0:
        raise AdapterError(f"{path} is not a plain LoRA (one rank and alpha, no DoRA, bias or saved modules)")
    if any(not (name.endswith(_A) or name.endswith(_B)) for name in tensors):
        raise AdapterError(f"{path} holds tensors other than LoRA A and B matrices: cannot compose it")
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in tensors:
        if name.endswith(_A):
            module = name.removesuffix(_A)
            a, b = tensors[name], tensors.get(module + _B)
            if b is None or a.shape[0] != config["r"] or b.shape[1] != config["r"]:
                raise AdapterError(f"{path}: {module} has no B matrix or a rank other than {config['r']}")
            modules[module] = (a.astype(np.float64), b.astype(np.float64))
    alpha = float(config.get("lora_alpha", config["r"]))
    scaling = alpha / (config["r"] ** 0.5 if config.get("use_rslora") else config["r"])
    return config, scaling, modules
