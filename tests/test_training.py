"""Expert training: episodes rendered as the gateway renders them, hints, dynamic sampling,
and real GRPO runs of SmolLM2 that produce adapters only when complete."""

from __future__ import annotations

import dataclasses
import json
import math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from envs import EchoEnv, ScoredEchoEnv
from rich.console import Console
from transformers import AutoTokenizer, TrainerCallback

from trace_plugin.adapter_files import WEIGHTS, file_sha256
from trace_plugin.chat_template import render
from trace_plugin.environments.base import RewardBreakdown, Task
from trace_plugin.environments.retail import TRAIN_SEEDS, RetailEnv
from trace_plugin.generation import TemperatureSampler, folded, shared_prefix_length
from trace_plugin.model_files import prepare_tokenizer, resolve_model
from training import experts
from training.config import ExpertTrainingConfig
from training.episodes import EpisodePlayer, hf_generate
from training.experts import (
    ExpertResult,
    ExpertTrainer,
    RolloutFunction,
    evaluate,
    weights_sha256,
)
from training.lora import is_noop, random_adapter


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True))


def scripted(tokenizer: Any, reply: Any) -> Any:
    """A generation backend answering ``reply(prompt_text) -> text`` (EOS added unless cut)."""
    seen: list[str] = []

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        out = []
        for ids in prompts:
            text = tokenizer.decode(ids)
            seen.append(text)
            answer = reply(text)
            tail = [] if answer.endswith("…") else [tokenizer.eos_token_id]
            out.append(tokenizer(answer, add_special_tokens=False)["input_ids"] + tail)
        return out

    generate.seen = seen  # type: ignore[attr-defined]
    return generate


def echo_call(number: str) -> str:
    return f'<tool_call>\n{{"name": "echo", "arguments": {{"text": "{number}"}}}}\n</tool_call>'


def echo_policy(text: str) -> str:
    """Echo the number from the ticket, then say it."""
    if "<tool_response>" in text:
        return "Your number " + text.split("My number is ")[1].split(".")[0] + " is echoed."
    return echo_call(text.split("My number is ")[1].split(".")[0])


def test_episodes_are_the_tokens_the_gateway_would_render(tokenizer):
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=4, max_observation_chars=100)
    generate = scripted(tokenizer, echo_policy)
    [episode] = player.play([7], [None], generate)

    assert episode.reward == 1.0 and episode.turns == 2 and episode.answer == "Your number 7 is echoed."
    conversation = [
        {"role": "system", "content": EchoEnv.system_prompt},
        {"role": "user", "content": "My number is 7."},
    ]
    assert tokenizer.decode(episode.prompt_ids) == render(tokenizer, conversation, EchoEnv.tools)
    conversation += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "echo", "arguments": '{"text": "7"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": '{"echo": "7"}'},
    ]
    # The second turn was generated from exactly the gateway's rendering of the conversation so far.
    assert generate.seen[1] == render(tokenizer, conversation, EchoEnv.tools)
    assert tokenizer.decode(episode.prompt_ids + episode.completion_ids) == (
        render(tokenizer, conversation, EchoEnv.tools) + "Your number 7 is echoed.<|im_end|>"
    )
    # Only the tool-result block is kept out of the loss.
    masked = [t for t, m in zip(episode.completion_ids, episode.env_mask, strict=True) if m == 0]
    block = '\n<|im_start|>user\n<tool_response>\n{"echo": "7"}\n</tool_response><|im_end|>\n'
    assert tokenizer.decode(masked) == block + "<|im_start|>assistant\n"
    assert len(episode.env_mask) == len(episode.completion_ids)


def test_a_task_offering_its_own_tools_is_played_with_exactly_those(tokenizer):
    from support.schemas import TOOLS

    from trace_plugin.environments.interpreter import SpecEnv
    from trace_plugin.environments.synthesis import synthesize

    spec = synthesize("tool_selection", TOOLS, system_prompt="Help.")
    seed = next(s for s in range(50) if len(SpecEnv(spec).reset(s).tools or ()) < len(TOOLS))
    task = SpecEnv(spec).reset(seed)
    player = EpisodePlayer(tokenizer, lambda: SpecEnv(spec), max_turns=1, max_observation_chars=100)
    [episode] = player.play([seed], [None], scripted(tokenizer, lambda _: "No."))
    conversation = [{"role": "system", "content": "Help."}, {"role": "user", "content": task.prompt}]
    assert tokenizer.decode(episode.prompt_ids) == render(tokenizer, conversation, task.tools)
    every_tool = [t.schema_ for t in spec.tools]
    assert render(tokenizer, conversation, task.tools) != render(tokenizer, conversation, every_tool)


def test_hinted_rollouts_generate_with_the_hint_but_keep_the_plain_prompt(tokenizer):
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    generate = scripted(tokenizer, echo_policy)
    plain, hinted = player.play([3, 3], [None, "Echo 3 first."], generate)

    assert hinted.hinted and not plain.hinted
    assert hinted.prompt_ids == plain.prompt_ids
    assert "Hint: Echo 3 first." not in tokenizer.decode(hinted.prompt_ids)
    assert [("Hint: Echo 3 first." in text) for text in generate.seen] == [False, True, False, True]


def test_a_worked_example_hint_is_shown_before_the_ticket_for_generation_only(tokenizer):
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    generate = scripted(tokenizer, echo_policy)
    example = [
        {"role": "user", "content": "Echo 9."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "h", "type": "function", "function": {"name": "echo", "arguments": '{"text": "9"}'}}
            ],
        },
    ]
    plain, hinted = player.play([3, 3], [None, example], generate)
    assert hinted.prompt_ids == plain.prompt_ids and "Echo 9." not in tokenizer.decode(plain.prompt_ids)
    first_hinted = generate.seen[1]
    assert first_hinted.index("Echo 9.") < first_hinted.index('{"name": "echo", "arguments": {"text": "9"}}')
    assert first_hinted.rindex("Echo 9.") < first_hinted.rindex(
        EchoEnv().reset(3).prompt
    )  # before the ticket


