"""Fine-tuning datasets out of the store (``trace-plugin export dataset``, ``envs export-plays``):
filters and formats on SQLite and PostgreSQL, flat memory over 100,000 episodes, and round
trips through the tools that read them: ``datasets`` and TRL's ``SFTTrainer``, a validator of
OpenAI's fine-tuning format, and the token ids a client of the real gateway received."""

from __future__ import annotations

import json
import math
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from agents import build, find_user, get_order, model_for, user
from support.plays import EXAMPLES
from support.requests import TOOLS
from typer.testing import CliRunner

import trace_plugin
from trace_plugin import Store
from trace_plugin.cli import app
from trace_plugin.environments.interpreter import SpecEnv
from trace_plugin.environments.retail import POLICY, TRAIN_SEEDS, RetailEnv
from trace_plugin.environments.retail import TOOLS as RETAIL_TOOLS
from trace_plugin.environments.synthesis import CapturedInterface, synthesize
from trace_plugin.export import (
    ENDS_ON_TOOL_CALL,
    NO_CONVERSATION,
    NO_TOKEN_IDS,
    REPEATED,
    RUNNING,
    UNPLAYABLE,
    ExportError,
    dataset,
    openai_problems,
    reference_plays,
    write_jsonl,
)
from trace_plugin.records.trajectory import Episode, EpisodeEnd, Step, new_episode_id
from trace_plugin.store.store import EpisodeFilter

T0 = datetime(2026, 3, 1, tzinfo=UTC)
[TOOL] = [t for t in TOOLS if t["function"]["name"] == "get_order"]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_order", "arguments": '{"order_id": "O-1", "email": "ann.lee@example.com"}'},
}
IDS = {"prompt": [1, 2, 3], "completions": [[7, 8, 2]], "logprobs": [[-0.5, -0.25, -0.125]]}


def run(
    name: str,
    minute: int,
    *,
    source: str = "langgraph",
    reward: float | None = None,
    label: str | None = None,
    running: bool = False,
    ends_on_call: bool = False,
    calls_model: bool = True,
    token_ids: dict[str, Any] | None = None,
) -> list[Any]:
    """One recorded episode named in its request: a tool call, its result, then an answer."""
    episode = Episode(new_episode_id(), "shop", source=source, started_at=T0 + timedelta(minutes=minute))
    messages = [
        {"role": "system", "content": "You help with orders."},
        {"role": "user", "content": f"ticket {name}: where is O-1? I am ann.lee@example.com"},
    ]
    asked = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    answered = [*messages, asked, {"role": "tool", "tool_call_id": "c1", "content": "O-1 is pending"}]
    llm: dict[str, Any] = {"kind": "llm", "name": "m", "tools": [TOOL], "token_ids": token_ids}
    steps = [
        Step(episode.id, 0, input={"messages": messages, "tools": ["get_order"]}, output=asked, **llm),
        Step(episode.id, 1, "tool", "get_order", {"order_id": "O-1"}, "O-1 is pending", tool_call_id="c1"),
    ]
    if not ends_on_call:
        reply = {"role": "assistant", "content": f"{name}: O-1 is pending."}
        steps.append(
            Step(episode.id, 2, input={"messages": answered, "tools": ["get_order"]}, output=reply, **llm)
        )
    if not calls_model:
        steps = steps[1:2]
    end = [] if running else [EpisodeEnd(episode.id, "completed", reward=reward, label=label)]
    return [episode, *steps, *end]


@pytest.fixture
def shop(db_url) -> Store:
    """Episodes a to h, a minute apart, newest last: every filter tells some of them apart."""
    store = Store(db_url)
    store.upgrade()
    for records in (
        run("a", 0, reward=1.0),
        run("b", 1, reward=0.0),
        run("c", 2, source="gateway", label="success", token_ids=IDS),
        run("d", 3, source="runner", reward=0.5),
        run("e", 4),  # no outcome
        run("f", 5, reward=0.0, ends_on_call=True),
        run("g", 6, source="mcp-proxy", reward=1.0, calls_model=False),  # tool calls alone
        run("h", 7, running=True),
    ):
        store.write(records)
    yield store
    store.close()


