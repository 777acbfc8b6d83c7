"""bfloat16 serving against float32, on the support agent's real prompts.

Greedy tokens need not agree everywhere (a near-tie can flip), so the agreement is
reported, not asserted; what is asserted is the accuracy that decides both greedy choices
and training: the float32 greedy tokens' log-probabilities under the bf16 model stay
within 0.05 nats per token of float32's (measured here: 0.01 to 0.03).
"""

from __future__ import annotations

import pytest

from trace_plugin.chat_template import REPLY_FORBIDDEN
from trace_plugin.environments.retail import TEST_SEEDS, TOOLS, RetailEnv
from trace_plugin.gateway.backend import SamplingParams
from trace_plugin.generation import common_length
from trace_plugin.model_files import bf16_supported, torch_dtype

pytestmark = pytest.mark.slow
TOLERANCE = 0.05  # nats per token


@pytest.fixture(scope="module")
def bf16_backend():
    if not bf16_supported():
        pytest.skip("this machine has no native bfloat16")
    from trace_plugin.gateway.embedded import EmbeddedBackend

    return EmbeddedBackend(max_batch=8, precision="bfloat16")


def retail_prompts(backend, n: int) -> list[str]:
    return [backend.render(RetailEnv().opening(seed), TOOLS) for seed in list(TEST_SEEDS)[:n]]


def token_logprobs(model, prompt_ids: list[int], completion: list[int]) -> list[float]:
    """Each completion token's log-probability under ``model``, given what came before it."""
    import torch

    ids = torch.tensor([prompt_ids + completion])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_precision_names_map_to_dtypes():
    import torch

    assert torch_dtype("float32") is torch.float32 and torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype("auto") is (torch.bfloat16 if bf16_supported() else torch.float32)
    with pytest.raises(ValueError, match="precision"):
        torch_dtype("float16")  # type: ignore[arg-type]


def test_bf16_greedy_tokens_track_float32(embedded_backend, bf16_backend, capsys):
    import torch

    assert bf16_backend.model.dtype is torch.bfloat16
    prompts = retail_prompts(embedded_backend, 4)
    params = SamplingParams(max_tokens=24, temperature=0.0, bad_words=REPLY_FORBIDDEN)
    full = embedded_backend.generate_rows(prompts, [None] * len(prompts), params)
    half = bf16_backend.generate_rows(prompts, [None] * len(prompts), params)
    agreed = sum(common_length(f.token_ids, h.token_ids) for f, h in zip(full, half, strict=True))
    total = sum(len(f.token_ids) for f in full)
    differences = []
    for completion in full:
        reference = token_logprobs(embedded_backend.model, completion.prompt_token_ids, completion.token_ids)
        under_bf16 = token_logprobs(bf16_backend.model, completion.prompt_token_ids, completion.token_ids)
        differences += [abs(a - b) for a, b in zip(reference, under_bf16, strict=True)]
    mean = sum(differences) / len(differences)
    with capsys.disabled():
        print(
            f"\nbf16 vs float32: {agreed}/{total} greedy tokens agree before the first divergence; "
            f"mean |Δ log p| {mean:.4f} nats/token"
        )
    assert mean <= TOLERANCE
