"""The warm start's rehearsal: the deployed agent's successful episodes, in the token ids the
gateway served, trained beside an environment's reference plays so that an expert keeps what
the agent already does right (``export.successful_plays``, ``training.warm_start``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from support.plays import EXAMPLES

from trace_plugin import Store
from trace_plugin.environments.base import request_key
from trace_plugin.environments.retail import POLICY, TRAIN_SEEDS, RetailEnv
from trace_plugin.environments.retail import TOOLS as RETAIL_TOOLS
from trace_plugin.export import TokenPlay, successful_plays, token_play
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Step, new_episode_id
from trace_plugin.store.store import EpisodeFilter

T0 = datetime(2026, 3, 1, tzinfo=UTC)


def served(episode_id: str, seq: int, prompt: list[int], completion: list[int], request: str) -> Step:
    """An LLM step the gateway served: its messages, and the ids it generated from and sampled."""
    messages = [{"role": "system", "content": "You help."}, *EXAMPLES, {"role": "user", "content": request}]
    return Step(
        episode_id,
        seq,
        "llm",
        "m",
        input={"messages": messages, "tools": []},
        output={"role": "assistant", "content": "done"},
        token_ids={"prompt": prompt, "completions": [completion]},
    )


def test_token_play_marks_each_sampled_turn_that_the_next_prompt_repeats():
    """Three turns: the second prompt repeats the first turn token for token, so the first
    reply is trained; the third re-renders the second reply otherwise, so that reply stays
    context, as serving saw it; the last reply is trained."""
    episode = Episode(new_episode_id(), "shop")
    episode.steps = [
        served(episode.id, 0, [1, 2], [10, 11, 2], "hi"),
        served(episode.id, 1, [1, 2, 10, 11, 2, 5], [20, 21, 2], "hi"),
        served(episode.id, 2, [1, 2, 10, 11, 2, 5, 20, 99, 2, 6], [30, 2], "hi"),
    ]
    play = token_play(episode)
    assert play == TokenPlay(
        input_ids=[1, 2, 10, 11, 2, 5, 20, 99, 2, 6, 30, 2],
        assistant_mask=[0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1, 1],
    )
    assert token_play(Episode(new_episode_id(), "shop")) is None  # no ids, no play


def write(store: Store, request: str, minute: int, reward: float, ids: bool = True) -> str:
    episode = Episode(new_episode_id(), "shop", started_at=T0 + timedelta(minutes=minute))
    step = served(episode.id, 0, [1, minute], [minute, 2], request)
    if not ids:
        step.token_ids = None
    store.write([episode, step, EpisodeEnd(episode.id, "completed", reward=reward)])
    return episode.id


def test_successful_plays_are_the_newest_successes_each_request_once_and_none_evaluated(db_url):
    store = Store(db_url)
    store.upgrade()
    write(store, "old success", 0, 1.0)  # before ``since``
    write(store, "Cancel order O-1", 1, 1.0)
    write(store, "a failure", 2, 0.0)
    write(store, "no ids", 3, 1.0, ids=False)  # recorded elsewhere than the gateway
    write(store, "  cancel ORDER  O-1 ", 4, 1.0)  # the same request as minute 1's: once
    write(store, "an evaluated task", 5, 1.0)
    write(store, "return item", 6, 1.0)
    since = T0 + timedelta(minutes=1)
    plays = successful_plays(store, "shop", 10, since=since, exclude={request_key("An evaluated  task")})
    assert [p.input_ids for p in plays] == [[1, 6, 6, 2], [1, 4, 4, 2]]  # newest first
    assert all(p.assistant_mask == [0, 0, 1, 1] for p in plays)
    assert len(successful_plays(store, "shop", 1, since=since)) == 1
    assert successful_plays(store, "other", 10) == []
    store.close()


def test_the_warm_start_trains_on_its_rehearsal_beside_the_plays():
    """The SFT rows are the plays' then the rehearsal's, and the longest row, which sets the
    trainer's ``max_length``, may be a rehearsed one: nothing is cut."""
    from transformers import AutoTokenizer

    from trace_plugin.model_files import prepare_tokenizer, resolve_model
    from training.episodes import EpisodePlayer
    from training.warm_start import reference_plays

    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True))
    player = EpisodePlayer(tokenizer, RetailEnv, max_turns=6, max_observation_chars=300, examples=EXAMPLES)
    long = TokenPlay(list(range(5000)), [0] * 4990 + [1] * 10)
    plays = reference_plays(player, list(TRAIN_SEEDS)[:8], 2, rehearsal=[long])
    rows = plays.rows()
    assert len(plays.plays) == 2 and len(rows["input_ids"]) == 3
    assert rows["input_ids"][2] == long.input_ids and rows["assistant_masks"][2] == long.assistant_mask
    assert plays.longest == 5000
    assert reference_plays(player, list(TRAIN_SEEDS)[:8], 2).rows()["input_ids"] == rows["input_ids"][:2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_served_conversations_turns_chain_token_for_token(embedded_backend, sqlite_url, tmp_path):
    """Through the real gateway on the embedded model, an agent's second turn re-sends its
    first reply as a message; the gateway re-renders it, and the play marks the first reply
    trained only where the re-rendered tokens are the ones it sampled. On the retail tools, a
    reply that is a tool call or text: both turns' replies are trained whole."""
    from trace_plugin import Recorder
    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread

    recorder = Recorder(sqlite_url)
    backend = embedded_backend
    task = RetailEnv().reset(list(TRAIN_SEEDS)[0])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": POLICY},
        *EXAMPLES,
        {"role": "user", "content": task.prompt},
    ]
    with start_in_thread(
        create_app(backend, config=GatewayConfig(adapter_root=tmp_path, agent="shop"), recorder=recorder)
    ) as server:

        def call() -> dict[str, Any]:
            r = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={
                    "model": backend.model_id,
                    "messages": messages,
                    "tools": RETAIL_TOOLS,
                    "temperature": 0,
                    "max_tokens": 48,
                },
                headers={"X-Trace-Episode": "served"},
                timeout=300,
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]

        reply = call()
        messages.append({k: v for k, v in reply.items() if v is not None})
        for tool_call in reply.get("tool_calls") or []:
            messages.append(
                {"role": "tool", "tool_call_id": tool_call["id"], "content": '{"error": "not found"}'}
            )
        if not reply.get("tool_calls"):
            messages.append({"role": "user", "content": "Thanks. Anything else?"})
        call()
    assert recorder.flush(10)
    recorder.close()
    store = Store(sqlite_url)
    [episode] = list(store.iter_episodes(EpisodeFilter("shop")))
    first, second = [s.token_ids for s in episode.steps if s.kind == "llm"]
    play = token_play(episode)
    assert play.input_ids == second["prompt"] + second["completions"][0]
    trained = len(first["completions"][0]) + len(second["completions"][0])
    assert sum(play.assistant_mask) == trained, "the first reply did not re-render token for token"
    store.close()
