"""The LLM analyzer, through litellm's real client with scripted answers (``mock_response``),
and once against the real SmolLM2-135M behind the embedded gateway."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import litellm
import pytest

from trace_plugin.environments.planted import corpus
from trace_plugin.environments.retail import TRAIN_SEEDS
from trace_plugin.gateway.app import GatewayConfig, create_app
from trace_plugin.gateway.server import start_in_thread
from trace_plugin.mining.analyzer import (
    Candidate,
    LiteLLMComplete,
    LLMAnalyzer,
    Stats,
    analyze_episodes,
    render_episode,
)
from trace_plugin.mining.kinds import KINDS
from trace_plugin.mining.miner import mine_episodes
from trace_plugin.mining.selection import SelectionRule
from trace_plugin.records.trajectory import Episode, Step, new_id
from trace_plugin.store import Store

INVENTED = "#W9999999"  # the id the invents_ids policy writes to
Messages = list[dict[str, str]]
Answer = Callable[[Messages, dict[str, Any]], str]
Garbage = str | Exception | Callable[[str], str]


def blocks(prompt: str) -> dict[str, str]:
    """The rendered episodes of a prompt, by alias."""
    parts = re.split(r"\n\n(?=\[e\d+\])", prompt)
    return {re.match(r"\[(e\d+)\]", p).group(1): p for p in parts}


class Analyst:
    """A scripted analyst that reads the prompts as a model would: it spots invented ids in
    the calls, proposes a capability for them plus an irrelevant one, and labels the
    irrelevant one at random and the real one with some noise."""

    def __init__(self, noise: float = 0.05, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.noise = noise
        self.seen: set[str] = set()

    def __call__(self, messages: Messages, schema: dict[str, Any]) -> str:
        episodes = blocks(messages[1]["content"])
        self.seen |= set(episodes)
        if schema["name"] == "capabilities":
            invented = [a for a, text in episodes.items() if INVENTED in text and "outcome: failure" in text]
            capabilities = [
                {
                    "name": "argument_grounding",
                    "description": "Uses only ids the user gave or a tool returned. "
                    "An id in a call that appears nowhere earlier was invented.",
                    "examples": invented[:3],
                },
                {
                    "name": "greets_politely",
                    "description": "Opens the final answer with a greeting. Look at its first words.",
                    "examples": list(episodes)[:1],
                },
            ]
            return json.dumps({"capabilities": capabilities})
        assert "outcome:" not in messages[1]["content"]  # the labeler is blind to outcomes
        labels = {}
        for alias, text in episodes.items():
            grounding = "NA" if "call 1:" not in text else "LACKING" if INVENTED in text else "PRESENT"
            if grounding != "NA" and self.rng.random() < self.noise:
                grounding = "PRESENT" if grounding == "LACKING" else "LACKING"
            labels[alias] = {
                "argument_grounding": grounding,
                "greets_politely": self.rng.choice(["NA", "PRESENT", "LACKING"]),
            }
        return json.dumps(labels)


class Script:
    """Answers through ``litellm.completion(..., mock_response=...)``; the calls numbered in
    ``garbage`` get that answer instead (an exception is raised by litellm), or the answer
    it makes of the right one."""

    def __init__(self, answer: Answer, garbage: dict[int, Garbage] | None = None) -> None:
        self.answer = answer
        self.garbage = garbage or {}
        self.calls: list[Messages] = []

    def __call__(self, messages: Messages, schema: dict[str, Any]) -> str:
        self.calls.append(messages)
        n = len(self.calls)
        reply = self.garbage.get(n, self.answer(messages, schema))
        if callable(reply):
            reply = reply(self.answer(messages, schema))
        return LiteLLMComplete("openai/analyst", mock_response=reply)(messages, schema)


def spoil(**fields: Any) -> Callable[[str], str]:
    """Garbage made of a right labeling answer: ``fields`` replace its first episode's labels."""

    def make(answer: str) -> str:
        labels = json.loads(answer)
        labels[next(iter(labels))].update(fields)
        return json.dumps(labels)

    return make


def failure() -> Episode:
    """One planted episode that failed."""
    return corpus([list(TRAIN_SEEDS)[1]], ("invents_ids",))[0]