def test_turn_limit_truncation_and_long_observations(tokenizer):
    calls = scripted(tokenizer, lambda text: echo_call("9" * 50))
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=2, max_observation_chars=20)
    [episode] = player.play([9], [None], calls)
    # Out of turns after a tool call: no final message, and no tool block left dangling at the end.
    assert episode.turns == 2 and episode.answer == "" and episode.reward == 0.0
    assert episode.env_mask[-1] == 1
    observation = tokenizer.decode(
        [t for t, m in zip(episode.completion_ids, episode.env_mask, strict=True) if not m]
    )
    assert '{"echo": "9999999999…' in observation and "9" * 30 not in observation

    cut = scripted(tokenizer, lambda text: echo_call("5")[:20] + "…")
    [episode] = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=20).play(
        [5], [None], cut
    )
    assert episode.turns == 1 and episode.answer.startswith("<tool_call>")  # a cut-off call is not run


def test_rollouts_resample_flat_groups_then_drop_them(tokenizer):
    config = ExpertTrainingConfig(num_generations=2, rollout_budget=4, hint_fraction=0.5, resample_rounds=1)
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    # Only hinted rollouts solve a task, and only tasks with an even number get a hint.
    policy = scripted(
        tokenizer, lambda text: echo_policy(text) if "Hint:" in text or "<tool_response>" in text else "No."
    )
    hint = lambda task: "Echo it." if task.seed % 2 == 0 else None  # noqa: E731
    rollouts = RolloutFunction(
        config, player, seeds=[1, 2, 3, 5, 7], hint=hint, generate=lambda trainer: nullcontext(policy)
    )
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0, log_history=[]))

    out = rollouts([json.dumps({"seed": 2})] * 2 + [json.dumps({"seed": 1})] * 2, trainer)
    # Seed 2 has signal (hinted 1, plain 0); seed 1 is flat, replayed on an odd seed, still flat, dropped.
    assert out["env_reward"] == [1.0, 0.0, 0.0, 0.0]
    assert 1 in out["env_mask"][0]
    # The dropped group comes back as stubs that weigh nothing in the loss and cost no compute.
    assert out["env_mask"][2:] == [[0], [0]] and out["completion_ids"][2:] == [[tokenizer.eos_token_id]] * 2
    assert [len(ids) for ids in out["prompt_ids"][2:]] == [1, 1]
    assert out["logprobs"] is None and len(out["prompt_ids"]) == len(out["completion_ids"]) == 4
    logged: dict[str, float] = {}
    rewards = rollouts.env_reward([""] * 4, out["env_reward"], log_metric=logged.__setitem__)
    assert rewards == out["env_reward"]
    assert logged["dynamic_sampling/zero_signal_groups"] == 1
    assert logged["dynamic_sampling/resampled_groups"] == 1
    assert logged["dynamic_sampling/dropped_groups"] == 1
    assert logged["episodes/hinted_fraction"] == 0.25 and logged["episodes/unhinted_reward"] == 0.0
    # Two groups offered, three played: the resampled group was spent too.
    assert logged["rollouts/offered"] == 4 and logged["rollouts/spent"] == 6
    assert logged["dynamic_sampling/informative_groups"] == 0.5
    assert logged["dynamic_sampling/unhinted_informative_groups"] == 0.0  # only the hint made seed 2's signal


def test_each_checks_mean_is_logged_so_a_step_says_which_holds_success_down(tokenizer):
    """The quick demo's expert scored 0.75 un-hinted at every step and succeeded in none;
    nothing said which check it missed. Each check's mean over the policy's rollouts is
    logged, and the step line names the weakest."""
    config = ExpertTrainingConfig(num_generations=2, groups_per_step=1, rollout_budget=8, resample_rounds=0)
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    mute = scripted(tokenizer, lambda text: "Done." if "<tool_response>" in text else echo_policy(text))
    rollouts = RolloutFunction(config, player, [1, 2, 3], None, lambda trainer: nullcontext(mute))
    step = SimpleNamespace(state=SimpleNamespace(global_step=0, log_history=[], max_steps=4))
    out = rollouts([json.dumps({"seed": 2})] * 2, step)
    logged: dict[str, float] = {}
    rollouts.env_reward([""] * 2, out["env_reward"], log_metric=logged.__setitem__)
    assert (
        logged["checks/echoed"] == 1.0 and logged["checks/said"] == 0.0 and logged["episodes/success"] == 0.0
    )
    console = Console(record=True, width=400)
    bar = experts._ProgressBar(console)
    bar.on_log(None, SimpleNamespace(global_step=1, max_steps=4), None, logs={"reward": 0.0, **logged})
    assert "weakest check said 0.00" in console.export_text()


class LevelOneEcho(EchoEnv):
    """EchoEnv's next level: the ticket says which level it is."""

    def reset(self, seed: int):
        task = super().reset(seed)
        return type(task)(seed, f"Level one. {task.prompt}", task.kind, task.metadata)


