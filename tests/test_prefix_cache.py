"""Prefix caching in the embedded backend: which prefixes are kept, and that a cached prefix
changes no token of any reply, for the base model and an adapter in one batch."""

from __future__ import annotations

import asyncio

import pytest

from trace_plugin.chat_template import REPLY_FORBIDDEN
from trace_plugin.environments.retail import TEST_SEEDS, RetailEnv
from trace_plugin.gateway.backend import SamplingParams
from trace_plugin.gateway.embedded import EmbeddedBackend
from trace_plugin.gateway.prefix_cache import PrefixCache, boundary_cut
from trace_plugin.generation import common_length, continuation_batch
from training.lora import random_adapter

TURN = 1  # the boundary token in the pure tests


def test_a_prefix_ends_before_a_turn_inside_the_shared_part():
    a, b = (5, 1, 7, 1, 8, 9), (5, 1, 7, 1, 8, 3)
    assert common_length(a, b) == 5
    assert boundary_cut(a, 5, TURN) == 3  # not 5: the prefix stops where a turn starts
    assert boundary_cut(a, 1, TURN) == 1  # (5,) is shared, and a turn starts right after it
    assert boundary_cut(a, 0, TURN) == 0
    assert boundary_cut(a, len(a), TURN) == 3  # a prompt never caches all of itself


def test_a_prefix_may_also_end_after_a_line():
    line = 2  # the line-end token in this test
    a = (5, 6, 2, 7, 2, 8, 1, 9)
    assert boundary_cut(a, 5, TURN, frozenset({line})) == 5  # just after the second line end
    assert boundary_cut(a, 4, TURN, frozenset({line})) == 3
    assert boundary_cut(a, 4, TURN) == 0  # without line ends, only a turn start cuts


def test_a_continuation_batch_keeps_the_cached_prefix_in_place_and_pads_after_it():
    ids, mask = continuation_batch([(7, 8, 1, 2), (7, 8, 3), (7, 8, 4, 5, 6)], [2, 2, 2], pad=0)
    assert ids == [[7, 8, 0, 1, 2], [7, 8, 0, 0, 3], [7, 8, 4, 5, 6]]
    assert mask == [[1, 1, 0, 1, 1], [1, 1, 0, 0, 1], [1, 1, 1, 1, 1]]


def test_rows_may_skip_different_lengths_each_padded_to_the_longest_prefix():
    ids, mask = continuation_batch([(7, 8, 9, 1), (7, 3, 4), (5, 6)], [3, 1, 0], pad=0)
    # cached width 3, then the longest remainder (2 tokens): 5 columns
    assert ids == [[7, 8, 9, 0, 1], [7, 0, 0, 3, 4], [0, 0, 0, 5, 6]]
    assert mask == [[1, 1, 1, 0, 1], [1, 0, 0, 1, 1], [0, 0, 0, 1, 1]]


def test_entries_are_per_adapter_longest_first_and_evicted_oldest_first():
    cache = PrefixCache(TURN, capacity=2, min_tokens=2)
    opening, turn = (5, 6, 7), (5, 6, 7, 1, 8, 9)
    assert cache.wanted((*turn, 1, 4), [(*turn, 1, 3)]) == len(turn)
    assert cache.wanted((*opening, 1, 4), [(9, 9, 9)]) == 0  # nothing shared yet
    cache.put(None, opening, "kv-opening")
    cache.put(None, turn, "kv-turn")
    assert cache.longest(None, (*turn, 1, 2)) == (turn, "kv-turn")
    assert cache.longest(None, (*opening, 2)) == (opening, "kv-opening")
    assert cache.longest(None, (*opening, 1, 2)) == ((*opening, 1), "kv-turn")  # the turn holds more of it
    assert cache.longest("expert", (*turn, 1, 2)) is None  # another adapter's keys differ
    assert cache.longest(None, opening) == (opening[:2], "kv-opening")  # a prompt keeps a token to run
    cache.longest(None, (*turn, 1, 2))  # the turn is the most recently used
    cache.put("expert", opening, "kv-expert")  # evicts the least recently used: the opening
    assert len(cache) == 2 and cache.longest(None, (*opening, 2)) == (opening, "kv-turn")
    cache.drop("expert")
    assert cache.longest("expert", (*opening, 1)) is None