def names(rows: list[dict[str, Any]]) -> list[str]:
    """The episode each row came from, by the ticket its request names."""
    return [re.match(r"ticket (\w)", r["messages"][1]["content"])[1] for r in rows]


def exported(store: Store, **options: Any) -> tuple[list[str], dict[str, int]]:
    rows = dataset(store, "shop", **options)
    return names(list(rows)), dict(rows.left_out)


def test_filters_select_the_episodes_newest_first_and_count_what_they_leave_out(shop):
    assert exported(shop) == (["f", "e", "d", "c", "b", "a"], {RUNNING: 1, NO_CONVERSATION: 1})
    assert exported(shop, format="openai") == (
        ["e", "d", "c", "b", "a"],
        {RUNNING: 1, NO_CONVERSATION: 1, ENDS_ON_TOOL_CALL: 1},
    )
    assert exported(shop, outcome="success") == (["c", "a"], {NO_CONVERSATION: 1})
    assert exported(shop, outcome="failure")[0] == ["f", "d", "b"]
    window = {"since": T0 + timedelta(minutes=2), "until": T0 + timedelta(minutes=5)}
    assert exported(shop, **window)[0] == ["e", "d", "c"]
    naive = {k: v.replace(tzinfo=None) for k, v in window.items()}  # naive means UTC
    assert exported(shop, **naive)[0] == ["e", "d", "c"]
    assert exported(shop, min_reward=0.5)[0] == ["d", "a"]
    assert exported(shop, sources=["gateway", "runner"])[0] == ["d", "c"]
    newest = dataset(shop, "shop", limit=3)  # g, f and e: the newest three finished
    assert (newest.total, names(list(newest)), newest.read) == (3, ["f", "e"], 3)
    assert exported(shop, sources=["mcp-env"]) == ([], {})  # a built-in source that recorded none of them
    # A typo or a non-finite bound once wrote 0 rows and exited 0.
    with pytest.raises(ExportError, match="no episode of 'shop' was recorded by source 'langgraf'"):
        dataset(shop, "shop", sources=["langgraf"])
    for bound in (float("nan"), float("inf")):
        with pytest.raises(ExportError, match="min_reward must be a finite number"):
            dataset(shop, "shop", min_reward=bound)


def test_tokens_rows_are_the_stored_ids_with_the_episode_reward_adapter_and_router(shop):
    rows = dataset(shop, "shop", format="tokens")
    got = list(rows)
    assert rows.left_out == {RUNNING: 1, NO_TOKEN_IDS: 6}
    assert [(r["step"], r["prompt_ids"], r["completion_ids"], r["completion_logprobs"]) for r in got] == [
        (0, [1, 2, 3], [7, 8, 2], [-0.5, -0.25, -0.125]),
        (2, [1, 2, 3], [7, 8, 2], [-0.5, -0.25, -0.125]),
    ]
    assert {(r["reward"], r["adapter"], r["router"]) for r in got} == {(None, None, None)}
    with pytest.raises(ExportError, match="cannot be redacted"):
        dataset(shop, "shop", format="tokens", redact=True)


def test_the_dashboards_episode_page_links_to_that_episodes_export(shop):
    from fastapi.testclient import TestClient

    from trace_plugin.dashboard.app import create_dashboard

    client = TestClient(create_dashboard(shop))
    ids = dict(zip("hgfedcba", [e.id for e in shop.list_episodes("shop")], strict=True))  # newest first
    page = client.get(f"/episodes/{ids['c']}").text
    every = re.findall(r'href="(/export/[^"]+)"', page)
    links = [link for link in every if "?redact=true" not in link]
    assert [link.split("/")[2] for link in links] == ["openai", "trl", "tokens"]
    assert [link.split("/")[2] for link in every if link not in links] == ["openai", "trl"]
    for link, format in zip(links, ("openai", "trl", "tokens"), strict=True):
        served = client.get(link)
        assert served.status_code == 200 and served.headers["content-type"] == "application/jsonl"
        assert served.headers["content-disposition"].startswith("attachment;")
        rows = list(dataset(shop, "shop", format=format))
        expected = (
            [r for r in rows if r["episode_id"] == ids["c"]]
            if format == "tokens"
            else [r for r, name in zip(rows, names(rows), strict=True) if name == "c"]
        )
        assert expected and [json.loads(line) for line in served.text.splitlines()] == expected
    assert client.get(f"/export/csv/{ids['c']}").status_code == 400
    assert client.get("/export/trl/nobody").status_code == 404
    running = client.get(f"/export/trl/{ids['h']}")
    assert running.status_code == 404 and "still running" in running.text


