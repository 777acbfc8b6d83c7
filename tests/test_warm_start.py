"""The warm start: reference plays rendered token for token as serving renders them, trained
on the replies only with nothing truncated, never an evaluated task, resumable, and GRPO
continuing from the warm-started adapter."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.plays import EXAMPLES
from transformers import AutoTokenizer, TrainerCallback

from trace_plugin.chat_template import render
from trace_plugin.environments.base import offered_tools, task_key
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.retail import POLICY, TOOLS, TRAIN_SEEDS, RetailEnv
from trace_plugin.environments.synthesis import synthesize
from trace_plugin.model_files import prepare_tokenizer, resolve_model
from trace_plugin.tool_calls import parse_completion
from training.config import ExpertTrainingConfig
from training.episodes import EpisodePlayer
from training.warm_start import WarmStartTrainer, reference_plays


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True))


def retail_player(tokenizer: Any, **options: Any) -> EpisodePlayer:
    return EpisodePlayer(
        tokenizer, RetailEnv, max_turns=6, max_observation_chars=10_000, examples=EXAMPLES, **options
    )


class Replaying(RetailEnv):
    """Retail, also able to say what a reference call returns in a fresh episode's state."""

    def step_result(self, call: dict[str, Any]) -> str:
        from trace_plugin.environments.base import ToolCall

        return self.step(ToolCall(call["name"], call["arguments"]))


def serving_conversation(env: Replaying, task: Any) -> list[list[dict[str, Any]]]:
    """The conversation before each assistant turn, in OpenAI form, as a client sends it."""
    messages = [
        {"role": "system", "content": env.system_prompt},
        *EXAMPLES,
        {"role": "user", "content": task.prompt},
    ]
    befores = []
    for i, call in enumerate(task.metadata["reference"]):
        befores.append(list(messages))
        arguments = json.dumps(call["arguments"])
        tool_call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": env.step_result(call)})
    befores.append(list(messages))
    return befores


def test_reference_plays_are_what_serving_renders_token_for_token(tokenizer):
    """Before every assistant turn the play holds exactly the ids the gateway tokenizes its
    rendering of the conversation to, and each reply parses back to the reference call."""
    player = EpisodePlayer(tokenizer, Replaying, max_turns=6, max_observation_chars=10_000, examples=EXAMPLES)
    kinds = set()
    for seed in list(TRAIN_SEEDS)[:24]:
        play = player.reference(seed)
        env = Replaying()
        task = env.reset(seed)
        assert play is not None and play.demonstration and play.reward == 1.0, task.kind
        kinds.add(task.kind)
        ids = play.prompt_ids + play.completion_ids
        mask = [0] * len(play.prompt_ids) + play.env_mask
        befores = serving_conversation(env, task)
        starts = []
        for conversation in befores:
            serving = tokenizer(render(tokenizer, conversation, env.tools), add_special_tokens=False)[
                "input_ids"
            ]
            assert ids[: len(serving)] == serving
            assert mask[len(serving) - 1] == 0 and mask[len(serving)] == 1  # the reply, and only it, trains
            starts.append(len(serving))
        ends = [i + 1 for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
        assert len(ends) == len(starts) == len(task.metadata["reference"]) + 1
        for k, (start, end) in enumerate(zip(starts, ends, strict=True)):
            assert ids[end - 1] == tokenizer.eos_token_id  # each reply ends as the model ends it
            parsed = parse_completion(tokenizer.decode(ids[start : end - 1]), truncated=False)
            if k < len(task.metadata["reference"]):
                call = task.metadata["reference"][k]
                [made] = parsed.tool_calls
                assert made["function"]["name"] == call["name"]
                assert json.loads(made["function"]["arguments"]) == call["arguments"]
            else:
                assert not parsed.tool_calls and all(f in parsed.content for f in task.metadata["facts"])
    assert {"lookup", "cancel", "exchange_item", "refuse_return"} <= kinds


def test_parallel_calls_are_one_turn_the_answers_are_told_and_no_call_requests_only_answer(tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name} a value.",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            },
        }
        for name in ("double", "halve", "negate")
    ]
    spec = synthesize("tool_selection", tools, system_prompt="Use the tools.")
    player = EpisodePlayer(tokenizer, lambda: SpecEnv(spec), max_turns=3, max_observation_chars=800)
    seen = {}
    for seed in range(200):
        task = SpecEnv(spec).reset(seed)
        if task.kind in seen:
            continue
        play = player.reference(seed)
        assert play is not None, task.kind
        replies = tokenizer.decode([t for t, m in zip(play.completion_ids, play.env_mask, strict=True) if m])
        seen[task.kind] = (play.turns, replies.count("<tool_call>"))
        assert all(fact in replies for fact in task.metadata["facts"])  # each call's answer is told
    assert seen["two_calls"] == (2, 2)  # both calls in one turn, then the answer
    assert seen["no_call"] == (1, 0)
    assert all(v == (2, 1) for k, v in seen.items() if k.startswith("call_"))