def test_a_prompt_reuses_the_longest_token_prefix_any_entry_shares_and_room_is_counted_in_tokens():
    """A kept conversation re-rendered with its reply tokenized otherwise still lends the
    tokens before the difference; entries past the token budget are evicted oldest first."""
    cache = PrefixCache(TURN, max_tokens=12, min_tokens=3)
    conversation = (5, 6, 7, 1, 8, 9, 3)  # prompt and reply, as generated
    cache.put(None, conversation, "kv-conversation")
    assert cache.longest(None, (5, 6, 7, 1, 8, 4, 4, 1, 2)) == ((5, 6, 7, 1, 8), "kv-conversation")
    assert cache.longest(None, (5, 6, 2)) is None  # under min_tokens once a token is left to run
    cache.put(None, (5, 6, 7, 2, 2), "kv-other")  # 12 tokens in all: both fit
    assert len(cache) == 2
    cache.put(None, (5, 6, 7, 1), "kv-turn")  # 16: the oldest goes
    assert len(cache) == 2 and cache.longest(None, (*conversation, 2))[1] == "kv-turn"


def tickets(backend: EmbeddedBackend, n: int) -> list[str]:
    """The support agent's first prompt (policy, tools, ticket) on ``n`` retail tickets."""
    prompts = []
    for seed in list(TEST_SEEDS)[:n]:
        env = RetailEnv()
        task = env.reset(seed)
        messages = [
            {"role": "system", "content": env.system_prompt},
            {"role": "user", "content": task.prompt},
        ]
        prompts.append(backend.render(messages, env.tools))
    return prompts