def planted(
    seeds: int, policies: tuple[str, ...] = ("competent", "distractor", "invents_ids")
) -> list[Episode]:
    return corpus(list(TRAIN_SEEDS)[:seeds], policies)


def assert_consistent(stats: Stats) -> None:
    assert stats.calls == stats.requests + stats.retries
    assert stats.invalid + stats.errors == stats.retries + stats.dropped


def test_render_keeps_the_evidence_and_cuts_the_rest():
    episode = failure()
    text = render_episode(episode, "e7")
    assert text.startswith("[e7] outcome: failure, reward 0.00\nuser: ")
    assert "call 1: find_user(" in text and INVENTED in text and "final answer: Done" in text
    assert "outcome" not in render_episode(episode, "e7", show_outcome=False)

    long = looping(20, argument="x" * 500, result="y" * 5000)
    text = render_episode(long, "e1")
    assert len(text) < 4100 and "chars cut) …" in text  # the middle goes, both ends stay
    assert text.startswith("[e1] outcome: failure, reward 0.00\nuser: Cancel order #W1.\ncall 1: get_order(")
    assert "call 20: get_order(" in text and "call 7:" not in text and "(+4840 chars)" in text
    assert "ERROR Error: EEE" in text and "the real reason" in text  # errors are cut later than results
    assert text.endswith(
        "final answer: (none)\nstatus: error\nagent error: Timeout: " + "z" * 391 + "… (+1609 chars)"
    )

    text = render_episode(looping(20, argument="x", result="y"), "e1")
    assert "chars cut" not in text and "call 6: get_order" in text and "… 8 calls omitted …" in text
    assert "call 7:" not in text and "call 15: get_order" in text


