"""Episodes played for training: the player that renders and plays them, and its backend.

``EpisodePlayer`` renders prompts as the gateway serves them and plays whole episodes,
all rollouts of a batch in lockstep with one batched ``generate`` per turn; GRPO's rollout
function and the warm start's reference plays (``training.warm_start``) both build their
token sequences here, so the two can never disagree about what the model is trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList

from trace_plugin.chat_template import (
    TOOL_CHAT_TEMPLATE,
    assistant_text,
    forbidden_token_ids,
    render,
    to_template_messages,
)
from trace_plugin.environments.base import Environment, observe, offered_tools, play_reference
from trace_plugin.export import Conversation
from trace_plugin.generation import (
    Layers,
    TemperatureSampler,
    generate_batch,
    row_layers,
    shared_prefix,
    stacked,
    until_eos,
)
from trace_plugin.tool_calls import parse_completion

# Text appended to the ticket, or worked example turns placed just before it (a small
# model copies a demonstrated tool call far more readily than it follows an instruction).
HintValue = str | list[dict[str, Any]]
SERVED = -1  # the seed of a rollout that is a captured conversation, no environment's task
# A generation backend: token-id prompts in, one list of completion ids (EOS included when
# the model stopped) per prompt out.
Generate = Callable[[list[list[int]]], list[list[int]]]


@dataclass(slots=True)
class Rollout:
    """One episode played for training, as the loss sees it, and what the environment made of it.

    Not ``trace_plugin.records.trajectory.Episode``, the stored record of an agent's run.
    """

    seed: int
    prompt_ids: list[int]  # the un-hinted prompt: what the loss conditions on
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1: model token, 0: tool-result token
    answer: str = ""
    reward: float = 0.0
    checks: dict[str, float] = field(default_factory=dict)  # the reward's named checks, each 0-1
    hinted: bool = False
    turns: int = 0
    # A reference play (``EpisodePlayer.reference``), not a sample of the policy: it never
    # counts in success or un-hinted statistics.
    demonstration: bool = False


class EpisodePlayer:
    """Plays batches of episodes of any environment in lockstep, one ``generate`` per turn.

    Prompts are rendered as the gateway renders them (``TOOL_CHAT_TEMPLATE`` with the
    OpenAI tool schemas the task offers), so an expert is trained on the tokens it
    will be served. Later turns are built by appending token ids (model output, then the
    template's tool-response block), never by re-rendering: the loss must score exactly
    the tokens that were sampled.
    """

    def __init__(
        self,
        tokenizer: Any,
        env_factory: Callable[[], Environment],
        *,
        max_turns: int,
        max_observation_chars: int,
        examples: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.tokenizer, self.env_factory = tokenizer, env_factory
        self.max_turns, self.max_observation_chars = max_turns, max_observation_chars
        self.examples = list(examples)  # few-shot messages placed after the system prompt
        self.eos = tokenizer.eos_token_id
        self._tool_head = self._template([{"role": "user", "content": "x"}, _DUMMY_CALL], False)

    def play(
        self, seeds: Sequence[int], hints: Sequence[HintValue | None], generate: Generate
    ) -> list[Rollout]:
        envs = [self.env_factory() for _ in seeds]
        rollouts, contexts = [], []
        for env, seed, hint in zip(envs, seeds, hints, strict=True):
            task = env.reset(seed)
            tools = offered_tools(env, task)
            prompt_ids = self._prompt_ids(env, tools, task.prompt)
            rollouts.append(Rollout(seed, prompt_ids, hinted=hint is not None))
            if isinstance(hint, list):
                contexts.append(self._prompt_ids(env, tools, task.prompt, hint))
            else:
                contexts.append(
                    self._prompt_ids(env, tools, f"{task.prompt}\n\nHint: {hint}") if hint else prompt_ids
                )
        active = list(range(len(rollouts)))
        for turn in range(1, self.max_turns + 1):
            if not active:
                break
            outputs = generate([contexts[i] + rollouts[i].completion_ids for i in active])
            still = []
            for i, ids in zip(active, outputs, strict=True):
                rollout, env = rollouts[i], envs[i]
                self._append(rollout, ids, 1)
                rollout.turns = turn
                stopped = bool(ids) and ids[-1] == self.eos
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                parsed = parse_completion(text, truncated=not stopped)
                if not (stopped and parsed.tool_calls):
                    rollout.answer = parsed.content or ""
                    continue
                observations = [observe(env, call, self.max_observation_chars) for call in parsed.tool_calls]
                if env.done or turn == self.max_turns:
                    continue  # ended by the environment, or out of turns: no final message
                self._append(rollout, self._tool_suffix(observations), 0)
                still.append(i)
            active = still
        for rollout, env in zip(rollouts, envs, strict=True):
            verdict = env.reward(rollout.answer)
            rollout.reward, rollout.checks = float(verdict.total), dict(verdict.components)
        return rollouts

    def reference(self, seed: int) -> Rollout | None:
        """The task's verified reference solution as the policy would have played it: the
        reference calls (one turn each, or one turn for all when the task says they are
        independent), the environment's real results, then the answer told to the user.

        Token for token what a rollout holds, and what serving renders for each turn: the
        model's tokens are the template's own text for each assistant message, so the
        warm start and demonstrations train exactly the replies GRPO samples and the gateway
        parses. None when the task has no reference, it is unsatisfiable, it takes more turns
        than ``max_turns``, or the played reference does not succeed."""
        env = self.env_factory()
        play = play_reference(
            env, seed, max_turns=self.max_turns, max_observation_chars=self.max_observation_chars
        )
        if play is None:
            return None
        rollout = Rollout(seed, self._prompt_ids(env, play.tools, play.task.prompt), demonstration=True)
        for i, (calls, observations) in enumerate(play.turns):
            self._append(
                rollout, self._assistant_ids({"role": "assistant", "content": "", "tool_calls": calls}), 1
            )
            rollout.turns += 1
            if play.shows_results(i):
                self._append(rollout, self._tool_suffix(observations), 0)
        if play.told is not None:
            self._append(rollout, self._assistant_ids({"role": "assistant", "content": play.told}), 1)
            rollout.turns += 1
            rollout.answer = play.told
        rollout.reward = play.reward
        return rollout

    def served(self, conversation: Conversation) -> Rollout | None:
        """A captured conversation as serving rendered each of its turns: the prompt before
        the model's first reply, then each reply as the template writes it (the model's
        tokens) and what the next prompt adds before the next (tool results, a user's turn).
        None when it has no reply of the model's, or a later prompt does not extend the
        earlier one token for token (then serving did not see it as one sequence either)."""
        messages, tools = conversation.messages, conversation.tools or None
        rollout: Rollout | None = None
        for i in range(max(conversation.opening, 1), len(messages)):
            message = messages[i]
            if message["role"] != "assistant":
                continue
            text = render(self.tokenizer, messages[:i], tools)
            prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if rollout is None:
                rollout = Rollout(SERVED, prompt, demonstration=True)
            else:
                played = rollout.prompt_ids + rollout.completion_ids
                if prompt[: len(played)] != played:
                    return None
                self._append(rollout, prompt[len(played) :], 0)
            self._append(rollout, self._assistant_ids(to_template_messages([message])[0]), 1)
            rollout.turns += 1
        return rollout

    def _assistant_ids(self, message: dict[str, Any]) -> list[int]:
        """An assistant message as the model writes it, EOS included (not the newline the
        template puts after EOS: serving's prompt holds it, so the model never writes it)."""
        text = assistant_text(self.tokenizer, message)
        return [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.eos]

    @staticmethod
    def _append(rollout: Rollout, ids: list[int], mask: int) -> None:
        rollout.completion_ids += ids
        rollout.env_mask += [mask] * len(ids)

    def _prompt_ids(
        self, env: Environment, tools: list[dict[str, Any]], user: str, turns: Sequence[dict[str, Any]] = ()
    ) -> list[int]:
        messages = [{"role": "system", "content": env.system_prompt}, *self.examples, *turns]
        text = render(self.tokenizer, [*messages, {"role": "user", "content": user}], tools)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _tool_suffix(self, observations: list[str]) -> list[int]:
        """The template's tokens between an assistant turn's EOS and the next assistant turn."""
        tools = [{"role": "tool", "content": o} for o in observations]
        full = self._template([{"role": "user", "content": "x"}, _DUMMY_CALL, *tools], True)
        end = self._tool_head.rindex(self.tokenizer.eos_token) + len(self.tokenizer.eos_token)
        return self.tokenizer(full[end:], add_special_tokens=False)["input_ids"]

    def _template(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=TOOL_CHAT_TEMPLATE,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )


_DUMMY_CALL = {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]}


def hf_generate(
    model: Any,
    tokenizer: Any,
    *,
    max_new_tokens: int,
    temperature: float | None,
    batch_size: int = 64,
    share_prefix: bool = True,
    keep_turns: bool = True,
) -> Generate:
    """A transformers backend: left-padded batches; ``temperature=None`` decodes greedily.

    A batch's prompts open alike (the policy, tool schemas and worked examples; a group's
    ticket too, on every turn), and on a CPU that prompt costs more than the reply. With
    ``share_prefix`` the common opening runs once and every row continues from its keys
    and values (``trace_plugin.generation.shared_prefix``), on the generation core the
    gateway's embedded backend serves requests with.

    With ``keep_turns`` each row's keys and values outlive the call that made them: a
    conversation's next turn is its previous prompt, the reply and a tool result, so the
    next call runs only the reply's last token and the tool result instead of the whole
    history again (a 1,400-token history costs about 2.3 s here). Only the previous call's
    rows are kept, so the memory held is one conversation per row. The model must not
    change between calls: one backend per policy (one ``rollout_func`` call).
    """
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bad_words_ids=forbidden_token_ids(tokenizer),  # decode as the gateway serves
        do_sample=False,  # sampling, if any, is TemperatureSampler's
    )
    sampler = LogitsProcessorList([TemperatureSampler(temperature)] if temperature is not None else [])
    eos = tokenizer.eos_token_id
    held: dict[tuple[int, ...], Layers] = {}  # a row's tokens so far (less the last) -> their keys and values

    def earlier(row: list[int]) -> tuple[int, Layers | None]:
        """The longest held conversation ``row`` continues, leaving it a token to run."""
        best = max(
            (ids for ids in held if len(ids) < len(row) and row[: len(ids)] == list(ids)), key=len, default=()
        )
        return (len(best), held[best]) if best else (0, None)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        out: list[list[int]] = []
        kept: dict[tuple[int, ...], Layers] = {}
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            with torch.no_grad():
                found = [earlier(row) for row in chunk] if keep_turns else []
                if any(kv is not None for _, kv in found):
                    skip, cache = [n for n, _ in found], stacked([kv for _, kv in found])
                    generate.reused += sum(skip)  # type: ignore[attr-defined]
                elif share_prefix:
                    skip, cache = shared_prefix(model, chunk)
                else:
                    skip, cache = 0, None
                result, width, decoded = generate_batch(
                    model,
                    chunk,
                    tokenizer.pad_token_id,
                    skip=skip,
                    cache=cache,
                    generation_config=config,
                    logits_processor=sampler,
                )
            replies = [until_eos(row[width:].tolist(), eos) for row in result]
            if keep_turns:
                skips = skip if isinstance(skip, list) else [skip] * len(chunk)
                for i, (row, reply, cached) in enumerate(zip(chunk, replies, skips, strict=True)):
                    positions = [
                        *range(cached),
                        *range(width - (len(row) - cached), width),
                        *range(width, width + len(reply) - 1),  # the last token was never run
                    ]
                    kept[(*row, *reply[:-1])] = row_layers(decoded, i, positions)
            out += replies
        held.clear()
        held.update(kept)
        return out

    generate.reused = 0  # type: ignore[attr-defined]  # prompt tokens run from a kept turn, not again
    return generate
