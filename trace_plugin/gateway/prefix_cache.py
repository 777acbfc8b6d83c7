"""Automatic prefix caching for the embedded backend, as vLLM does it on GPUs.

Agent traffic repeats itself: every request of a deployed agent opens with the same system
prompt, tool schemas and worked examples (about 1,350 tokens for the retail agent), and
each turn of a conversation repeats the turn before. On a CPU the prompt's forward pass
costs more than the reply (2.3 s for 1,400 tokens of SmolLM2-135M here, against 2.1 s for
50 generated tokens), so the backend keeps the keys and values of recently seen prefixes
and runs only each prompt's new tokens.

A prefix is cut at a message boundary (just before an ``<|im_start|>``) or at the end of a
line inside the longest prefix a prompt shares with a recent one, so one entry serves
every ticket of an agent. A finished reply keeps its whole conversation (prompt and reply
but the last token) as an entry of its own, so the conversation's next turn runs only the
tool result; a prompt reuses the longest token prefix it shares with any entry, since a
re-rendered assistant turn need not tokenize as it was generated. Line ends matter
for agents whose tools differ per request: the template lists every tool, one per line,
inside the system turn, so two such requests part there, and a line cut still reuses
the policy and every tool line they share. Entries are per adapter: a LoRA on the
attention projections changes the keys and values. Only the choice of prefixes is here
(pure functions of token ids); the tensors stay opaque to this module, and running a
batch on them is ``trace_plugin.generation``'s.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trace_plugin.generation import Ids, common_length


def boundary_cut(
    ids: Sequence[int], length: int, boundary: int, line_ends: frozenset[int] = frozenset()
) -> int:
    """The longest prefix of ``ids[:length]`` that ends just before a ``boundary`` token or
    just after one of ``line_ends``, or 0."""
    for i in range(min(length, len(ids) - 1), 0, -1):
        if ids[i] == boundary or ids[i - 1] in line_ends:
            return i
    return 0


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0  # prompts that asked
    hits: int = 0  # prompts that ran on a cached prefix
    tokens_reused: int = 0  # prompt tokens not recomputed
    entries_built: int = 0


class PrefixCache:
    """Up to ``capacity`` entries of keys and values holding at most ``max_tokens`` tokens
    in all, least recently used evicted first.

    The default room is the demo's and the benchmarks': 16 concurrent conversations of
    about 1,600 tokens each, their shared opening, and a turn to spare (about 0.75 GB in
    bf16 for SmolLM2-135M).
    """

    def __init__(
        self,
        boundary: int,
        *,
        line_ends: frozenset[int] = frozenset(),
        capacity: int = 64,
        max_tokens: int = 32_768,
        min_tokens: int = 64,
        recent: int = 16,
    ) -> None:
        self.boundary = boundary  # a prefix may end before it (the chat template's turn start)
        self.line_ends = line_ends  # or after one of these (tokens whose text ends a line)
        self.capacity, self.max_tokens = capacity, max_tokens
        self.min_tokens = min_tokens  # shorter shared prefixes are not worth an entry
        self._entries: OrderedDict[tuple[str | None, Ids], Any] = OrderedDict()
        self._recent: deque[Ids] = deque(maxlen=recent)
        self.stats = CacheStats()

    def longest(self, adapter: str | None, ids: Ids) -> tuple[Ids, Any] | None:
        """The longest prefix of ``ids`` that an entry for ``adapter`` holds (leaving ``ids``
        a token to run), and that entry's keys and values: they may run past the prefix,
        whose length says how many of them to use."""
        best: tuple[int, Ids] | None = None
        for owner, prefix in list(self._entries):
            if owner != adapter:
                continue
            shared = min(common_length(prefix, ids), len(ids) - 1)
            if shared >= self.min_tokens:  # in use: the opening stays as fresh as the turns on it
                self._entries.move_to_end((owner, prefix))
                if best is None or shared > best[0]:
                    best = (shared, prefix)
        if best is None:
            return None
        shared, prefix = best
        return ids[:shared], self._entries[(adapter, prefix)]

    def wanted(self, ids: Ids, others: Sequence[Ids]) -> int:
        """The length of the prefix worth caching for ``ids``: its longest boundary-cut prefix
        shared with ``others`` (the rest of its batch) or a recent prompt; 0 if under ``min_tokens``."""
        shared = max((common_length(ids, other) for other in [*others, *self._recent]), default=0)
        cut = boundary_cut(ids, shared, self.boundary, self.line_ends)
        return cut if cut >= self.min_tokens else 0

    def put(self, adapter: str | None, prefix: Ids, kv: Any) -> None:
        self._entries[(adapter, prefix)] = kv
        self._entries.move_to_end((adapter, prefix))
        self.stats.entries_built += 1
        while len(self._entries) > self.capacity or (
            len(self._entries) > 1 and sum(len(p) for _, p in self._entries) > self.max_tokens
        ):
            self._entries.popitem(last=False)

    def seen(self, ids: Ids) -> None:
        """Remember a prompt, so that the next one sharing its opening can cache it."""
        if ids not in self._recent:
            self._recent.append(ids)

    def drop(self, adapter: str) -> None:
        """Forget an adapter's entries (it was unloaded; a new one may reuse the name)."""
        for key in [k for k in self._entries if k[0] == adapter]:
            del self._entries[key]

    def clear(self) -> None:
        """Forget every entry (the engine went idle: the memory goes back)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def line_end_tokens(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokens whose text ends a line (a dozen in SmolLM2's vocabulary)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if text.endswith("\n"))