def test_grpo_moves_a_level_by_a_window_of_steps_up_when_mastered_down_when_out_of_reach(tokenizer):
    """After the warm start every group scored 1.00 and was dropped: nothing kept the expert
    in band. As RLVE's adaptive environments do, two steps at 0.9 success move GRPO up a
    level, before its groups go flat; and, as TRACE's band has a floor, two under 0.2 move
    it back down (the headline's experts climbed once, then logged success 0.00 for 18 and
    20 steps). The window is the last steps in a row at the level, and the level is a
    function of the logs (a resume agrees)."""
    config = ExpertTrainingConfig(num_generations=2, groups_per_step=1, rollout_budget=8)
    logged = lambda level, success: {"curriculum/level": level, "episodes/success": success}  # noqa: E731
    assert config.level([], start=0, top=1) == 0
    assert config.level([logged(0, 1.0)], 0, 1) == 0  # one step is no window
    assert config.level([logged(0, 1.0), logged(0, 0.75)], 0, 1) == 0  # 0.875 < 0.9
    assert config.level([logged(0, 0.5), logged(0, 1.0), logged(0, 1.0)], 0, 1) == 1
    assert (
        config.level([logged(0, 1.0), logged(0, 1.0), logged(1, 1.0), logged(1, 1.0)], 0, 1) == 1
    )  # the top
    climbed = [logged(0, 1.0), logged(0, 1.0)]
    assert config.level([*climbed, logged(1, 0.0)], 0, 2) == 1  # one step is no window
    assert config.level([*climbed, logged(1, 0.5), logged(1, 0.0)], 0, 2) == 1  # 0.25: in band
    assert config.level([*climbed, logged(1, 0.25), logged(1, 0.0)], 0, 2) == 0  # 0.125: down
    assert config.level([*climbed, logged(1, 0.0), logged(1, 0.0)], 0, 2) == 0  # down again
    # Never below where it started: the levels under the calibrated one narrow the tickets.
    assert config.level([logged(1, 0.0), logged(1, 0.0)], 1, 2) == 1
    assert config.level([logged(1, 1.0), logged(1, 1.0), logged(2, 0.0), logged(2, 0.0)], 1, 2) == 1
    # A warm-started policy starts where requests are asked plainly, above the calibrated
    # level, and may step down as far as that level, never below it.
    assert config.level([], 3, 4, floor=1) == 3
    assert config.level([logged(3, 0.0), logged(3, 0.0)], 3, 4, floor=1) == 2
    assert config.level([logged(1, 0.0), logged(1, 0.0)], 3, 4, floor=1) == 1
    # Back at level 0 the steps before the climb are no window: only new ones count.
    assert config.level([*climbed, logged(1, 0.0), logged(1, 0.0), logged(0, 1.0)], 0, 2) == 0
    assert config.level([*climbed, logged(1, 0.0), logged(1, 0.0), logged(0, 1.0), logged(0, 1.0)], 0, 2) == 1
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    policy = scripted(tokenizer, half_solved())  # in band: no step is all-success, so no climb within one
    rollouts = RolloutFunction(
        config, player, [1, 2, 3], None, lambda trainer: nullcontext(policy), levels=[EchoEnv, LevelOneEcho]
    )
    stats: dict[str, float] = {}
    for history, level in (([], 0), ([logged(0, 1.0), logged(0, 1.0)], 1)):
        policy.seen.clear()
        step = SimpleNamespace(state=SimpleNamespace(global_step=len(history), log_history=history))
        out = rollouts([json.dumps({"seed": 2})] * 2, step)
        rollouts.env_reward([""] * 2, out["env_reward"], log_metric=stats.__setitem__)
        assert stats["curriculum/level"] == level and ("Level one." in policy.seen[0]) == (level == 1)
        assert stats["curriculum/climbed_groups"] == 0


def half_solved(from_marker: str = "") -> Any:
    """A policy that solves every ticket until one contains ``from_marker`` (any, when
    empty); from there it echoes every other ticket (a group of two: one success, one failure)."""
    count = iter(range(10**6))

    def reply(text: str) -> str:
        if "<tool_response>" in text or from_marker not in text:
            return echo_policy(text)
        return echo_policy(text) if next(count) % 2 == 0 else "No."

    return reply


class LevelTwoEcho(EchoEnv):
    def reset(self, seed: int):
        task = super().reset(seed)
        return type(task)(seed, f"Level two. {task.prompt}", task.kind, task.metadata)


def test_a_mastered_level_is_played_again_a_level_up_within_the_first_step(tokenizer):
    """TRACE's band allows at most 20% all-success groups. A first step whose group all succeeded
    is played again a level up, and again, until it is in band or at the top: the first
    step finds where the warm-started expert is in band, and no step is spent flat below
    the top. The replays are rollouts spent, and the level reached is logged (resumes agree)."""
    config = ExpertTrainingConfig(num_generations=2, groups_per_step=1, rollout_budget=8)
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    ladder = [EchoEnv, LevelOneEcho, LevelTwoEcho]
    cases = (
        (echo_policy, 2, 2),  # masters every level: climbs to the top, flat there, dropped
        (half_solved("Level two."), 2, 2),  # in band at level two
        (half_solved("Level one."), 1, 1),
        (half_solved(), 0, 0),  # in band where it starts
    )
    for policy_fn, level, climbed in cases:
        policy = scripted(tokenizer, policy_fn)
        rollouts = RolloutFunction(
            config, player, [1, 2, 3], None, lambda t, p=policy: nullcontext(p), levels=ladder
        )
        step = SimpleNamespace(state=SimpleNamespace(global_step=0, log_history=[]))
        out = rollouts([json.dumps({"seed": 2})] * 2, step)
        stats: dict[str, float] = {}
        rollouts.env_reward([""] * 2, out["env_reward"], log_metric=stats.__setitem__)
        assert stats["curriculum/level"] == level and stats["curriculum/climbed_groups"] == climbed
        flat = policy_fn is echo_policy
        assert stats["dynamic_sampling/dropped_groups"] == flat
        # Offered one group; spent it, its replays a level up, and (flat) its resample.
        assert stats["rollouts/offered"] == 2 and stats["rollouts/spent"] == 2 * (1 + climbed + flat)
        assert ("Level two." in policy.seen[-1]) == (level == 2)
    # Plain rollouts that all succeed master a level, whatever hinted ones beside them did
    # (the headline's first expert: un-hinted 1.00, hinted worse, no climb).
    confused = scripted(tokenizer, lambda text: "No." if "Hint:" in text else echo_policy(text))
    hinted = ExpertTrainingConfig(num_generations=2, groups_per_step=1, rollout_budget=8, hint_fraction=0.5)
    rollouts = RolloutFunction(
        hinted, player, [1, 2, 3], "Echo it.", lambda t: nullcontext(confused), levels=ladder
    )
    out = rollouts(
        [json.dumps({"seed": 2})] * 2, SimpleNamespace(state=SimpleNamespace(global_step=0, log_history=[]))
    )
    stats = {}
    rollouts.env_reward([""] * 2, out["env_reward"], log_metric=stats.__setitem__)
    assert stats["curriculum/level"] == 2 and stats["curriculum/climbed_groups"] == 2
    # Only the first step climbs within itself: later, one all-success group of a step is too
    # little to climb on, and the window decides (the headline's write_completion climbed so
    # at its third step, on one group, and then succeeded in none of 18 steps).
    rollouts = RolloutFunction(
        config,
        player,
        [1, 2, 3],
        None,
        lambda t: nullcontext(scripted(tokenizer, echo_policy)),
        levels=ladder,
    )
    later = [{"curriculum/level": 0, "episodes/success": 0.5}]
    out = rollouts(
        [json.dumps({"seed": 2})] * 2,
        SimpleNamespace(state=SimpleNamespace(global_step=1, log_history=later)),
    )
    rollouts.env_reward([""] * 2, out["env_reward"], log_metric=stats.__setitem__)
    assert stats["curriculum/level"] == 0 and stats["curriculum/climbed_groups"] == 0