def test_plays_leave_out_every_evaluated_task(tokenizer):
    """The generic family draws its no-call requests from three fixed strings: seeds differ,
    tasks repeat. No play may be a task an evaluation plays."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {
                    "type": "object",
                    "properties": {"flag": {"type": "boolean"}},
                    "required": ["flag"],
                },
            },
        }
        for i in range(3)
    ]
    spec = synthesize("tool_selection", tools, system_prompt="Use the tools.")

    def key(seed: int) -> str:
        env = SpecEnv(spec)
        task = env.reset(seed)
        return task_key(task.prompt, offered_tools(env, task))

    evaluated = {key(seed) for seed in range(3_000_000, 3_000_064)}  # held-out seeds, say
    player = EpisodePlayer(tokenizer, lambda: SpecEnv(spec), max_turns=3, max_observation_chars=800)
    plays = reference_plays(player, range(400), 64, exclude=evaluated)
    keys = [key(p.seed) for p in plays.plays]
    assert plays.leaked > 0 and plays.repeated > 0 and keys
    assert not set(keys) & evaluated and len(set(keys)) == len(keys)
    # Without the exclusion, the same seeds would have played evaluated tasks.
    unguarded = reference_plays(player, range(400), 64)
    assert {key(p.seed) for p in unguarded.plays} & evaluated


def test_grpo_samples_no_task_the_warm_start_trained_on_or_an_evaluation_plays(tmp_path):
    """Seeds differ, tasks repeat: GRPO sampled the warm start's own tasks, whose groups then
    all succeed and are dropped (the bench saw every group at 1.00 after the warm start)."""
    from training.experts import ExpertTrainer
    from training.warm_start import WarmStartResult

    spec = synthesize("tool_call_format", TOOLS, system_prompt=POLICY)

    def key(seed: int) -> str:
        env = SpecEnv(spec)
        task = env.reset(seed)
        return task_key(task.prompt, offered_tools(env, task))

    config = ExpertTrainingConfig(output_dir=str(tmp_path / "expert"))
    evaluated = {key(seed) for seed in range(3_000_000, 3_000_016)}
    trainer = ExpertTrainer(config, lambda: SpecEnv(spec), range(400), exclude=evaluated)
    played = list(range(0, 400, 7))
    trainer.warm_start = WarmStartResult(tmp_path, len(played), {}, [], play_seeds=played)
    seeds = trainer._grpo_seeds()
    memorized = {key(s) for s in played}
    assert seeds and not {key(s) for s in seeds} & (memorized | evaluated)
    assert len(seeds) < 400 - len(played)  # other seeds drew the same tasks, and are left out too


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_warm_start_and_grpo_ask_plainly_where_the_calibrated_level_names_tools(tmp_path, monkeypatch):
    """The quick demo's expert, warm-started on tickets ending "Use find_user and
    cancel_order", went to the target's tickets, which never name a tool, and skipped the
    lookups: a reference play's calls are right however its request is asked. Then GRPO
    still started at the calibrated level, which named the tools in every ticket (the
    headline's writes expert, warm-started plainly, trained 20 steps on named tickets): a
    warm-started expert's GRPO now starts where requests are asked plainly, and may step
    down no lower than the calibrated level."""
    import training.experts
    from training.executors import TrainingJob, job_trainer

    spec = synthesize("write_completion", TOOLS, system_prompt=POLICY)
    named = spec.model_copy(update={"difficulty": spec.difficulty.model_copy(update={"name_tools": 1.0})})
    config = {"output_dir": str(tmp_path / "expert"), "warm_start_plays": 2}
    trainer = job_trainer(TrainingJob(json.loads(named.to_json()), list(range(40)), config, progress=False))
    warm_players = []

    class Stop(Exception):
        pass

    def warm_start(config: Any, player: EpisodePlayer, *args: Any, **kwargs: Any) -> None:
        warm_players.append(player)
        raise Stop

    monkeypatch.setattr(training.experts, "WarmStartTrainer", warm_start)
    with pytest.raises(Stop):
        trainer._build()
    [player] = warm_players

    def asked(factory: Any) -> list[str]:
        return [factory().reset(seed).prompt for seed in range(40)]

    assert not [p for p in asked(player.env_factory) if " Use " in p]
    named_prompts = [p for p in asked(trainer.env_factory) if " Use " in p]
    assert named_prompts and len(named_prompts) == sum(
        bool(SpecEnv(named).reset(s).metadata["reference"]) for s in range(40)
    )
    assert asked(trainer.levels[trainer.start_level]) == asked(trainer.env_factory)  # the floor
    assert trainer.warm_level > trainer.start_level
    assert not [p for p in asked(trainer.levels[trainer.warm_level]) if " Use " in p]


@pytest.mark.slow
def test_sft_trains_the_replies_only_and_truncates_nothing(tokenizer, tmp_path):
    """TRL's own default ``max_length`` (1024) would cut every retail play's replies away."""
    from trace_plugin.model_files import load_model

    config = ExpertTrainingConfig(warm_start_plays=4, warm_start_epochs=1, warm_start_batch_size=2)
    warm = WarmStartTrainer(config, retail_player(tokenizer), list(TRAIN_SEEDS), tmp_path, progress=False)
    plays = warm.plays()
    assert len(plays.plays) == 4 and plays.longest > 1024
    model, _ = load_model(resolve_model())
    trainer = warm.build(model, plays)
    rows = plays.rows()
    assert trainer.train_dataset["input_ids"] == rows["input_ids"]
    expected = [
        [t if m else -100 for t, m in zip(ids, mask, strict=True)]
        for ids, mask in zip(rows["input_ids"], rows["assistant_masks"], strict=True)
    ]
    assert trainer.train_dataset["labels"] == expected


@pytest.mark.slow
def test_the_common_opening_once_equals_the_plain_forward_in_loss_and_gradients(monkeypatch):
    """Rows sharing a 40-token opening, then their own requests and replies, right-padded as
    TRL's collator pads them; in training mode, so every decoder layer is replayed in backward."""
    import torch
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from trace_plugin.model_files import load_model
    from training.warm_start import opening_once_forward

    model, _ = load_model(resolve_model())
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    torch.manual_seed(0)
    opening = torch.randint(100, 2000, (40,))
    rows, masks, labels = [], [], []
    for request, reply in ((5, 7), (9, 3), (6, 6)):
        tail = torch.randint(100, 2000, (request + reply,))
        ids = torch.cat([opening, tail])
        pad = 55 - len(ids)
        rows.append(torch.cat([ids, torch.zeros(pad, dtype=torch.long)]))
        masks.append(torch.cat([torch.ones(len(ids)), torch.zeros(pad)]).long())
        label = rows[-1].clone()
        label[: 40 + request] = -100
        label[len(ids) :] = -100
        labels.append(label)
    input_ids, attention_mask, label_ids = torch.stack(rows), torch.stack(masks), torch.stack(labels)

    def loss_and_grads(out):
        model.zero_grad()
        loss = -out.log_probs.sum() / out.label_mask.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.train()  # as SFT trains it (no dropout: the same network)
    plain = model(input_ids=input_ids, attention_mask=attention_mask, labels=label_ids, fused_lm_head=True)
    replays = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(
        torch.utils.checkpoint, "checkpoint", lambda *a, **k: replays.append(1) or checkpoint(*a, **k)
    )
    ours = opening_once_forward(model, input_ids, attention_mask, label_ids)
    assert len(replays) == 2 * model.config.num_hidden_layers  # the opening's pass and the rows'
    assert int(ours.label_mask.sum()) == int(plain.label_mask.sum()) == 16
    assert torch.allclose(ours.entropy.sum(), plain.entropy.sum(), rtol=1e-4)
    (l_plain, g_plain), (l_ours, g_ours) = loss_and_grads(plain), loss_and_grads(ours)
    assert torch.allclose(l_ours, l_plain, atol=1e-5)
    for name in g_plain:
        error = (g_ours[name] - g_plain[name]).norm() / g_plain[name].norm().clamp_min(1e-12)
        assert error < 1e-4, (name, float(error))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rows_of_different_openings_run_whole_each_layer_replayed_in_backward(monkeypatch):
    """A batch that shares no opening (a leftover batch mixing plays and rehearsed
    conversations) runs each row whole, and still keeps no layer's activations: its memory
    is a shared batch's, and its loss and gradients the plain forward's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from trace_plugin.model_files import load_model
    from training.warm_start import opening_once_forward

    model, _ = load_model(resolve_model())
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    torch.manual_seed(1)
    input_ids = torch.randint(100, 2000, (2, 30))
    input_ids[1, 0] = input_ids[0, 0] + 1  # no token in common from the first
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    labels[:, :20] = -100
    model.train()

    def loss_and_grads(out: Any) -> tuple[Any, dict[str, Any]]:
        model.zero_grad()
        loss = -out.log_probs.sum() / out.label_mask.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = loss_and_grads(
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    )
    replays = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(
        torch.utils.checkpoint, "checkpoint", lambda *a, **k: replays.append(1) or checkpoint(*a, **k)
    )
    ours = loss_and_grads(opening_once_forward(model, input_ids, attention_mask, labels))
    assert len(replays) == model.config.num_hidden_layers
    assert torch.allclose(ours[0], plain[0], atol=1e-5)
    for name, grad in plain[1].items():
        assert (ours[1][name] - grad).norm() / grad.norm().clamp_min(1e-12) < 1e-4, name


class Interrupted(Exception):
    pass


class InterruptAfterCheckpoint(TrainerCallback):
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 1:
            raise Interrupted


@pytest.mark.slow
def test_a_killed_warm_start_resumes_and_grpo_continues_from_its_adapter(tmp_path):
    """Killed after its first checkpoint, the warm start resumes there; GRPO then trains the
    warm-started adapter itself, with no hints. Its groups here are all flat (8 tokens
    cannot finish a call), so no gradient reaches it and the expert is the warm start exactly."""
    from safetensors.torch import load_file

    from trace_plugin.adapter_files import WEIGHTS
    from training.experts import ExpertTrainer
    from training.lora import is_noop

    config = ExpertTrainingConfig(
        output_dir=str(tmp_path / "expert"),
        num_generations=2,
        rollout_budget=2,
        max_completion_length=8,
        resample_rounds=0,
        checkpoint_every=1,
        warm_start_plays=4,
        warm_start_epochs=1,
        warm_start_batch_size=2,
        demonstrate=False,  # a demonstration would give the flat group a gradient
        hint_fraction=1.0,
    )
    seeds = list(TRAIN_SEEDS)[:16]
    work = tmp_path / ".expert.partial"
    with pytest.raises(Interrupted):  # the warm start saves first: killed there
        ExpertTrainer(
            config, RetailEnv, seeds, examples=EXAMPLES, callbacks=[InterruptAfterCheckpoint()]
        ).train()
    assert [p.name for p in (work / "warm_start.partial").glob("checkpoint-*")] == ["checkpoint-1"]

    hint = "Identify the user with find_user first."
    expert = ExpertTrainer(config, RetailEnv, seeds, examples=EXAMPLES, hint=hint, progress=False).train()
    warm_start = json.loads((expert.adapter_dir / "warm_start" / "warm_start.json").read_text())
    assert warm_start["resumed_from_step"] == 1 and warm_start["plays"] == 4
    assert expert.reference_plays == 4 and len(expert.warm_start_losses) == 2
    assert expert.logs[0]["dynamic_sampling/dropped_groups"] == 1
    # Taught whole plays, the expert plays GRPO's tickets without the hint's half-conversation.
    assert expert.logs[0]["episodes/hinted_fraction"] == 0.0
    warm = load_file(expert.adapter_dir / "warm_start" / WEIGHTS)
    final = load_file(expert.adapter_dir / WEIGHTS)
    assert not is_noop(expert.adapter_dir) and warm.keys() == final.keys()
    assert all((warm[k] == final[k]).all() for k in warm)


def test_a_reply_may_take_as_many_tokens_as_the_environments_longest_reference_reply(tokenizer):
    """One source for the completion length of training, calibration and held-out play:
    the environment's reference plays. A nested schema's call runs past the 48 tokens the
    demo used to allow."""
    from trace_plugin.environments.interpreter import reply_budget

    schema = {
        "type": "object",
        "properties": {
            "shipment": {
                "type": "object",
                "properties": {
                    "origin_postcode": {"type": "string", "format": "email"},
                    "destination_postcode": {"type": "string", "format": "uri"},
                    "declared_value": {"type": "number", "minimum": 1000, "maximum": 9000},
                },
                "required": ["origin_postcode", "destination_postcode", "declared_value"],
            },
            "service_level": {"type": "string", "enum": ["overnight-express", "standard-ground"]},
        },
        "required": ["shipment", "service_level"],
    }
    tools = [{"type": "function", "function": {"name": "logistics.quoteShipment", "parameters": schema}}]
    spec = synthesize("tool_selection", tools, system_prompt="Quote shipments.")
    budget = reply_budget(spec, tokenizer)
    player = EpisodePlayer(tokenizer, lambda: SpecEnv(spec), max_turns=3, max_observation_chars=800)
    longest = 0
    for seed in range(32):
        play = player.reference(seed)
        run = 0
        for bit in play.env_mask:  # each reply is a run of model tokens, EOS included
            run = run + 1 if bit else 0
            longest = max(longest, run)
    assert 48 < longest <= budget <= longest + longest // 4 + 8


def test_the_newest_complete_checkpoint_is_resumed_and_a_half_saved_one_removed(tmp_path):
    """The warm start and GRPO find their checkpoints one way (training.checkpoints)."""
    from training.checkpoints import STATE, checkpoint_step, latest_checkpoint, publish

    assert latest_checkpoint(tmp_path) is None
    for step, complete in ((5, True), (10, True), (15, False)):  # 15: killed mid-save
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / STATE).write_text("{}")
    newest = latest_checkpoint(tmp_path)
    assert newest == tmp_path / "checkpoint-10" and checkpoint_step(newest) == 10
    assert not (tmp_path / "checkpoint-15").exists()
    publish(newest, tmp_path / "final")
    assert (tmp_path / "final" / STATE).is_file() and not newest.exists()
