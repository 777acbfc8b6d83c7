"""In bf16 without a GPU, decode steps attend through our own two matmuls instead of SDPA's
CPU kernel (:func:`trace_plugin.attention.decode_attention`): the same attention, in
float32 the same logits to float rounding and the same greedy tokens, padding and all."""

from __future__ import annotations

import pytest

from trace_plugin.attention import DECODE_ATTENTION, register_decode_attention
from trace_plugin.environments.retail import TEST_SEEDS, RetailEnv
from trace_plugin.generation import generate_batch
from trace_plugin.model_files import load_model, resolve_model

pytestmark = pytest.mark.slow


def test_decode_steps_attend_as_sdpa_does_across_a_left_padded_batch():
    import torch

    model, tokenizer = load_model(resolve_model(), precision="float32")
    model.set_attn_implementation(register_decode_attention())
    env = RetailEnv()
    prompts = [
        tokenizer.apply_chat_template(
            env.opening(s), tools=env.tools, tokenize=False, add_generation_prompt=True
        )
        for s in TEST_SEEDS[:3]
    ]
    prompts.append("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")  # short: padded far left
    rows = tokenizer(prompts, add_special_tokens=False).input_ids
    assert max(map(len, rows)) - min(map(len, rows)) > 300

    def greedy() -> tuple:
        with torch.inference_mode():
            out, width, _ = generate_batch(
                model,
                rows,
                tokenizer.pad_token_id,
                max_new_tokens=16,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                return_dict_in_generate=True,
                output_logits=True,
            )
        return out.sequences[:, width:], torch.stack(out.logits)

    ours, our_logits = greedy()
    model.set_attn_implementation("sdpa")
    theirs, their_logits = greedy()
    assert torch.equal(ours, theirs)
    error = (our_logits - their_logits).abs().max()
    assert error < 1e-3  # measured: 3e-5; a wrong mask moves them by whole units


def test_load_model_attends_through_it_in_bf16_on_a_cpu_and_through_sdpa_in_float32():
    """Ours won in bf16 (SDPA's CPU kernel is slow there for one query) and lost in float32."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU, transformers' default attention is used")
    bf16, _ = load_model(resolve_model(), precision="bfloat16")
    float32, _ = load_model(resolve_model(), precision="float32")
    assert bf16.config._attn_implementation == DECODE_ATTENTION
    assert float32.config._attn_implementation == "sdpa"