def test_resampling_stays_within_the_spend_limit(tokenizer):
    """With 6 rollouts already spent of a limit of 10, a step of two groups of two may replay none."""
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    policy = scripted(tokenizer, lambda text: "No.")  # every group flat
    logged: dict[str, float] = {}
    for limit, replayed in ((10, 0), (12, 1), (None, 2)):
        config = ExpertTrainingConfig(
            num_generations=2, groups_per_step=2, rollout_budget=8, resample_rounds=1, spend_limit=limit
        )
        rollouts = RolloutFunction(
            config, player, [1, 2, 3, 4, 5, 6], None, lambda trainer: nullcontext(policy)
        )
        step = SimpleNamespace(state=SimpleNamespace(global_step=1, log_history=[{"rollouts/spent": 6.0}]))
        out = rollouts([json.dumps({"seed": s}) for s in (1, 1, 2, 2)], step)
        rollouts.env_reward([""] * 4, out["env_reward"], log_metric=logged.__setitem__)
        assert logged["dynamic_sampling/resampled_groups"] == replayed
        assert logged["rollouts/spent"] == 4 + 2 * replayed


def test_grpo_stops_after_a_window_of_flat_steps_or_at_its_spend_limit():
    config = ExpertTrainingConfig(num_generations=2, groups_per_step=2, rollout_budget=40, flat_stop_steps=2)
    flat = {"rollouts/spent": 4.0, "dynamic_sampling/dropped_groups": 2.0}
    taught = {"rollouts/spent": 6.0, "dynamic_sampling/dropped_groups": 1.0}
    assert config.stop_reason([]) is None
    assert config.stop_reason([taught, flat]) is None  # one flat step is not a window
    assert config.stop_reason([taught, flat, {"loss": 0.1}, flat]) == "flat"  # other log lines don't count
    assert config.stop_reason([flat, taught]) is None
    assert dataclasses.replace(config, flat_stop_steps=0).stop_reason([flat] * 9) is None
    limited = dataclasses.replace(config, spend_limit=16)
    assert limited.stop_reason([taught, taught]) is None  # 12 spent: a step of 4 still fits in 16
    assert limited.stop_reason([taught, taught, taught]) == "spent"
    assert dataclasses.replace(config, spend_limit=15).stop_reason([taught, taught]) == "spent"
    with pytest.raises(ValueError, match="spend_limit"):
        dataclasses.replace(config, spend_limit=3)


class ReferencedEchoEnv(EchoEnv):
    """EchoEnv whose tasks carry their reference solution, as synthesized ones do."""

    def reset(self, seed: int) -> Task:
        task = super().reset(seed)
        reference = [{"name": "echo", "arguments": {"text": str(seed)}}]
        return dataclasses.replace(
            task, metadata={**task.metadata, "reference": reference, "facts": [str(seed)]}
        )


def test_a_flat_group_of_failures_gets_a_demonstration_that_no_statistic_counts(tokenizer):
    config = ExpertTrainingConfig(num_generations=2, rollout_budget=4, resample_rounds=0)
    player = EpisodePlayer(tokenizer, ReferencedEchoEnv, max_turns=3, max_observation_chars=100)
    policy = scripted(tokenizer, lambda text: "No.")  # never solves anything
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0, log_history=[]))
    logged: dict[str, float] = {}

    def step(config: ExpertTrainingConfig) -> dict[str, Any]:
        rollouts = RolloutFunction(config, player, [1, 2], None, lambda trainer: nullcontext(policy))
        out = rollouts([json.dumps({"seed": 1})] * 2, trainer)
        logged.clear()
        rollouts.env_reward([""] * 2, out["env_reward"], log_metric=logged.__setitem__)
        return out

    out = step(config)
    demonstration = player.reference(1)
    assert demonstration is not None and out["env_reward"] == [0.0, 1.0]
    assert (
        out["completion_ids"][1] == demonstration.completion_ids
        and out["env_mask"][1] == demonstration.env_mask
    )
    assert logged["dynamic_sampling/demonstrations"] == 1 and logged["dynamic_sampling/dropped_groups"] == 0
    # What the policy did, alone: the demonstration is in no success or reward statistic.
    assert (
        logged["episodes/success"] == logged["episodes/reward"] == logged["episodes/unhinted_reward"] == 0.0
    )
    assert logged["episodes/turns"] == 1
    # Without demonstrations the group teaches nothing and is dropped.
    out = step(dataclasses.replace(config, demonstrate=False))
    assert out["env_reward"] == [0.0, 0.0] and logged["dynamic_sampling/dropped_groups"] == 1


