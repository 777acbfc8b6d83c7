"""Executors: experts trained in this process, or in parallel on a (local) Ray cluster."""

from __future__ import annotations

import pytest

from trace_plugin.adapter_files import file_sha256
from trace_plugin.environments.retail import POLICY, TOOLS
from trace_plugin.environments.synthesis import synthesize
from training.config import ExpertTrainingConfig
from training.executors import LocalExecutor, RayExecutor, TrainingJob

pytestmark = pytest.mark.slow

TINY = {
    "num_generations": 2,
    "rollout_budget": 2,
    "max_completion_length": 8,
    "max_turns": 1,
    "warm_start_plays": 0,
}


def jobs(tmp_path, capabilities):
    out = []
    for capability in capabilities:
        spec = synthesize(capability, TOOLS, system_prompt=POLICY)
        config = ExpertTrainingConfig.preset("cpu-small", output_dir=str(tmp_path / capability), **TINY)
        out.append(
            TrainingJob(
                spec.model_dump(mode="json", by_alias=True), list(range(8)), config.to_dict(), progress=False
            )
        )
    return out


def test_ray_trains_experts_in_parallel_slots(tmp_path):
    import ray

    requested = jobs(tmp_path, ["tool_call_format", "argument_grounding"])
    try:
        results = RayExecutor(num_cpus=1).run(requested)
        assert ray.cluster_resources().get("CPU", 0) >= 1
    finally:
        ray.shutdown()
    assert [r.adapter_dir.name for r in results] == ["tool_call_format", "argument_grounding"]
    for result in results:
        assert result.steps == 1 and len(result.reward_curve) == 1
        assert file_sha256(result.adapter_dir / "adapter_model.safetensors") == result.adapter_sha256


def test_local_executor_runs_a_job(tmp_path):
    [result] = LocalExecutor().run(jobs(tmp_path, ["tool_call_format"]))
    assert (
        result.adapter_dir == tmp_path / "tool_call_format" and (result.adapter_dir / "expert.json").is_file()
    )