@pytest.mark.slow
def test_cached_prefixes_change_no_token(tmp_path, monkeypatch):
    import torch
    from peft import PeftModel

    backend = EmbeddedBackend(precision="float32")
    pristine = {name: p.detach().clone() for name, p in backend.model.named_parameters()}
    # A mild adapter: random_adapter's default scale is chaotic enough that float noise of 1e-3
    # in the keys (a different matmul shape) flips a greedy token within a few steps.
    random_adapter(backend.model_dir, tmp_path / "expert", seed=3, scale=4.0)
    asyncio.run(backend.load_adapter("expert", tmp_path / "expert"))
    prompts = tickets(backend, 4)
    # A second turn of the first conversation: its opening is the first turn.
    prompts.append(
        prompts[0] + '<tool_call>\n{"name": "get_order", "arguments": {}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n"not found"\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    adapters = [None, "expert", None, "expert", None]
    params = SamplingParams(max_tokens=24, bad_words=REPLY_FORBIDDEN)
    cache, backend.prefix_cache = backend.prefix_cache, None
    reference = backend.generate_rows(prompts, adapters, params)
    backend.prefix_cache = cache
    first = backend.generate_rows(prompts[:2], adapters[:2], params)  # builds the shared opening
    rest = backend.generate_rows(prompts[2:], adapters[2:], params)  # runs on it
    assert [c.token_ids for c in first + rest] == [c.token_ids for c in reference]
    assert [c.prompt_token_ids for c in first + rest] == [c.prompt_token_ids for c in reference]
    assert cache.stats.hits == 5 and cache.stats.tokens_reused > 5 * 300
    assert len({c.text for c in reference}) > 1  # the rows are not all the same reply
    base = backend.generate_rows(prompts[1:2], [None], params)[0]
    assert base.token_ids != reference[1].token_ids  # the adapter does change the reply
    # Batches with one adapter, or none, skip PEFT's mixed-batch split (the adapter folded
    # into the base weights, or every adapter off): same tokens.
    # Nor does any step take PEFT's model-wide status check (``disable_adapter()`` does).
    backend.prefix_cache = None
    checks = []
    status = PeftModel.get_model_status
    monkeypatch.setattr(PeftModel, "get_model_status", lambda self: checks.append(1) or status(self))
    alone = {a: [i for i, b in enumerate(adapters) if b == a] for a in (None, "expert")}
    for adapter, rows in alone.items():
        single = backend.generate_rows([prompts[i] for i in rows], [adapter] * len(rows), params)
        assert [c.token_ids for c in single] == [reference[i].token_ids for i in rows]
    assert not checks
    # The fold is undone by the next batch without it, and by unloading: no weight drifts.
    assert backend.generate_rows(prompts[1:2], [None], params)[0].token_ids == base.token_ids
    backend.generate_rows(prompts[1:2], ["expert"], params)
    asyncio.run(backend.unload_adapter("expert"))
    assert all(torch.equal(p, pristine[name]) for name, p in backend.model.named_parameters())


@pytest.mark.slow
def test_requests_offering_their_own_tools_reuse_what_they_share_and_change_no_token():
    """Per-request tools render inside the system turn: rows part at different tool lines,
    each skips what it shares, a row sharing nothing skips nothing, and no token changes."""
    backend = EmbeddedBackend(precision="float32")
    env = RetailEnv()
    task = env.reset(TEST_SEEDS[0])
    by_name = {t["function"]["name"]: t for t in env.tools}
    names = sorted(by_name)

    def prompt(tools: list[str], system: str = env.system_prompt) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task.prompt}]
        return backend.render(messages, [by_name[n] for n in tools])

    warm = [  # earlier traffic: entries end after one tool line, after two, and after a whole opening
        prompt(names[:2] + names[4:5]),
        prompt(names[:2] + names[5:6]),
        prompt(names[:1] + names[6:7]),
        prompt(names[:3]),
        prompt(names[:3]),
    ]
    batch = [
        prompt(names[:2] + names[7:8]),  # reuses two tool lines
        prompt(names[:1] + names[3:4]),  # one
        prompt(names[:3]),  # its whole opening
        prompt(names[:2], system="Answer briefly."),  # nothing: another policy
    ]
    params = SamplingParams(max_tokens=16, bad_words=REPLY_FORBIDDEN)
    cache, backend.prefix_cache = backend.prefix_cache, None
    reference = backend.generate_rows(batch, [None] * 4, params)
    backend.prefix_cache = cache
    backend.generate_rows(warm, [None] * len(warm), params)
    rows = [tuple(ids) for ids in backend.tokenizer(batch, add_special_tokens=False).input_ids]
    reusable = [len(entry[0]) if (entry := cache.longest(None, ids)) else 0 for ids in rows]
    assert reusable[3] == 0 and len(set(reusable[:3])) == 3 and min(reusable[:3]) > 64
    hits, reused = cache.stats.hits, cache.stats.tokens_reused
    assert [c.token_ids for c in backend.generate_rows(batch, [None] * 4, params)] == [
        c.token_ids for c in reference
    ]
    assert cache.stats.hits == hits + 3 and cache.stats.tokens_reused >= reused + sum(reusable)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_conversations_next_turn_continues_from_its_kept_reply_and_changes_no_token():
    """Sixteen conversations' second turns all hit their own first turns, reply included
    (the old cache held 8 openings and rebuilt each turn's history), with the same tokens."""
    backend = EmbeddedBackend(precision="float32", max_batch=16)
    params = SamplingParams(max_tokens=12, bad_words=REPLY_FORBIDDEN)
    firsts = tickets(backend, 16)
    replies = backend.generate_rows(firsts, [None] * 16, params)
    seconds = [
        first + reply.text + '<|im_end|>\n<|im_start|>user\n<tool_response>\n"not found"\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
        for first, reply in zip(firsts, replies, strict=True)
    ]
    stats = backend.prefix_cache.stats
    before = stats.tokens_reused
    kept = backend.generate_rows(seconds, [None] * 16, params)
    # Each second turn reused its whole first prompt and most of its reply.
    assert stats.tokens_reused - before >= sum(
        len(r.prompt_token_ids) + len(r.token_ids) // 2 for r in replies
    )
    backend.prefix_cache = None
    assert [c.token_ids for c in kept] == [
        c.token_ids for c in backend.generate_rows(seconds, [None] * 16, params)
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_idle_engine_gives_its_prefix_cache_back_and_builds_it_again_when_asked():
    """After ``idle_release_s`` without a request the cache is empty (a gateway beside a
    training run holds no keys and values); the next requests build it again."""
    import time

    backend = EmbeddedBackend(precision="float32", idle_release_s=0.5)
    prompts = tickets(backend, 2)
    params = SamplingParams(max_tokens=4, bad_words=REPLY_FORBIDDEN)
    first = backend.generate_rows(prompts, [None, None], params)
    assert len(backend.prefix_cache) >= 1
    deadline = time.monotonic() + 30
    while len(backend.prefix_cache) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(backend.prefix_cache) == 0
    again = backend.generate_rows(prompts, [None, None], params)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert len(backend.prefix_cache) >= 1