def test_resampling_finds_signal_on_a_fresh_seed(tokenizer):
    config = ExpertTrainingConfig(num_generations=2, rollout_budget=4, hint_fraction=0.5, resample_rounds=3)
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    policy = scripted(
        tokenizer, lambda text: echo_policy(text) if "Hint:" in text or "<tool_response>" in text else "No."
    )
    hint = lambda task: "Echo it." if task.seed == 4 else None  # noqa: E731
    rollouts = RolloutFunction(
        config, player, seeds=[1, 4], hint=hint, generate=lambda trainer: nullcontext(policy)
    )
    out = rollouts(
        [json.dumps({"seed": 1})] * 2, SimpleNamespace(state=SimpleNamespace(global_step=5, log_history=[]))
    )
    assert out["env_reward"] == [1.0, 0.0] and 1 in out["env_mask"][0]
    assert "My number is 4." in tokenizer.decode(out["prompt_ids"][0])


def test_a_steps_groups_play_in_one_batch(tokenizer):
    config = ExpertTrainingConfig(num_generations=2, groups_per_step=3, rollout_budget=6, hint_fraction=0.5)
    player = EpisodePlayer(tokenizer, EchoEnv, max_turns=3, max_observation_chars=100)
    # Only the hinted rollout of each group solves its task: every group has signal.
    policy = scripted(
        tokenizer, lambda text: echo_policy(text) if "Hint:" in text or "<tool_response>" in text else "No."
    )
    batches: list[int] = []

    def counted(prompts: list[list[int]]) -> list[list[int]]:
        batches.append(len(prompts))
        return policy(prompts)

    rollouts = RolloutFunction(
        config, player, seeds=[1, 2, 3], hint="Echo it.", generate=lambda trainer: nullcontext(counted)
    )
    seeds = [1, 1, 2, 2, 3, 3]  # as TRL hands them over: each group's prompt num_generations times
    step = SimpleNamespace(state=SimpleNamespace(global_step=0, log_history=[]))
    out = rollouts([json.dumps({"seed": s}) for s in seeds], step)
    # One generate call per turn for all three groups: six calls or answers, then the three hinted answers.
    assert batches == [6, 3]
    assert out["env_reward"] == [1.0, 0.0] * 3
    for seed, prompt in zip(seeds, out["prompt_ids"], strict=True):  # each rollout stays in its group
        assert f"My number is {seed}." in tokenizer.decode(prompt)


def test_presets_build_the_right_grpo_configs(tmp_path):
    cpu = ExpertTrainingConfig.preset("cpu-small", output_dir=str(tmp_path / "e"))
    args = cpu.grpo_config(tmp_path / "work")
    assert cpu.steps == 50 and args.max_steps == 50
    assert (args.num_generations, args.per_device_train_batch_size, args.gradient_accumulation_steps) == (
        4,
        4,
        1,
    )
    assert args.beta == 0.0 and not args.use_vllm and not args.gradient_checkpointing
    assert cpu.precision == "auto" and not args.bf16  # bf16 weights where supported, never autocast
    assert args.learning_rate == 3e-4 and args.save_steps == 10 and args.logging_steps == 1

    gpu = ExpertTrainingConfig.preset("gpu")
    assert gpu.backend == "vllm" and gpu.steps == 200
    lora = gpu.lora_config()
    assert (lora.r, lora.lora_alpha, lora.target_modules) == (16, 32, "all-linear")
    gpu_args = gpu.grpo_kwargs(tmp_path / "work")
    assert gpu.precision == "bfloat16" and not gpu_args["bf16"]
    assert gpu_args["use_vllm"] and gpu_args["vllm_mode"] == "colocate"
    assert gpu_args["activation_checkpointing"] and not gpu_args["vllm_importance_sampling_correction"]
    assert gpu_args["per_device_train_batch_size"] * gpu_args["gradient_accumulation_steps"] == 64

    assert ExpertTrainingConfig.preset("cpu-small", rollout_budget=8, num_generations=2).steps == 4
    with pytest.raises(ValueError, match="unknown preset"):
        ExpertTrainingConfig.preset("tpu")
    with pytest.raises(ValueError, match="less than one step"):
        ExpertTrainingConfig(rollout_budget=3)
    with pytest.raises(ValueError, match="at least 2"):
        ExpertTrainingConfig(num_generations=1)
    with pytest.raises(ValueError, match="precision"):
        ExpertTrainingConfig(precision="float16")
    with pytest.raises(ValueError, match="snapshot at 3 rollouts"):
        ExpertTrainingConfig(rollout_budget=8, num_generations=2, snapshots=(3,))


# -- real GRPO runs of SmolLM2 (tiny: 2 rollouts a step, a few tokens a turn) ---------------------------

TINY = {
    "num_generations": 2,
    "rollout_budget": 4,  # two steps
    "max_completion_length": 8,
    "max_turns": 1,
    "resample_rounds": 0,
    "checkpoint_every": 1,
    "warm_start_plays": 0,  # GRPO alone here; tests/test_warm_start.py covers the warm start
}
RETAIL_SEEDS = list(TRAIN_SEEDS)[:8]


class Interrupted(Exception):
    """What a crash or Ctrl-C does to a run: it stops wherever it is."""