def looping(calls: int, *, argument: str, result: str) -> Episode:
    """An episode that calls one tool ``calls`` times, the last call failing, and crashes."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Cancel order #W1."}]
    for i in range(calls):
        call = {"id": f"c{i}", "function": {"name": "get_order", "arguments": json.dumps({"id": argument})}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        content = "Error: " + "E" * 300 + " the real reason" if i == calls - 1 else result
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": content})
    episode = Episode(new_id(), "a", status="error", error="Timeout: " + "z" * 2000, reward=0.0)
    episode.steps = [Step(episode.id, 0, "llm", "m", input={"messages": messages}, output={"content": None})]
    return episode


def test_a_scripted_run_over_the_planted_corpus_selects_the_planted_capability():
    episodes = planted(16)  # 48 episodes: 30 go to discovery in 2 calls, then 10 runs of 6 batches
    script = Script(Analyst(), garbage={3: "Sure! Here are the labels.", 20: '{"e999": {}}'})
    analysis = analyze_episodes(episodes, script, batch_size=8)

    stats = analysis.stats
    assert (stats.requests, stats.retries, stats.invalid, stats.dropped, stats.errors) == (62, 2, 2, 0, 0)
    assert stats.calls == len(script.calls) == 64 and stats.unlabeled == 0
    assert_consistent(stats)
    assert "unknown episode ids e999" in script.calls[20][-1]["content"]

    [top, other] = analysis.capabilities
    assert (top.name, top.selected, other.name, other.selected) == (
        "argument_grounding",
        True,
        "greets_politely",
        False,
    )
    assert top.source == "llm" and top.description.startswith("Uses only ids")
    assert top.metrics["passed"] == 10 and top.metrics["coverage"] > 0.8 and top.metrics["contrast"] > 0.8
    by_id = {e.id: e for e in episodes}
    assert len(top.examples) == 5
    assert all(
        by_id[i].label == "failure" and by_id[i].metadata["policy"] == "invents_ids" for i in top.examples
    )
    assert set(top.tools) & {"cancel_order", "modify_address", "return_items", "exchange_items"}
    assert top.metrics["llm"]["calls"] == 64
    offline = mine_episodes(episodes)[0].metrics
    assert set(offline) <= set(top.metrics) and top.metrics["rule"] == offline["rule"]
    assert analysis.candidates[0].examples and all(
        by_id[i].label == "failure" for i in analysis.candidates[0].examples
    )


def test_garbage_is_retried_with_the_problem_stated_then_dropped_and_counted():
    episodes = planted(6, ("competent", "invents_ids"))  # 12 episodes: one discovery call, 3 batches a run
    garbage: dict[int, Garbage] = {
        1: "The agent seems to invent ids.",  # not JSON
        # run 1, batch 1: three bad answers, then dropped
        3: spoil(argument_grounding="MAYBE"),  # a bad label
        4: '{"labels": [{"episode": "e1", "label": "LACKING"}]}',  # wrong shape
        5: '{"e999": {"argument_grounding": "NA", "greets_politely": "NA"}}',  # an unknown episode
        6: RuntimeError("provider down"),  # run 1, batch 2: an error, then a good answer
        9: spoil(teleportation="NA"),  # run 2, batch 1: an unknown capability, then a good answer
    }
    script = Script(Analyst(noise=0), garbage)
    analysis = analyze_episodes(episodes, script, rule=SelectionRule(k=1, n=2), batch_size=4)

    stats = analysis.stats
    assert stats.requests == 1 + 2 * 3 and stats.calls == len(script.calls) == 12
    assert (stats.retries, stats.invalid, stats.errors, stats.dropped, stats.unlabeled) == (5, 5, 1, 1, 4)
    assert "unknown capabilities teleportation" in stats.last_problem
    assert_consistent(stats)

    retry = script.calls[1]  # the discovery question again, with the bad answer and the problem
    assert retry[:2] == script.calls[0] and retry[2] == {"role": "assistant", "content": garbage[1]}
    assert "not a JSON object" in retry[3]["content"]
    assert (
        "argument_grounding: Input should be 'NA', 'PRESENT' or 'LACKING'" in script.calls[3][-1]["content"]
    )
    assert "wrong shape" in script.calls[4][-1]["content"] and len(script.calls[4]) == 6
    assert len(script.calls[6]) == 2  # after an error, the question is asked again as it was

    [top, _] = analysis.capabilities
    assert top.name == "argument_grounding" and top.selected and top.metrics["runs"] == 2
    assert top.metrics["llm"]["dropped"] == 1


def test_nothing_usable_leaves_no_capabilities_and_counts_it_all():
    episodes = planted(3, ("competent", "invents_ids"))
    analysis = analyze_episodes(episodes, Script(lambda m, s: "no"))
    stats = analysis.stats
    assert analysis.capabilities == analysis.candidates == []
    assert (stats.requests, stats.calls, stats.retries, stats.dropped) == (1, 3, 2, 1)
    assert_consistent(stats)

    analyst = Analyst()
    only_discovery = Script(lambda m, s: analyst(m, s) if s["name"] == "capabilities" else "[]")
    analysis = analyze_episodes(episodes, only_discovery, runs=2, batch_size=4, retries=0)
    assert analysis.capabilities == [] and [c.name for c in analysis.candidates][0] == "argument_grounding"
    assert (analysis.stats.dropped, analysis.stats.unlabeled) == (4, 2 * len(episodes))
    assert_consistent(analysis.stats)


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ('{"capabilities": [{"name": "Bad Name", "description": "d", "examples": []}]}', "snake_case"),
        (
            '{"capabilities": [{"name": "a_b", "description": "d", "examples": ["e42"]}]}',
            "unknown episode ids e42",
        ),
        (
            '{"capabilities": [{"name": "a_b", "description": "d"}]}',
            "capabilities.0.examples: Field required",
        ),
        (
            json.dumps(
                {"capabilities": [{"name": f"c{i}", "description": "d", "examples": []} for i in range(11)]}
            ),
            "at most 10",
        ),
        (
            json.dumps({"capabilities": [{"name": "c", "description": "d", "examples": []}] * 2}),
            "repeated names: c",
        ),
    ],
)
def test_discovery_answers_are_validated(answer, problem):
    script = Script(lambda m, s: answer)
    stats = analyze_episodes([failure()], script, retries=1).stats
    assert (stats.calls, stats.invalid, stats.dropped) == (2, 2, 1)
    assert problem in script.calls[1][-1]["content"], script.calls[1][-1]["content"]


def drop(path: str) -> Callable[[str], str]:
    """Garbage made of a right labeling answer: its first episode (``"episode"``) or that
    episode's first label (``"label"``) left out."""

    def make(answer: str) -> str:
        labels = json.loads(answer)
        first = next(iter(labels))
        if path == "episode":
            del labels[first]
        else:
            del labels[first][next(iter(labels[first]))]
        return json.dumps(labels)

    return make