def test_redact_masks_messages_and_arguments_which_still_parse(shop):
    [row] = dataset(shop, "shop", format="openai", outcome="success", sources=["langgraph"], redact=True)
    text = json.dumps(row)
    assert "ann.lee@example.com" not in text and "[EMAIL]" in row["messages"][1]["content"]
    arguments = json.loads(row["messages"][2]["tool_calls"][0]["function"]["arguments"])
    assert arguments == {"order_id": "O-1", "email": "[EMAIL]"}
    [plain] = dataset(shop, "shop", format="openai", outcome="success", sources=["langgraph"])
    assert "ann.lee@example.com" in plain["messages"][1]["content"]


def test_pages_follow_start_time_then_id_through_ties(db_url):
    """Episodes that started at the same instant are each read once, across pages."""
    store = Store(db_url)
    store.upgrade()
    ids = sorted(f"tie-{i:02d}" for i in range(23))
    store.write([Episode(i, "tie", status="completed", started_at=T0) for i in ids])
    store.write([Episode("later", "tie", status="completed", started_at=T0 + timedelta(seconds=1))])
    read = [e.id for e in store.iter_episodes(EpisodeFilter("tie"), page=5)]
    assert read == ["later", *reversed(ids)]
    assert [e.id for e in store.iter_episodes(EpisodeFilter("tie"), limit=12, page=5)] == read[:12]
    store.close()


def test_the_cli_writes_each_format_with_a_progress_bar_and_says_what_it_left_out(shop, tmp_path):
    from datasets import load_from_disk

    def export(*options: str) -> Any:
        result = CliRunner().invoke(app, ["export", "dataset", "--agent", "shop", *options, "--db", shop.url])
        return result

    for typo in (["--source", "langgraf"], ["--min-reward", "nan"]):
        refused = export(*typo, "--out", str(tmp_path / "typo.jsonl"))
        assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
        assert not (tmp_path / "typo.jsonl").exists()
    openai = export("--format", "openai", "--out", str(tmp_path / "o.jsonl"))
    assert openai.exit_code == 0, openai.output
    assert "exporting shop" in openai.output and "wrote 5 row(s) from 7 episode(s)" in openai.output
    for reason in (f"1 episode(s): {RUNNING}", f"1 episode(s): {ENDS_ON_TOOL_CALL}"):
        assert f"left out {reason}" in openai.output
    trl = export("--out", str(tmp_path / "t.jsonl"), "--outcome", "failure", "--source", "langgraph")
    assert trl.exit_code == 0 and "wrote 2 row(s)" in trl.output, trl.output
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert names(lines) == ["f", "b"] and all(isinstance(r["tools"], str) for r in lines)
    hf = export(
        "--format", "hf", "--out", str(tmp_path / "hf"), "--outcome", "failure", "--source", "langgraph"
    )
    assert hf.exit_code == 0, hf.output
    assert load_from_disk(str(tmp_path / "hf")).to_list() == lines
    tokens = export(
        "--format", "tokens", "--out", str(tmp_path / "k.jsonl"), "--since", "2026-03-01 00:02:00"
    )
    assert tokens.exit_code == 0 and "wrote 2 row(s) from 5 episode(s)" in tokens.output, tokens.output
    redacted = export("--redact", "--out", str(tmp_path / "r.jsonl"), "--min-reward", "1")
    assert redacted.exit_code == 0 and "[EMAIL]" in (tmp_path / "r.jsonl").read_text()
    refused = export("--redact", "--format", "tokens", "--out", str(tmp_path / "x.jsonl"))
    assert refused.exit_code == 2 and "cannot be redacted" in refused.output