class InterruptAfterCheckpoint(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise Interrupted


@pytest.fixture(scope="module")
def retail_expert(tmp_path_factory):
    """A run interrupted after its first checkpoint, then re-run to completion."""
    final = tmp_path_factory.mktemp("experts") / "retail-expert"
    config = ExpertTrainingConfig(output_dir=str(final), snapshots=(2,), **TINY)  # kept after step 1
    with pytest.raises(Interrupted):
        ExpertTrainer(config, RetailEnv, RETAIL_SEEDS, callbacks=[InterruptAfterCheckpoint(1)]).train()
    after_crash = {
        "final_exists": final.exists(),
        "checkpoints": sorted(p.name for p in final.parent.glob(f".{final.name}.partial/checkpoint-*")),
    }
    return config, after_crash, ExpertTrainer(config, RetailEnv, RETAIL_SEEDS, progress=False).train()


@pytest.mark.slow
def test_tiny_run_produces_a_loadable_adapter_with_its_hash(retail_expert):
    from peft import PeftModel

    from trace_plugin.model_files import load_model

    config, _, result = retail_expert
    assert result.adapter_dir == Path(config.output_dir) and result.steps == 2
    assert len(result.reward_curve) == 2 and all(0.0 <= r <= 1.0 for r in result.reward_curve)
    assert [log["step"] for log in result.logs] == [1.0, 2.0]
    unhinted = [log["episodes/unhinted_reward"] for log in result.logs]  # NaN: a step without one
    assert result.unhinted_curve == [None if math.isnan(v) else v for v in unhinted]
    assert file_sha256(result.adapter_dir / WEIGHTS) == result.adapter_sha256
    assert result.base_model == resolve_model() and result.base_model_sha256 == weights_sha256(
        resolve_model()
    )
    assert result.config == config.to_dict()
    base, _ = load_model(result.base_model)
    model = PeftModel.from_pretrained(base, str(result.adapter_dir))
    assert model.peft_config["default"].r == config.lora_rank
    assert any("q_proj.lora_A" in name for name, _ in model.named_parameters())
    assert not list(result.adapter_dir.parent.glob(".*partial"))  # the work dir is gone
    # The snapshot after step 1, taken before the crash, survived the resumed run.
    assert result.snapshots == [2] and (result.snapshot(2) / WEIGHTS).is_file()
    assert PeftModel.from_pretrained(load_model(result.base_model)[0], str(result.snapshot(2))).peft_config
    with pytest.raises(KeyError):
        result.snapshot(4)


@pytest.mark.slow
def test_interrupted_run_leaves_no_adapter_and_a_rerun_resumes(retail_expert):
    config, after_crash, result = retail_expert
    assert after_crash == {"final_exists": False, "checkpoints": ["checkpoint-1"]}
    assert result.resumed_from_step == 1 and len(result.reward_curve) == 2
    # Once finished, a re-run returns the recorded expert instead of training again.
    again = ExpertTrainer(config, RetailEnv, RETAIL_SEEDS, progress=False).train()
    assert again == result
    other = dataclasses.replace(config, learning_rate=1e-5)
    with pytest.raises(FileExistsError, match="another config"):
        ExpertTrainer(other, RetailEnv, RETAIL_SEEDS, progress=False).train()


@pytest.mark.slow
def test_evaluate_plays_greedy_episodes_with_the_adapter(retail_expert):
    config, _, result = retail_expert
    seeds = [10_000, 10_001]
    scores = evaluate(None, result.adapter_dir, RetailEnv, seeds, config=config)
    assert sorted(scores.rewards) == seeds
    assert 0.0 <= scores.success_rate <= scores.mean_reward <= 1.0
    assert scores == evaluate(None, result.adapter_dir, RetailEnv, seeds, config=config)  # greedy: repeatable


@pytest.mark.slow
def test_rewards_with_signal_move_the_adapter(tmp_path):
    config = ExpertTrainingConfig(
        output_dir=str(tmp_path / "echo"), **{**TINY, "rollout_budget": 2, "hint_fraction": 0.5}
    )
    result = ExpertTrainer(config, ScoredEchoEnv, [1, 2, 3], hint="Echo the number.", progress=False).train()
    [log] = result.logs
    assert log["dynamic_sampling/zero_signal_groups"] == 0 and log["episodes/hinted_fraction"] == 0.5
    assert not is_noop(result.adapter_dir)  # a gradient reached the adapter


class FailingEchoEnv(EchoEnv):
    """No answer ever succeeds: every group is flat."""

    def reward(self, answer: str = "") -> RewardBreakdown:
        return RewardBreakdown(0.0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_grpo_stops_when_its_groups_stay_flat_and_a_resumed_run_stops_there_too(tmp_path):
    """Six steps offered; every group flat, so the run stops after two (the window) and saves
    there. Killed at that save, the re-run publishes that checkpoint instead of training on."""
    config = ExpertTrainingConfig(
        output_dir=str(tmp_path / "flat"),
        **{**TINY, "rollout_budget": 12, "flat_stop_steps": 2, "checkpoint_every": 10, "warm_start_plays": 0},
        snapshots=(2, 10),  # after steps 1 and 5: the run never reaches the second
    )
    with pytest.raises(Interrupted):
        ExpertTrainer(config, FailingEchoEnv, [1, 2, 3], callbacks=[InterruptAfterCheckpoint(2)]).train()
    result = ExpertTrainer(config, FailingEchoEnv, [1, 2, 3], progress=False).train()
    assert result.steps == 2 and result.stopped == "flat" and result.resumed_from_step == 2
    assert result.rollouts_spent == 4 and len(result.logs) == 2  # two steps of one group of two
    assert result.informative_group_frac == 0.0
    assert result.snapshots == [2] and result.spent_at(2) == 2  # the snapshots it kept, and what they cost
    assert ExpertResult.load(result.adapter_dir) == result


@pytest.mark.slow
def test_an_adapter_no_step_reached_is_the_base_model(tmp_path):
    from peft import LoraConfig, get_peft_model

    from trace_plugin.model_files import load_model

    base, _ = load_model(resolve_model())
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "fresh")
    assert is_noop(tmp_path / "fresh")
    assert not is_noop(random_adapter(resolve_model(), tmp_path / "random", seed=0, rank=2))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_folded_lora_computes_the_adapted_model_and_leaves_every_weight_as_it_was(tmp_path, precision):
    """Rollouts generate with each LoRA folded into a copy of its base weight; the copy must
    compute the adapted network, and leaving (even by an error) must restore the exact tensors."""
    import torch
    from peft import PeftModel

    from trace_plugin.model_files import load_model

    base, _ = load_model(resolve_model(), precision=precision)
    random_adapter(resolve_model(), tmp_path / "lora", seed=3, scale=4.0)
    model = PeftModel.from_pretrained(base, str(tmp_path / "lora")).eval()
    ids = torch.tensor([list(range(100, 164))])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        adapted = model(ids).logits.float()
        with model.disable_adapter():
            plain = model(ids).logits.float()
        with pytest.raises(RuntimeError, match="mid-rollout"), folded(model):
            inside = model(ids).logits.float()
            raise RuntimeError("mid-rollout")
        after = model(ids).logits.float()
    error, effect = (inside - adapted).abs(), (plain - adapted).abs().mean()
    if precision == "float32":
        assert error.max() < 1e-3
    else:  # W + BA rounded once to bf16: an error far below what the adapter itself changes
        assert error.mean() < effect / 50
    assert torch.equal(after, adapted)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_batch_shares_its_common_opening_but_each_row_keeps_a_token_to_run():
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5]], min_tokens=2) == 3
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3, 4]], min_tokens=2) == 2  # a whole row is never skipped
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 4]], min_tokens=2) == 3
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 9, 4]], min_tokens=3) == 0  # too short to pay