@pytest.mark.parametrize(
    ("garbage", "problem"),
    [
        ("", "not a JSON object"),
        ('["e1", "LACKING"]', "not a JSON object"),
        ('{"e1": ["LACKING"]}', "wrong shape or labels: e1: Input should be a valid dictionary"),
        (
            spoil(argument_grounding="lacking"),
            "argument_grounding: Input should be 'NA', 'PRESENT' or 'LACKING'",
        ),
        (spoil(teleportation="NA"), "unknown capabilities teleportation"),
        (drop("label"), "capabilities not labeled: argument_grounding"),
        (drop("episode"), "episodes not labeled: e"),
        ('{"e1": {}, "e2": {}, "e3": {}, "e4": {}, "e5": {}}', "unknown episode ids e5"),
    ],
)
def test_labeling_answers_are_validated(garbage, problem):
    episodes = planted(2, ("invents_ids", "competent"))
    candidates = [Candidate(n, "d") for n in ("argument_grounding", "greets_politely")]
    script = Script(Analyst(), {1: garbage})
    analysis = analyze_episodes(episodes, script, runs=1, retries=1, candidates=candidates)
    assert (analysis.stats.calls, analysis.stats.invalid, analysis.stats.dropped) == (2, 1, 0)
    assert problem in script.calls[1][-1]["content"], script.calls[1][-1]["content"]
    assert analysis.capabilities[0].metrics["runs"] == 1


def test_examples_are_the_failures_most_runs_agree_lack_it():
    episodes = planted(6, ("invents_ids",))
    failed = [f"e{i + 1}" for i, e in enumerate(episodes) if e.label == "failure"]
    doubted, seen = failed[0], Counter[str]()
    analyst = Analyst(noise=0)

    def answer(messages: Messages, schema: dict[str, Any]) -> str:
        labels = json.loads(analyst(messages, schema))
        if doubted in labels and schema["name"] == "labels":
            seen[doubted] += 1
            labels[doubted]["argument_grounding"] = "LACKING" if seen[doubted] == 1 else "PRESENT"
        return json.dumps(labels)

    [top, _] = analyze_episodes(episodes, Script(answer), runs=3).capabilities
    by_alias = {f"e{i + 1}": e.id for i, e in enumerate(episodes)}
    assert top.examples == [by_alias[a] for a in failed[1:]]


def test_fenced_json_and_given_candidates_need_no_discovery():
    episodes = planted(2, ("invents_ids",))
    names = ["argument_grounding", "termination"]

    def fenced(messages: Messages, schema: dict[str, Any]) -> str:
        labels = {a: dict.fromkeys(names, "LACKING") for a in blocks(messages[1]["content"])}
        return "Here you go:\n```json\n" + json.dumps(labels) + "\n```"

    candidates = [Candidate(n, KINDS[n].description) for n in names]
    script = Script(fenced)
    analysis = analyze_episodes(episodes, script, runs=3, candidates=candidates)
    assert analysis.stats.invalid == 0 and analysis.stats.requests == 3 == len(script.calls)
    system = script.calls[0][0]["content"]
    assert KINDS["termination"].description in system
    assert KINDS["precondition_verification"].description not in system
    assert [c.name for c in analysis.capabilities] == ["argument_grounding", "termination"]