# -- OpenAI's format ------------------------------------------------------------------------


def test_the_validator_refuses_what_openai_refuses():
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert openai_problems(good) == []
    call = {"id": "x", "type": "function", "function": {"name": "get_order", "arguments": {"order_id": "1"}}}
    bad = [
        {**good, "metadata": {}},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]},
        {"messages": [*good["messages"], {"role": "tool", "content": "x"}]},
        {**good, "tools": json.dumps([TOOL])},
        {"messages": [{"role": "function", "content": "hi"}, good["messages"][1]]},
    ]
    for row in bad:
        assert openai_problems(row), row


def test_openai_rows_of_recorded_runs_pass_the_validator(shop, tmp_path):
    path = tmp_path / "openai.jsonl"
    assert write_jsonl(dataset(shop, "shop", format="openai"), path) == 5
    for line in path.read_text().splitlines():
        assert openai_problems(json.loads(line)) == [], line
    recorded = tmp_path / "langgraph.jsonl"
    assert write_jsonl(dataset(langgraph_runs(tmp_path), "support", format="openai"), recorded) == 2
    for line in recorded.read_text().splitlines():
        assert openai_problems(json.loads(line)) == [], line


# -- TRL and datasets ---------------------------------------------------------------------


def langgraph_runs(tmp_path: Path) -> Store:
    """Two real LangGraph agent runs (LangChain's create_agent, the scripted tool-calling
    model), recorded by capture: parallel calls with their own arguments, then one call."""
    recorder = trace_plugin.Recorder(f"sqlite:///{tmp_path / 'langgraph.db'}")
    for calls in (
        (("get_order", {"order_id": "O-17"}), ("find_user", {"email": "ann@x.io"})),
        (("get_order", {"order_id": "O-9"}),),
    ):
        agent = build("create_agent", model_for(*calls), tools=[get_order, find_user])
        graph = trace_plugin.capture(agent="support", recorder=recorder)(agent)
        graph.invoke(user(f"where is {calls[0][1]['order_id']}?"))
    assert recorder.flush(10)
    recorder.close()
    return Store(f"sqlite:///{tmp_path / 'langgraph.db'}")


@pytest.mark.slow
def test_a_trl_export_of_a_langgraph_run_loads_with_datasets_and_trains_one_sft_step(tmp_path):
    from datasets import load_dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from trace_plugin.model_files import load_model, resolve_model

    path = tmp_path / "trl.jsonl"
    rows = list(dataset(langgraph_runs(tmp_path), "support", format="trl"))
    assert write_jsonl(rows, path) == 2
    assert [len(r["messages"][1]["tool_calls"]) for r in rows] == [1, 2]  # newest first
    loaded = load_dataset("json", data_files=str(path), split="train", cache_dir=str(tmp_path / "cache"))
    assert loaded.to_list() == rows  # each row's arguments as they were, no keys added
    model, tokenizer = load_model(resolve_model())
    full = [
        tokenizer.apply_chat_template(r["messages"], tools=json.loads(r["tools"]), return_dict=True)[
            "input_ids"
        ]
        for r in rows
    ]
    args = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=1,
        per_device_train_batch_size=2,
        max_length=max(map(len, full)),  # TRL's default of 1024 would cut nothing here, but says nothing
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=loaded, processing_class=tokenizer, peft_config=lora
    )
    assert trainer.train_dataset["input_ids"] == full  # rendered by our template, nothing truncated
    trainer.train()
    assert trainer.state.global_step == 1 and math.isfinite(trainer.state.log_history[0]["loss"])


# -- the tokens the client received -----------------------------------------------------------


