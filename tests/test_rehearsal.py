"""The warm start's rehearsal: the deployed agent's successful conversations, rendered as
serving rendered each turn, trained beside an environment's reference plays so that an
expert keeps what the agent already does right (``export.successful_conversations``,
``EpisodePlayer.served``)."""

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
from trace_plugin.export import Conversation, conversation, successful_conversations
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Step, new_episode_id
from trace_plugin.store.store import EpisodeFilter

T0 = datetime(2026, 3, 1, tzinfo=UTC)
OPENING = [{"role": "system", "content": POLICY}, *EXAMPLES]  # every episode's: the agent's context


@pytest.fixture(scope="module")
def player() -> Any:
    from transformers import AutoTokenizer

    from trace_plugin.model_files import prepare_tokenizer, resolve_model
    from training.episodes import EpisodePlayer

    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True))
    return EpisodePlayer(tokenizer, RetailEnv, max_turns=6, max_observation_chars=300, examples=EXAMPLES)


def write(store: Store, request: str, minute: int, reward: float) -> None:
    """An episode of two model calls: a tool call on ``request``, then the answer."""
    episode = Episode(new_episode_id(), "shop", started_at=T0 + timedelta(minutes=minute))
    asked = [*OPENING, {"role": "user", "content": request}]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_order", "arguments": '{"order_id": "#W1"}'},
    }
    first = {"role": "assistant", "content": "", "tool_calls": [call]}
    result = {"role": "tool", "tool_call_id": "c1", "content": '{"status": "pending"}'}
    steps = [
        Step(episode.id, 0, "llm", "m", input={"messages": asked, "tools": []}, output=first),
        Step(episode.id, 1, "tool", "get_order", {"order_id": "#W1"}, result["content"], tool_call_id="c1"),
        Step(
            episode.id,
            2,
            "llm",
            "m",
            input={"messages": [*asked, first, result], "tools": []},
            output={"role": "assistant", "content": f"{request}: pending"},
        ),
    ]
    store.write([episode, *steps, EpisodeEnd(episode.id, "completed", reward=reward)])


def test_successful_conversations_are_the_newest_successes_each_once_and_none_evaluated(db_url):
    """Newest first; a failure, an episode before ``since``, one repeating an earlier
    request (spacing and case aside) and one holding an evaluated request are left out. The
    worked examples, user messages in every episode, do not make the episodes one."""
    store = Store(db_url)
    store.upgrade()
    write(store, "old success", 0, 1.0)
    write(store, "Cancel order #W1", 1, 1.0)
    write(store, "a failure", 2, 0.0)
    write(store, "  cancel ORDER  #W1 ", 4, 1.0)
    write(store, "an evaluated task", 5, 1.0)
    write(store, "return item", 6, 1.0)
    since = T0 + timedelta(minutes=1)
    exclude = {request_key("An evaluated  task")}
    found = successful_conversations(store, "shop", 10, since=since, exclude=exclude)
    assert [c.messages[len(OPENING)]["content"] for c in found] == ["return item", "  cancel ORDER  #W1 "]
    assert all(c.opening == len(OPENING) + 1 for c in found)  # the first call's messages
    assert len(successful_conversations(store, "shop", 1, since=since)) == 1
    assert successful_conversations(store, "other", 10) == []
    store.close()


def test_a_rehearsed_conversation_trains_the_models_replies_and_not_its_worked_examples(player):
    """The examples' assistant messages are context (the agent sent them); the two replies
    its model wrote are trained, each as the template writes it; the tool result between
    them is not."""
    request = {"role": "user", "content": "Where is order #W1?"}
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_order", "arguments": '{"order_id": "#W1"}'},
    }
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"status": "pending"}'},
        {"role": "assistant", "content": "It is pending."},
    ]
    opening = [*OPENING, request]
    played = player.served(Conversation([*opening, *replies], RETAIL_TOOLS, len(opening)))
    tokenizer = player.tokenizer
    trained = [t for t, m in zip(played.completion_ids, played.env_mask, strict=True) if m]
    text = tokenizer.decode(trained)
    assert text.count("<|im_end|>") == 2 and "get_order" in text and "It is pending." in text
    assert 'pending"}' not in text  # the tool result
    assert played.turns == 2
    example_reply = next(m["content"] for m in EXAMPLES if m["role"] == "assistant" and m.get("content"))
    assert example_reply[:20] not in text and example_reply[:20] in tokenizer.decode(played.prompt_ids)
    assert player.served(Conversation(opening, RETAIL_TOOLS, len(opening))) is None  # no reply of its own


def said(reply: str) -> Conversation:
    """A one-reply conversation the agent served."""
    asked = [*OPENING, {"role": "user", "content": "Hi"}]
    return Conversation([*asked, {"role": "assistant", "content": reply}], RETAIL_TOOLS, len(asked))