def test_the_temperature_sampler_draws_from_the_tempered_distribution_and_never_a_banned_token():
    """One uniform per row against the cumulative distribution: the frequencies of 40,000
    draws match softmax(logits / T) (a chi-square test far from its 1e-6 tail), a banned
    (-inf) token is never drawn, and the greedy step picks exactly the drawn token."""
    import torch

    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, float("-inf"), -1.0, 0.5])
    rows = logits.repeat(40_000, 1)
    out = TemperatureSampler(0.7)(None, rows)
    assert (torch.isfinite(out).sum(-1) == 1).all()
    drawn = out.argmax(-1)
    counts = torch.bincount(drawn, minlength=6).double()
    expected = torch.softmax(logits.double() / 0.7, -1) * len(rows)
    assert counts[3] == 0
    live = expected > 0
    chi2 = ((counts[live] - expected[live]) ** 2 / expected[live]).sum().item()
    assert chi2 < 35.0  # 5 degrees of freedom: P(chi2 > 35) is about 1.5e-6
    cold = torch.bincount(TemperatureSampler(0.05)(None, rows[:1000]).argmax(-1), minlength=6)
    assert cold[0] == 1000  # a cold temperature is (all but) greedy
    with pytest.raises(ValueError, match="positive"):
        TemperatureSampler(0.0)


@pytest.mark.slow
def test_generating_on_the_shared_prefix_changes_no_token(tmp_path, tokenizer):
    """Rollout generation runs a batch's common opening once: two tickets, a group of two
    each, and a second turn, through a LoRA as in training; greedy tokens are unchanged."""
    from peft import PeftModel

    from trace_plugin.model_files import load_model

    base, _ = load_model(resolve_model())
    # Mild, as in the prefix-cache test: float noise in the keys must not flip a greedy token.
    random_adapter(resolve_model(), tmp_path / "lora", seed=3, scale=4.0)
    model = PeftModel.from_pretrained(base, str(tmp_path / "lora")).eval()
    player = EpisodePlayer(tokenizer, RetailEnv, max_turns=2, max_observation_chars=800)
    tickets = [
        player._prompt_ids(RetailEnv(), RetailEnv.tools, RetailEnv().reset(seed).prompt)
        for seed in (10_000, 10_001)
    ]
    later = tokenizer(
        '<tool_call>\n{"name": "get_order", "arguments": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n'
        '<tool_response>\n"not found"\n</tool_response><|im_end|>\n<|im_start|>assistant\n',
        add_special_tokens=False,
    ).input_ids
    batches = [[tickets[0]] * 2, [tickets[0], tickets[0] + later, tickets[1], tickets[1]]]
    assert shared_prefix_length(batches[0]) == len(tickets[0]) - 1
    assert shared_prefix_length(batches[1]) > 300  # the policy and the tool schemas
    for prompts in batches:
        replies = [
            hf_generate(model, tokenizer, max_new_tokens=24, temperature=None, share_prefix=share)(prompts)
            for share in (False, True)
        ]
        assert replies[0] == replies[1]
    assert replies[0][0] != replies[0][1] and replies[0][1] != replies[0][2]  # the rows really differ


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_conversations_next_turn_runs_on_its_kept_keys_and_values_and_changes_no_token(tmp_path, tokenizer):
    """Rollouts keep each row's keys and values across turns (float32: bf16 with other
    batch shapes already changes tokens). The next turn's tokens equal a full recompute's,
    and so do its logits, though rows continue from kept prefixes of different lengths."""
    import torch
    from peft import PeftModel

    from trace_plugin.generation import generate_batch, row_layers, stacked
    from trace_plugin.model_files import load_model

    base, _ = load_model(resolve_model(), precision="float32")
    random_adapter(resolve_model(), tmp_path / "lora", seed=3, scale=4.0)
    model = PeftModel.from_pretrained(base, str(tmp_path / "lora")).eval()
    player = EpisodePlayer(tokenizer, RetailEnv, max_turns=2, max_observation_chars=800)
    tickets = [
        player._prompt_ids(RetailEnv(), RetailEnv.tools, RetailEnv().reset(seed).prompt)
        for seed in (10_000, 10_001, 10_002)
    ]
    results = ['"not found"', '{"order_id": "#W1", "status": "pending"}', '"ok"']

    def later(i: int) -> list[int]:
        return tokenizer(
            f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{results[i]}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n",
            add_special_tokens=False,
        ).input_ids

    kept = hf_generate(model, tokenizer, max_new_tokens=12, temperature=None)
    first = kept(tickets)
    second = [ticket + reply + later(i) for i, (ticket, reply) in enumerate(zip(tickets, first, strict=True))]
    assert kept(second) == hf_generate(
        model, tokenizer, max_new_tokens=12, temperature=None, keep_turns=False
    )(second)
    # Every row ran from its own kept turn: all of its previous prompt and reply but the last token.
    assert kept.reused == sum(len(t) + len(r) - 1 for t, r in zip(tickets, first, strict=True))
    assert len(set(map(len, first))) > 1 or len(set(map(len, tickets))) > 1  # the kept prefixes differ

    # The logits too, at the generation core: rows continuing from their kept keys and values
    # against the same rows run whole.
    def run(rows: list[list[int]], skip: Any = 0, cache: Any = None) -> tuple[Any, Any]:
        with torch.no_grad():
            out, width, decoded = generate_batch(
                model, rows, tokenizer.pad_token_id, skip=skip, cache=cache, max_new_tokens=6,
                do_sample=False, temperature=None, top_p=None, top_k=None,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
        return out, width, decoded

    out, width, decoded = run(tickets)
    prefixes = [row_layers(decoded, i, range(width - len(t), width - 1)) for i, t in enumerate(tickets)]
    again = [t + later(i) for i, t in enumerate(tickets)]
    whole, whole_width, _ = run(again)
    reused, reused_width, _ = run(again, [len(t) - 1 for t in tickets], stacked(prefixes))
    assert torch.equal(whole.sequences[:, whole_width:], reused.sequences[:, reused_width:])
    assert (torch.stack(whole.logits) - torch.stack(reused.logits)).abs().max() < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True])
