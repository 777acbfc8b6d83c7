"""LoRA adapters: the shape every expert takes on disk (a PEFT adapter directory)."""

from __future__ import annotations

from pathlib import Path

from trace_plugin.adapter_files import WEIGHTS


def random_adapter(model_dir: Path, out: Path, *, seed: int, rank: int = 8, scale: float = 20.0) -> Path:
    """An untrained rank-``rank`` LoRA on every linear layer, with random weights, saved by PEFT.

    For exercising serving (loading, routing, hot-swap) without training: PEFT's default
    initialization leaves an adapter a no-op, so B is drawn at random and scaled until the
    adapter visibly changes greedy decoding.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    from trace_plugin.model_files import load_model

    base, _ = load_model(model_dir)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(out)
    return out


def is_noop(adapter_dir: Path) -> bool:
    """Whether the adapter leaves the base model exactly as it is: every ``lora_B`` is zero.

    PEFT starts B at zero, so an adapter that no gradient step ever reached (GRPO whose
    groups were all flat) is the base model, and measuring it again would be wasted time.
    """
    from safetensors.torch import load_file

    weights = load_file(Path(adapter_dir) / WEIGHTS)
    if any("lora_A" not in name and "lora_B" not in name for name in weights):
        return False  # other trained tensors (modules_to_save, biases) change the model
    return all(not tensor.any() for name, tensor in weights.items() if "lora_B" in name)