@pytest.mark.slow
def test_token_ids_in_the_export_are_the_ones_the_client_received(embedded_backend, sqlite_url, tmp_path):
    """Through the real gateway on the embedded model: a call that asked for nothing, one that
    asked for log-probabilities (whose entries carry the token ids), one for token ids, and a
    streamed one; the export holds, for each, the ids the client saw."""
    from trace_plugin import Recorder
    from trace_plugin.gateway.app import GatewayConfig, create_app
    from trace_plugin.gateway.server import start_in_thread

    recorder = Recorder(sqlite_url)
    config = GatewayConfig(adapter_root=tmp_path, agent="served")
    backend = embedded_backend
    bodies = [
        {"messages": [{"role": "user", "content": "Name a color."}]},
        {"messages": [{"role": "user", "content": "Name a fruit."}], "logprobs": True},
        {"messages": [{"role": "user", "content": "Name a city."}], "return_token_ids": True},
        {"messages": [{"role": "user", "content": "Name a tree."}], "logprobs": True, "stream": True},
    ]
    replies = []
    with start_in_thread(create_app(backend, config=config, recorder=recorder)) as server:
        for body in bodies:
            r = httpx.post(
                f"{server.url}/v1/chat/completions",
                json={"model": backend.model_id, "temperature": 0, "max_tokens": 8, **body},
                headers={"X-Trace-Episode": "one-episode"},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            replies.append(r)
    assert recorder.flush(10)
    recorder.close()
    rows = list(dataset(Store(sqlite_url), "served", format="tokens"))
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and {r["episode_id"] for r in rows} == {"one-episode"}

    plain, with_logprobs, with_ids, streamed = replies
    prompt = backend.tokenizer(backend.render(bodies[0]["messages"], None), add_special_tokens=False)
    assert rows[0]["prompt_ids"] == prompt["input_ids"]
    text = plain.json()["choices"][0]["message"]["content"]
    assert backend.tokenizer.decode(rows[0]["completion_ids"], skip_special_tokens=True) == text
    assert rows[0]["completion_logprobs"] is None  # not asked for: not computed
    entries = with_logprobs.json()["choices"][0]["logprobs"]["content"]
    assert rows[1]["completion_ids"] == [e["token_id"] for e in entries]
    assert rows[1]["completion_logprobs"] == [e["logprob"] for e in entries]
    served = with_ids.json()
    assert rows[2]["prompt_ids"] == served["prompt_token_ids"]
    assert rows[2]["completion_ids"] == served["choices"][0]["token_ids"]
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    [last] = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")]
    assert rows[3]["completion_ids"] == [e["token_id"] for e in last["logprobs"]["content"]]


# -- reference plays -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from trace_plugin.model_files import prepare_tokenizer, resolve_model

    return prepare_tokenizer(AutoTokenizer.from_pretrained(resolve_model(), local_files_only=True))


@pytest.mark.parametrize("env", ["retail", "synthesized"])
def test_reference_plays_are_the_warm_starts_token_for_token(env, tokenizer):
    """Rendered by our template, each ``trl`` row is exactly the ids the warm start trains on
    (plus the newline the template writes after the last EOS), and the plays are the same
    seeds', passed over for the same reasons; the ``openai`` rows pass OpenAI's format."""
    from training.episodes import EpisodePlayer
    from training.warm_start import reference_plays as warm_start_plays

    spec = synthesize("argument_grounding", RETAIL_TOOLS, system_prompt=POLICY)
    factory = RetailEnv if env == "retail" else lambda: SpecEnv(spec)
    seeds = list(TRAIN_SEEDS)[:40]
    limits = {"max_turns": 6, "max_observation_chars": 300}  # some results are cut
    player = EpisodePlayer(tokenizer, factory, examples=EXAMPLES, **limits)
    warm = warm_start_plays(player, seeds, len(seeds))
    rows = reference_plays(factory, seeds, examples=EXAMPLES, **limits)
    got = list(rows)
    assert rows.left_out == {k: n for k, n in ((REPEATED, warm.repeated), (UNPLAYABLE, warm.unplayable)) if n}
    assert len(got) == len(warm.plays) > 5
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    for row, play in zip(got, warm.plays, strict=True):
        ids = tokenizer.apply_chat_template(row["messages"], tools=json.loads(row["tools"]), return_dict=True)
        assert ids["input_ids"] == play.prompt_ids + play.completion_ids + newline
    openai = reference_plays(factory, seeds, format="openai", examples=EXAMPLES, **limits)
    lines = [json.dumps(r) for r in openai]
    assert lines and all(openai_problems(json.loads(line)) == [] for line in lines)


def test_export_plays_writes_a_stored_environments_plays_behind_the_agents_examples(sqlite_url, tmp_path):
    store = Store(sqlite_url)
    store.upgrade()
    spec = synthesize("argument_grounding", RETAIL_TOOLS, system_prompt=POLICY)
    store.save_env_spec("shop", spec, "validated", {})
    episode = Episode(new_episode_id(), "shop", status="completed")
    served = [{"role": "system", "content": POLICY}, *EXAMPLES, {"role": "user", "content": "Hi"}]
    store.write(
        [episode, Step(episode.id, 0, "llm", "m", input={"messages": served, "tools": []}, output={})]
    )
    out = tmp_path / "plays.jsonl"
    command = ["envs", "export-plays", spec.name, "--seeds", "0:12", "--out", str(out), "--db", sqlite_url]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    examples = CapturedInterface.from_store(store, "shop").examples
    assert examples and examples[0]["content"] == EXAMPLES[0]["content"]
    expected = reference_plays(
        lambda: SpecEnv(spec), range(12), examples=examples, max_turns=6, max_observation_chars=800
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == list(expected) and lines
    assert f"wrote {len(lines)} reference play(s) of 12 seed(s)" in result.output
    # Usage errors, one line each, before any work: "²" passed str.isdigit and then raised.
    for seeds in ("5:5", "²:5", "1:x"):
        refused = CliRunner().invoke(app, [*command[:3], "--seeds", seeds, *command[5:]])
        assert refused.exit_code == 2 and "A:B" in refused.output and "Traceback" not in refused.output
    for bad_out, says in ((tmp_path / "nowhere" / "p.jsonl", "does not exist"), (tmp_path, "is a folder")):
        refused = CliRunner().invoke(app, [*command[:5], "--out", str(bad_out), *command[7:]])
        assert refused.exit_code == 2 and says in " ".join(refused.output.replace("│", " ").split()), (
            refused.output
        )
        dataset_out = ["export", "dataset", "--agent", "shop", "--out", str(bad_out), "--db", sqlite_url]
        refused = CliRunner().invoke(app, dataset_out)
        assert refused.exit_code == 2 and says in " ".join(refused.output.replace("│", " ").split()), (
            refused.output
        )
    # Seeds are read as they are played: a trillion of them cost nothing up front (a list of
    # them ran out of memory).
    huge = reference_plays(lambda: SpecEnv(spec), range(10**12), max_turns=6, max_observation_chars=800)
    assert huge.total == 10**12 and next(huge) and huge.read < 20
    store.close()


# -- at scale -----------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident set from /proc")
def test_memory_stays_flat_over_100000_episodes(sqlite_url, tmp_path):
    """The resident set, sampled every 2,000 rows, grows by no more after the first 10,000
    rows than a bound that has nothing to do with how many episodes there are (holding the
    rows, or the episodes, would take hundreds of megabytes)."""
    n = 100_000
    store = Store(sqlite_url)
    store.upgrade()
    batch: list[Any] = []
    for i in range(n):
        started = T0 + timedelta(seconds=i)
        episode = Episode(f"e{i:06d}", "big", status="completed", reward=1.0, started_at=started)
        messages = [
            {"role": "system", "content": "Help."},
            {"role": "user", "content": f"Where is order {i}?"},
        ]
        reply = {"role": "assistant", "content": f"Order {i} is pending."}
        llm = {"messages": messages, "tools": ["get_order"]}
        batch += [episode, Step(episode.id, 0, "llm", "m", input=llm, output=reply, tools=[TOOL])]
        if len(batch) >= 20_000:
            store.write(batch)
            batch = []
    rows = dataset(store, "big", format="openai")
    assert rows.total == n
    samples: list[int] = []

    def sampled() -> Any:
        for count, row in enumerate(rows):
            if count % 2_000 == 0:
                samples.append(_rss())
            yield row

    assert write_jsonl(sampled(), tmp_path / "big.jsonl") == n
    settled = samples[5]  # after 10,000 rows: caches and allocator arenas in place
    assert max(samples[5:]) - settled < 16 * 2**20, [s // 2**20 for s in samples]
    store.close()


def test_every_openai_line_passes_the_validator_or_its_episode_is_left_out_by_reason(db_url, tmp_path):
    """11 of 16 hostile stored episodes wrote lines OpenAI refuses, and the command exited 0:
    OpenAI refuses a whole file over one bad line. Now each bad episode is left out, counted
    by why."""
    store = Store(db_url)
    store.upgrade()

    def stored(name: str, messages: list[Any], reply: Any) -> None:
        episode = Episode(new_episode_id(), "hostile", started_at=T0)
        step = Step(episode.id, 0, "llm", "m", input={"messages": messages}, output=reply)
        store.write([episode, step, EpisodeEnd(episode.id, "completed", reward=1.0)])

    ask = {"role": "user", "content": "ticket x: where is O-1?"}
    bad_call = {**CALL, "function": {"name": "get_order", "arguments": "order O-1, please"}}
    stored("fine", [ask], {"role": "assistant", "content": "O-1 is pending."})
    stored("non-JSON arguments", [ask, {"role": "assistant", "content": None, "tool_calls": [bad_call]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "pending"}],
           {"role": "assistant", "content": "pending"})  # fmt: skip
    stored("empty reply", [ask], {"role": "assistant", "content": ""})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    stored("image only", [{"role": "user", "content": [image]}], {"role": "assistant", "content": "A cat."})
    rows = dataset(store, "hostile", format="openai")
    path = tmp_path / "openai.jsonl"
    assert write_jsonl(rows, path) == 1
    assert all(openai_problems(json.loads(line)) == [] for line in path.read_text().splitlines())
    assert dict(rows.left_out) == {
        "not OpenAI's format: arguments are not a JSON object": 1,
        "not OpenAI's format: an assistant message with neither content nor tool calls": 1,
        "not OpenAI's format: user content is not a non-empty string": 1,
    }
    assert write_jsonl(dataset(store, "hostile", format="trl"), tmp_path / "trl.jsonl") == 4  # TRL takes them
    store.close()


def test_redacted_exports_mask_numbers_and_keys_and_arguments_stay_json(db_url):
    """``--redact`` left card and phone numbers given as JSON numbers and e-mails used as
    keys unmasked, and turned the arguments ``"\\"x@y.com\\""`` into ``[EMAIL]``, no longer
    JSON. (OpenAI takes only objects as arguments: that episode is TRL's alone.)"""
    from support.pii import HOSTILE_PII, UNMASKED

    store = Store(db_url)
    store.upgrade()
    for arguments in (json.dumps(HOSTILE_PII), '"x@y.com"'):
        episode = Episode(new_episode_id(), "pii", started_at=T0)
        call = {"id": "c1", "type": "function", "function": {"name": "pay", "arguments": arguments}}
        messages = [
            {"role": "user", "content": "pay with 4111 1111 1111 1111"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "paid"},
        ]
        step = Step(
            episode.id,
            0,
            "llm",
            "m",
            input={"messages": messages},
            output={"role": "assistant", "content": "Done."},
        )
        store.write([episode, step, EpisodeEnd(episode.id, "completed", reward=1.0)])
    for format in ("openai", "trl"):
        rows = list(dataset(store, "pii", format=format, redact=True))
        assert len(rows) == (1 if format == "openai" else 2)
        text = json.dumps(rows)
        assert not any(value in text for value in [*UNMASKED, "x@y.com", "4111 1111"]), format
        parsed = [r["messages"][1]["tool_calls"][0]["function"]["arguments"] for r in rows]
        if format == "openai":  # JSON text that still parses
            parsed = [json.loads(p) for p in parsed]
        pay = next(p for p in parsed if isinstance(p, dict))
        assert pay["card"] == "[CARD]" and pay["phone"] == "[PHONE]" and pay["order"] == 1234567
        assert {"[EMAIL]", "[EMAIL]#2"} <= set(pay)
        assert format == "openai" or "[EMAIL]" in parsed
    store.close()