def test_the_shared_prompt_loss_pass_equals_trls_in_values_and_gradients(recompute, monkeypatch):
    """Two groups of three rollouts and a dropped group's stubs, left-padded as TRL pads them:
    running each prompt once gives the log-probs, entropies and LoRA gradients of TRL's pass,
    also when every decoder layer is replayed in backward instead of keeping its activations."""
    import torch
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from trace_plugin.model_files import load_model
    from training.experts import shared_prefix_logps

    model, _ = load_model(resolve_model())
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    add_fused_lm_head(model.get_base_model(), temperature=0.7, outputs=("log_probs", "entropy"))
    torch.manual_seed(0)
    prompts = [torch.randint(100, 2000, (n,)) for n in (30, 24)]
    rows, masks = [], []
    for prompt in prompts:
        for ended in (6, 5, 4):  # completion tokens before the right padding
            completion = torch.randint(100, 2000, (6,))
            pad = 30 - len(prompt)
            rows.append(torch.cat([torch.zeros(pad, dtype=torch.long), prompt, completion]))
            mask = torch.cat([torch.zeros(pad), torch.ones(len(prompt)), torch.ones(6)]).long()
            mask[30 + ended :] = 0
            masks.append(mask)
    for _ in range(2):  # a dropped group's stubs: one prompt token, one completion token
        rows.append(torch.tensor([0] * 29 + [7, 5] + [0] * 5))
        masks.append(torch.tensor([0] * 29 + [1, 1] + [0] * 5))
    order = [0, 3, 6, 1, 4, 2, 7, 5]  # groups interleaved: the result keeps the rows' order
    input_ids, attention_mask = torch.stack(rows)[order], torch.stack(masks)[order]

    def reference():
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-6] = -100
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -6:], out.entropy[:, -6:]

    def grads(logps):
        model.zero_grad()
        (logps * torch.linspace(-1, 1, logps.numel()).view_as(logps)).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    expected, expected_entropy = reference()
    replays = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(
        torch.utils.checkpoint, "checkpoint", lambda *a, **k: replays.append(1) or checkpoint(*a, **k)
    )
    model.train()  # as TRL trains it (no dropout: the same network); layers replay only in training
    if recompute:  # and score two rows' completions a forward
        monkeypatch.setattr("training.experts.HEAD_POSITIONS", 12)
    ours, entropy = shared_prefix_logps(
        model, input_ids, attention_mask, 6, compute_entropy=True, recompute=recompute
    )
    # Each decoder layer checkpointed in every pass: three prompts (two groups', the stubs'), then
    # their rows two at a time (2 + 2 + 1 passes).
    assert len(replays) == (8 * model.config.num_hidden_layers if recompute else 0)
    assert ours.shape == expected.shape == (8, 6) and not ours.isnan().any()
    assert torch.allclose(ours, expected, atol=1e-4) and torch.allclose(entropy, expected_entropy, atol=1e-4)
    g_expected, g_ours = grads(expected), grads(ours)
    assert g_expected.keys() == g_ours.keys() and any(g.abs().sum() > 0 for g in g_ours.values())
    for name in g_expected:  # float32 sums in another order: equal up to rounding
        error = (g_ours[name] - g_expected[name]).norm() / g_expected[name].norm().clamp_min(1e-12)
        assert error < 1e-4, (name, float(error))


def test_a_vllm_server_is_where_a_run_takes_place_not_what_it_learns():
    """A run resumed against a vLLM server on another port (``--engine vllm`` takes a free
    one each start) is the same run; a server needs its backend and the backend a server."""
    here, there = (
        ExpertTrainingConfig(backend="vllm-server", vllm_url=f"http://127.0.0.1:{port}")
        for port in (8001, 8002)
    )
    assert here.to_dict() != there.to_dict() and here.learning_dict() == there.learning_dict()
    assert here.learning_dict() != ExpertTrainingConfig().learning_dict()  # the backend itself counts
    for wrong in ({"backend": "vllm-server"}, {"vllm_url": "http://127.0.0.1:8001"}):
        with pytest.raises(ValueError, match="vllm_url"):
            ExpertTrainingConfig(**wrong)