def test_structured_output_is_requested_where_litellm_knows_it_works(monkeypatch):
    sent: list[dict[str, Any]] = []
    real = litellm.completion

    def recording(**kwargs: Any) -> Any:
        sent.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(litellm, "completion", recording)
    schema = {"name": "labels", "strict": True, "schema": {"type": "object"}}
    messages = [{"role": "user", "content": "hi"}]
    assert LiteLLMComplete("gpt-4o-mini", mock_response="{}")(messages, schema) == "{}"
    assert LiteLLMComplete("openai/my-server", mock_response="{}", max_tokens=5)(messages, schema) == "{}"
    assert sent[0]["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert "response_format" not in sent[1] and sent[1]["max_tokens"] == 5

    sent.clear()
    episodes = planted(2, ("invents_ids", "competent"))
    analyze_episodes(episodes, LiteLLMComplete("gpt-4o-mini", mock_response="{}"), runs=1, retries=0)
    discovery = sent[0]["response_format"]["json_schema"]
    items = discovery["schema"]["properties"]["capabilities"]["items"]
    assert discovery["strict"] and set(items["properties"]["examples"]["items"]["enum"]) == {
        "e1",
        "e2",
        "e3",
        "e4",
    }


def test_the_analyzer_mines_stored_episodes_and_saves_them(sqlite_url, monkeypatch):
    store = Store(sqlite_url)
    store.upgrade()
    episodes = planted(10)
    unknown = Episode(new_id(), "planted", status="completed")  # no outcome: not mined
    for e in [*episodes, unknown]:
        store.write([e, *e.steps])

    analyst = Analyst()
    sent: list[dict[str, Any]] = []
    real = litellm.completion

    def scripted(**kwargs: Any) -> Any:  # the analyst answers whatever litellm was asked
        sent.append(kwargs)
        schema = {
            "name": "capabilities"
            if "capabilities it lacks" in kwargs["messages"][0]["content"]
            else "labels"
        }
        return real(**kwargs, mock_response=analyst(kwargs["messages"], schema))

    monkeypatch.setattr(litellm, "completion", scripted)
    analyzer = LLMAnalyzer(
        store, "openai/analyst", options={"api_base": "http://127.0.0.1:9/v1", "api_key": "k"}
    )
    capabilities = analyzer.mine("planted")

    assert all(kwargs["api_base"] == "http://127.0.0.1:9/v1" for kwargs in sent)
    # 30 episodes: two discovery calls of 15, then 10 runs of 4 batches
    assert len(sent) == analyzer.stats.calls == analyzer.stats.requests == 2 + 10 * 4
    assert analyst.seen == {f"e{i}" for i in range(1, 31)}
    stored = store.capabilities("planted")
    assert (
        [c.name for c in stored]
        == [c.name for c in capabilities]
        == ["argument_grounding", "greets_politely"]
    )
    assert [c.selected for c in stored] == [True, False] and {c.source for c in stored} == {"llm"}
    assert (
        stored[0].mining_run == capabilities[0].mining_run and stored[0].examples == capabilities[0].examples
    )
    assert stored[0].metrics["llm"]["model"] == "openai/analyst" and stored[0].metrics["llm"]["calls"] == len(
        sent
    )
    assert all(store.get_episode(i).label == "failure" for i in stored[0].examples)
    store.close()


@pytest.mark.slow
def test_a_real_model_run_through_the_gateway_completes_and_its_counts_add_up(embedded_backend):
    """SmolLM2-135M cannot do this job: only the plumbing and the bookkeeping are checked.
    Kept to a few short calls: on two CPU cores each takes seconds."""
    episodes = planted(2, ("invents_ids",))  # one success, one failure
    rule = SelectionRule(k=1, n=2)
    with start_in_thread(create_app(embedded_backend, config=GatewayConfig(record=False))) as server:
        complete = LiteLLMComplete(
            f"openai/{embedded_backend.model_id}",
            api_base=server.url + "/v1",
            api_key="unused",
            max_tokens=32,
        )
        # a retry is a multi-turn conversation: the bad answer, then what was wrong with it
        found = analyze_episodes(episodes, complete, rule=rule, runs=1, retries=1)
        labeled = analyze_episodes(  # two runs at once: the gateway batches them
            episodes,
            complete,
            rule=rule,
            runs=2,
            retries=0,
            concurrency=2,
            candidates=[Candidate(n, KINDS[n].description) for n in ("argument_grounding", "termination")],
        )
    for analysis in (found, labeled):
        print(analysis.stats, [(c.name, c.selected, c.metrics["runs"]) for c in analysis.capabilities])
        assert analysis.stats.errors == 0  # every call reached the model and came back
        assert_consistent(analysis.stats)
    assert found.stats.requests == 1 + bool(found.candidates)  # discovery, then one run of one batch
    assert labeled.stats.requests == labeled.stats.calls == 2
    assert labeled.stats.unlabeled == 2 * labeled.stats.dropped
    assert len(labeled.capabilities) == (2 if labeled.stats.dropped < 2 else 0)
