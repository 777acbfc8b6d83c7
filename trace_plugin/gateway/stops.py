"""Stop strings found as text streams in, at a cost independent of how many there are.

The stop strings become one Aho-Corasick automaton: each new character moves it one state
on (with amortized-constant fallbacks), so a token's worth of text costs the same for one
stop string or for many. transformers' ``stop_strings`` instead preprocesses every stop
string against the whole vocabulary, on the worker thread every request waits for.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class StopMatcher:
    """The first place any of ``stops`` completes in a text, fed in pieces or whole."""

    def __init__(self, stops: Iterable[str]) -> None:
        self._goto: list[dict[str, int]] = [{}]
        self._longest = [0]  # the longest stop string ending at each state (0: none)
        self._depth = [0]  # how many characters of a stop string each state has matched
        for stop in stops:
            state = 0
            for char in stop:
                if char not in self._goto[state]:
                    self._goto[state][char] = len(self._goto)
                    self._goto.append({})
                    self._longest.append(0)
                    self._depth.append(self._depth[state] + 1)
                state = self._goto[state][char]
            self._longest[state] = len(stop)
        # Each state falls back to the state of its longest proper suffix that is a prefix of some stop.
        self._fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for char, child in self._goto[state].items():
                fallback = self._fail[state]
                while fallback and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                self._fail[child] = self._goto[fallback].get(char, 0)
                self._longest[child] = self._longest[child] or self._longest[self._fail[child]]
                queue.append(child)

    def feed(self, text: str, state: int = 0) -> tuple[int, int | None]:
        """Continue from ``state`` through ``text``: the state reached and, if a stop string
        completes, where in ``text`` it ends (scanning stops there)."""
        goto, fail, longest = self._goto, self._fail, self._longest
        for i, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if longest[state]:
                return state, i + 1
        return state, None

    def pending(self, state: int) -> int:
        """How many characters at the end of the text read so far may begin a stop string:
        a stream holds them back until they complete one or stop matching."""
        return self._depth[state]

    def stop_length(self, state: int) -> int:
        """The length of the stop string that completed on reaching ``state``."""
        return self._longest[state]

    def cut(self, text: str) -> str | None:
        """``text`` before the first stop string to complete in it (the longest one ending
        there); None when none does."""
        state, end = self.feed(text)
        return None if end is None else text[: end - self.stop_length(state)]