def test_the_warm_start_trains_on_its_rehearsal_beside_the_plays_none_longer_than_they(player):
    """The SFT rows are the plays' then the rehearsal's; a conversation longer than the
    longest play is left out, so the trainer's ``max_length`` (its memory) is the plays'."""
    from training.warm_start import reference_plays

    alone = reference_plays(player, list(TRAIN_SEEDS)[:8], 2)
    plays = reference_plays(
        player, list(TRAIN_SEEDS)[:8], 2, rehearsal=[said("Hello!"), said("Help. " * 2000)]
    )
    rows = plays.rows()
    assert len(plays.plays) == 2 and len(plays.rehearsal) == 1 and len(rows["input_ids"]) == 3
    assert rows["input_ids"][:2] == alone.rows()["input_ids"] and plays.longest == alone.longest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_warm_start_batch_holds_plays_or_rehearsed_conversations_not_both(player, tmp_path):
    """The loss pass runs a batch's common opening once, and a play and a rehearsed
    conversation share none: the trainer's own data loader gives batches of one kind, every
    row once an epoch, in an order the same epoch repeats (a resumed run skips what it
    trained) and the next epoch reshuffles."""
    from trace_plugin.model_files import load_model, resolve_model
    from training.config import ExpertTrainingConfig
    from training.warm_start import WarmStartTrainer

    config = ExpertTrainingConfig(warm_start_plays=8, warm_start_epochs=1, warm_start_batch_size=4)
    rehearsal = [said(f"Reply number {i}.") for i in range(4)]
    warm = WarmStartTrainer(config, player, list(TRAIN_SEEDS), tmp_path, rehearsal=rehearsal, progress=False)
    plays = warm.plays()
    assert (len(plays.plays), len(plays.rehearsal)) == (8, 4)
    model, _ = load_model(resolve_model())
    trainer = warm.build(model, plays)
    kind = {tuple(ids): k for ids, k in zip(plays.rows()["input_ids"], plays.kinds, strict=True)}
    orders = []
    for epoch in (0, 0, 1):
        loader = trainer.get_train_dataloader()
        loader.set_epoch(epoch)
        seen = []
        for batch in loader:
            rows = [
                tuple(ids[mask == 1].tolist())
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
            ]
            assert len({kind[row] for row in rows}) == 1
            seen += rows
        assert sorted(seen) == sorted(kind)
        orders.append(seen)
    assert orders[0] == orders[1] != orders[2]


def test_whole_batches_of_one_kind_come_first_and_the_rest_of_each_kind_last():
    from training.warm_start import BatchesOfOneKind

    kinds = [0] * 6 + [1] * 3
    order = list(BatchesOfOneKind(kinds, 4, seed=7))
    assert sorted(order) == list(range(9))
    assert len({kinds[i] for i in order[:4]}) == 1 and sorted(kinds[i] for i in order[4:]) == [0, 0, 1, 1, 1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_served_conversation_renders_as_the_gateway_served_it_token_for_token(
    embedded_backend, sqlite_url, tmp_path, player
):
    """Through the real gateway on the embedded model, an agent's two turns on a retail
    ticket: the conversation the store holds, rendered for rehearsal, is the ids the gateway
    served, and the replies it trains are the ones the model sampled."""
    from trace_plugin import Recorder
    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread

    recorder = Recorder(sqlite_url)
    backend = embedded_backend
    task = RetailEnv().reset(list(TRAIN_SEEDS)[0])
    messages: list[dict[str, Any]] = [*OPENING, {"role": "user", "content": task.prompt}]
    app = create_app(backend, config=GatewayConfig(adapter_root=tmp_path, agent="shop"), recorder=recorder)
    with start_in_thread(app) as server:

        def call() -> dict[str, Any]:
            body = {"model": backend.model_id, "messages": messages, "tools": RETAIL_TOOLS}
            r = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={**body, "temperature": 0, "max_tokens": 48},
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
    played = player.served(conversation(episode))
    assert played.prompt_ids == first["prompt"]
    # Through the second turn's prompt (the first reply as the gateway re-rendered it), the
    # very ids served; the replies trained are the sampled text, as the template tokenizes
    # it (a sampled "\n" "\n" may be one "\n\n" token), a reply cut at max_tokens ending there.
    full = played.prompt_ids + played.completion_ids
    assert full[: len(second["prompt"])] == second["prompt"]
    tokenizer, sampled = player.tokenizer, first["completions"][0] + second["completions"][0]
    trained = [t for t, m in zip(played.completion_ids, played.env_mask, strict=True) if m]
    cut = "" if sampled[-1] == player.eos else tokenizer.eos_token
    assert tokenizer.decode(trained) == tokenizer.decode(sampled) + cut
    store.close()


def test_the_rehearsal_is_a_share_of_the_warm_starts_plays():
    """A quarter by default: the quick demo's 48 plays rehearse up to 12 conversations, and
    the tests' two plays none, so they cost what they did."""
    from training.config import ExpertTrainingConfig

    assert ExpertTrainingConfig(warm_start_plays=48).rehearsal_plays == 12
    assert ExpertTrainingConfig(warm_start_plays=2).rehearsal_plays == 0
    assert ExpertTrainingConfig(warm_start_plays=48, rehearsal_share=0).rehearsal_plays == 0
    with pytest.raises(ValueError, match="rehearsal_share"):
        ExpertTrainingConfig(rehearsal_share=1.5)
