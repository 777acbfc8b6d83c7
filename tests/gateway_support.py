"""Helpers for the gateway tests: real LoRA adapters made on the spot."""

from __future__ import annotations

from pathlib import Path


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A randomly initialised rank-``rank`` LoRA on every linear layer, saved with PEFT.

    Random (not zero) initialisation makes its outputs differ visibly from the base model.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    from trace_plugin.model_files import load_model

    base, _ = load_model(model_dir)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to change greedy decoding
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20)
    model.save_pretrained(out)
    return out
