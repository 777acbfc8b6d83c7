"""The synthesizer: a mined capability plus the target's captured interface -> an ``EnvSpec``.

Offline and deterministic. From the target's tool schemas alone it infers entities (every
``<noun>_id`` parameter names a table keyed by it), binds each tool to a behaviour by its
name's verb (``get_order(order_id)`` looks up, ``find_user(email, ...)`` lists,
``cancel_order(order_id, reason)`` is a guarded update, ``transfer_*`` terminates) and
fills columns from the parameters that act on them. Values captured in production (id
formats, enums) replace the typed defaults where they were observed.

A template family per capability kind then writes tickets whose reference actions
exercise that capability, and a reward program aimed at it: valid calls for
``tool_call_format``, grounded follow-up lookups for ``argument_grounding``, read before
write for ``precondition_verification``, forbidden writes for ``policy_refusal``, and so on.
Where the tools give a family nothing to work with (stateless tools, no ids), the generic
family of ``schema_requests`` exercises the calls themselves,
so any tool with an object schema yields an environment.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trace_plugin.chat_template import arguments_object, content_text
from trace_plugin.environments.schema_requests import phrasing, requests
from trace_plugin.mining.detectors import Trajectory, guess_role, name_words
from trace_plugin.mining.kinds import KINDS, FamilyName
from trace_plugin.records.env_spec import (
    MAX_COLUMNS,
    MAX_SHAPE_DEPTH,
    MAX_TEMPLATES,
    MAX_TEXT,
    WRITES,
    Action,
    Check,
    Column,
    EnvSpec,
    Slot,
    SpecError,
    Table,
    TaskTemplate,
    ToolSpec,
    check_spec,
)
from trace_plugin.store import Store

STATUSES = ["pending", "active", "closed"]  # used when no status values were observed
# ``order_id``, ``item_ids``, and qualified ones: ``new_item_ids`` names item ids too.
_ID_PARAM = re.compile(r"^(?:[a-z0-9_]*_)?(?P<noun>[a-z][a-z0-9]*?)_ids?$")
_POOLS: dict[str, list[str]] = {
    "first_name": ["Ava", "Liam", "Mia", "Noah", "Zoe", "Omar", "Ines", "Kenji"],
    "last_name": ["Lopez", "Kim", "Novak", "Okafor", "Silva", "Chen", "Weber", "Rossi"],
    "city": ["Austin", "Denver", "Boston", "Seattle", "Miami"],
    "address1": ["12 Oak St", "48 Pine Ave", "7 Maple Rd", "301 Cedar Ln", "95 Elm Dr"],
    "reason": ["no longer needed", "ordered by mistake"],
    "summary": ["customer needs help"],
}


@dataclass(frozen=True, slots=True)
class Precondition:
    """Tools that must succeed before a write goes through, and the target's error without them."""

    tools: tuple[str, ...]
    error: str


@dataclass(frozen=True, slots=True)
class Observations:
    """What production traffic showed: argument and result values by name, the statuses
    each write tool's target had when it went through (its guard), and how users worded
    requests that one call answered."""

    values: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # write tool -> the statuses its target had when a call of it went through
    guards: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # tool -> requests that one call of it answered, its argument values as {name}s
    phrasings: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # write tool -> the tools the target refused it without, and its words when it did
    preconditions: Mapping[str, Precondition] = field(default_factory=dict)
    requests: Sequence[str] = ()  # what the target's users asked, word for word
    # tool -> the skeleton of its answers (``result_shape``): how the target lays them out
    shapes: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_calls(cls, calls: Iterable[tuple[dict[str, Any], Any]]) -> Observations:
        """From (arguments, parsed result) pairs of captured tool steps."""
        seen: dict[str, set[str]] = {}

        def visit(value: Any, name: str) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    visit(inner, key)
            elif isinstance(value, list):
                for inner in value:
                    visit(inner, name.removesuffix("s") if name.endswith("_ids") else name)
            elif isinstance(value, str) and name and len(value) <= 80:
                seen.setdefault(name, set()).add(value)

        for arguments, result in calls:
            visit(arguments, "")
            visit(result, "")
        return cls({k: sorted(v)[:32] for k, v in seen.items()})


def observed_guards(trajectories: Iterable[Trajectory]) -> dict[str, list[str]]:
    """Per write tool, the statuses its target row showed (in an earlier result of the same
    episode) when a call of it went through: the guard the target's own traffic shows, where
    the alphabetically first status seen anywhere ("cancelled") contradicted the policy."""
    guards: dict[str, set[str]] = {}
    for t in trajectories:
        status_of: dict[str, str] = {}  # id -> the status a result last showed for it
        for call in t.calls:
            ids = [v for k, v in call.arguments.items() if k.endswith("_id") and isinstance(v, str)]
            if guess_role(call.name) == "write" and not call.error and ids and ids[0] in status_of:
                guards.setdefault(call.name, set()).add(status_of[ids[0]])
            for row in _rows(arguments_object(call.result)):
                status = row.get("status")
                for key, value in row.items():
                    if key.endswith("_id") and isinstance(value, str) and isinstance(status, str):
                        status_of[value] = status
    return {name: sorted(statuses) for name, statuses in guards.items()}


def result_shape(value: Any, name: str = "", depth: int = 0) -> Any:
    """A captured answer's skeleton: every value replaced by its key's name, a list by its
    first item's skeleton. ``{"order_id": "#W1", "address": {"zip": "02108"}}`` becomes
    ``{"order_id": "order_id", "address": {"zip": "zip"}}``, the interpreter's ``returns``."""
    if isinstance(value, dict) and depth < MAX_SHAPE_DEPTH:
        return {str(k): result_shape(v, str(k), depth + 1) for k, v in list(value.items())[:MAX_COLUMNS]}
    if isinstance(value, list) and depth < MAX_SHAPE_DEPTH:
        return [result_shape(value[0], name.removesuffix("s"), depth + 1)] if value else []
    return name


def observed_shapes(trajectories: Iterable[Trajectory]) -> dict[str, Any]:
    """Per tool, the skeleton most of its answers that went through had: the target's
    ``find_user`` answers one user id, its ``get_order`` an order with its address nested."""
    counts: dict[str, Counter[str]] = {}
    for t in trajectories:
        for call in t.calls:
            if not call.error:
                shape = json.dumps(result_shape(arguments_object(call.result)))
                counts.setdefault(call.name, Counter())[shape] += 1
    return {name: json.loads(count.most_common(1)[0][0]) for name, count in counts.items()}


def observed_preconditions(trajectories: Iterable[Trajectory], policy: str = "") -> dict[str, Precondition]:
    """Per write tool, what the target refused it without, from one same error seen twice at
    least (so that one refusal's own cause is not taken for a rule): the tools that had
    succeeded before every call of it that went through and before none of those refusals;
    where no call went through, the tools the target's ``policy`` (its system prompt) names
    in a sentence worded like the error. So "identify the user before changing an order",
    and the policy's "Identify the user with find_user before changing anything", make
    ``find_user`` a precondition of the write."""
    went_through: dict[str, set[str]] = {}  # write -> tools that succeeded before each of its successes
    refused: dict[str, dict[str, list[set[str]]]] = {}  # write -> error -> what had succeeded before each
    tools: set[str] = set()
    for t in trajectories:
        tools |= t.tools_offered | {call.name for call in t.calls}
        succeeded: set[str] = set()
        for call in t.calls:
            if guess_role(call.name) == "write":
                if not call.error:
                    went_through[call.name] = went_through.get(call.name, succeeded) & succeeded
                elif (error := _error_text(call.result)) is not None:
                    refused.setdefault(call.name, {}).setdefault(error, []).append(set(succeeded))
            if not call.error:
                succeeded = succeeded | {call.name}
    found: dict[str, Precondition] = {}
    for write, errors in refused.items():
        for error, priors in sorted(errors.items(), key=lambda item: -len(item[1])):
            if len(priors) < 2:
                break
            if write in went_through:
                missing = set.intersection(*(went_through[write] - prior for prior in priors)) - {write}
            else:
                missing = {t for t in _named_beside(policy, error, tools) if guess_role(t) != "write"}
            if missing:
                found[write] = Precondition(tuple(sorted(missing)), error)
                break
    for write in went_through.keys() - found.keys():
        found[write] = Precondition((), "")  # it went through, and no refusal says what it needs
    return found


_FILLER = frozenset({"with", "that", "this", "from", "have", "your", "only", "what", "when", "then", "into"})


def _named_beside(policy: str, error: str, tools: set[str]) -> set[str]:
    """The tools named in a sentence of ``policy`` that shares two words or more with ``error``."""
    words = lambda text: {w for w in re.findall(r"[a-z]+", text.lower()) if len(w) >= 4} - _FILLER  # noqa: E731
    said = words(error)
    named: set[str] = set()
    for sentence in re.split(r"(?<=[.!?;])\s+|\n", policy):
        if len(words(sentence) & said) >= 2:
            named |= {t for t in tools if re.search(rf"(?<![\w]){re.escape(t)}(?![\w])", sentence)}
    return named


def _error_text(result: str) -> str | None:
    """The message of a tool's error result (``{"error": "..."}`` or plain text)."""
    parsed = arguments_object(result)
    message = parsed.get("error") if isinstance(parsed, dict) else result
    return message.strip()[:200] if isinstance(message, str) and message.strip() else None


def observed_phrasings(trajectories: Iterable[Trajectory], most: int = 4) -> dict[str, list[str]]:
    """Per tool, the commonest requests that one successful call of it answered, with the
    call's values as ``{argument}`` placeholders (``phrasing``): the generic family words
    its tickets so, where it would otherwise dictate each argument."""
    counts: dict[str, Counter[str]] = {}
    for t in trajectories:
        if len(t.calls) == 1 and not t.calls[0].error:
            [call] = t.calls
            if (text := phrasing(t.user, call.arguments)) is not None:
                counts.setdefault(call.name, Counter())[text] += 1
    return {name: [text for text, _ in found.most_common(most)] for name, found in counts.items()}


def _rows(value: Any) -> Iterable[dict[str, Any]]:
    """Every object inside a parsed result."""
    if isinstance(value, dict):
        yield value
        for inner in value.values():
            yield from _rows(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _rows(inner)


def id_pattern(examples: Sequence[str], noun: str) -> str:
    """A generator pattern for ids like the observed ones: digit runs become ``{dN}``."""
    if examples:
        return re.sub(r"\d+", lambda m: f"{{d{min(len(m[0]), 12)}}}", examples[0])
    return f"{noun[:1].upper()}{{d6}}"


@dataclass
class Interface:
    """The target's tools, analysed once: entities, and each tool's table and behaviour."""

    tools: list[dict[str, Any]]
    observations: Observations = field(default_factory=Observations)
    tables: dict[str, Table] = field(default_factory=dict)
    bindings: dict[str, ToolSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        columns: dict[str, dict[str, Column]] = {}
        for schema in self.tools:
            function = schema.get("function", schema)
            for noun in _nouns(function):
                columns.setdefault(noun, {f"{noun}_id": self._id_column(noun)})
        for schema in self.tools:
            function = schema.get("function", schema)
            name = function.get("name", "")
            noun = _target(function, columns)
            if noun is not None:
                for param in _params(function):
                    if not _ID_PARAM.match(param):
                        columns[noun].setdefault(param, self._column(param))
                if guess_role(name) == "write":
                    columns[noun].setdefault("status", self._status())
        self.tables = {noun: Table(key=f"{noun}_id", columns=cols, rows=4) for noun, cols in columns.items()}
        for schema in self.tools:
            binding = self._bind(schema)
            if binding is not None:
                self.bindings[binding.name] = binding
        for name, binding in list(self.bindings.items()):
            precondition = self._precondition(binding) if binding.behaviour == "update" else None
            requires = (
                [t for t in precondition.tools if t in self.bindings and t != name] if precondition else []
            )
            if precondition is not None and requires:
                update = {"requires": requires, "requires_error": precondition.error}
                self.bindings[name] = binding.model_copy(update=update)

    def _precondition(self, write: ToolSpec) -> Precondition | None:
        """What the traffic showed ``write`` needs; for a write it says nothing about, what
        another write on its table needs ("identify the user before changing anything")."""
        shown = self.observations.preconditions
        if write.name in shown:
            return shown[write.name]
        return next(
            (
                shown[other.name]
                for other in self.bindings.values()
                if other.behaviour == "update"
                and other.table == write.table
                and other.name in shown
                and shown[other.name].tools
            ),
            None,
        )

    def _id_column(self, noun: str) -> Column:
        examples = self.observations.values.get(f"{noun}_id", ())
        return Column(kind="id", pattern=id_pattern(examples, noun))

    def param_column(self, param: str) -> Column:
        """How to generate a value the user gives for ``param`` in a ticket."""
        match = _ID_PARAM.match(param)
        return self._id_column(match["noun"]) if match else self._column(param)

    def _status(self) -> Column:
        observed = list(self.observations.values.get("status", ()))
        return Column(kind="choice", values=observed if len(observed) >= 2 else STATUSES)

    def _column(self, param: str) -> Column:
        observed = list(self.observations.values.get(param, ()))
        # One or two values of what identifies a person seen (one user's email) would give
        # every row the same value, and a search by it would find them all: we make more.
        identifying = param in ("email", "first_name", "last_name") or "zip" in param
        if observed and (len(observed) >= 3 or not identifying):
            return Column(kind="choice" if len(observed) <= 8 else "text", values=observed)
        if param in _POOLS:
            return Column(kind="text", values=_POOLS[param])
        if param == "email":
            # Users state their emails in their requests, where the agent's calls seldom
            # show them: made-up ones ("mia.novak@…") looked unlike "noah.okafor37@…",
            # which an expert then read as a first and a last name.
            stated = sorted(
                {e for r in self.observations.requests for e in _EMAIL.findall(r) if len(e) <= 80}
            )[:32]
            made = [f"{f.lower()}.{ln.lower()}@example.com" for f, ln in _pairs()]
            return Column(kind="text", values=stated if len(stated) >= 3 else made)
        if "zip" in param or "code" in param:
            return Column(kind="id", pattern="{d5}")
        return Column(kind="text", values=[f"{param.replace('_', ' ')} {i}" for i in range(1, 6)])

    def _bind(self, schema: dict[str, Any]) -> ToolSpec | None:
        function = schema.get("function", schema)
        name, params = function.get("name", ""), _params(function)
        required = set((function.get("parameters") or {}).get("required", []))
        if name_words(name)[:1] == ["transfer"]:
            return ToolSpec(schema=schema, behaviour="terminate")
        noun = _target(function, {n: {} for n in self.tables})
        if noun is None:
            return None
        key = f"{noun}_id"
        role = guess_role(name)
        shape = self.observations.shapes.get(name)
        laid = shape if isinstance(shape, dict) and len(json.dumps(shape)) <= MAX_TEXT else None
        if role == "read" and key in required:
            if required - {key}:  # a lookup passes the key alone: its call would break the schema
                return None
            return ToolSpec(schema=schema, behaviour="lookup", table=noun, key=key, returns=laid)
        if role == "read":
            filters = {p: p for p in params if p in self.tables[noun].columns}
            one = key if isinstance(shape, str) else None  # the target answered one match, not a list
            return (
                ToolSpec(schema=schema, behaviour="list", table=noun, filters=filters, returns=one)
                if filters
                else None
            )
        if role == "write" and key in required:
            statuses = list(self.tables[noun].columns["status"].values)
            sets = {p: f"${p}" for p in params if p != key and p in self.tables[noun].columns}
            guard = [s for s in self.observations.guards.get(name, ()) if s in statuses] or _open(statuses)
            return ToolSpec(
                schema=schema,
                behaviour="update",
                table=noun,
                key=key,
                guard={"status": guard},
                sets={**sets, "status": _done_status(name_words(name)[0], statuses)},
                returns=laid,
            )
        return None


_OPEN = ("pending", "open", "active", "new", "draft", "created", "processing")


def _open(statuses: Sequence[str]) -> list[str]:
    """The guard when traffic showed no write going through: the first status that reads as
    still open to change, else the first."""
    return [next((s for s in statuses if s.lower() in _OPEN), statuses[0])] if statuses else []


def synthesize(
    capability: str,
    tools: list[dict[str, Any]],
    *,
    system_prompt: str,
    observations: Observations | None = None,
    description: str = "",
    hint: str | None = None,
    generic: bool = False,
) -> EnvSpec:
    """An environment aimed at ``capability`` that keeps the target's tool schemas; with
    ``generic``, the generic family's requests whatever the capability's family."""
    interface = Interface(tools, observations or Observations())
    kind = KINDS.get(capability)
    family = FAMILIES[kind.family] if kind is not None else _lookups
    tasks, checks, needed = ([], [], []) if generic else family(interface)
    bound = [interface.bindings[n] for n in dict.fromkeys(needed)]
    if not tasks:  # tools that follow none of the conventions the family reads: the calls themselves
        tasks, checks, bound = requests(tools, interface.param_column, interface.observations.phrasings)
    else:
        words = vocabulary(interface.tables.values())
        writes = [t.name for t in interface.bindings.values() if t.behaviour in WRITES]
        tasks = as_users_ask(
            tasks, interface.observations.requests, words, identities=_identities(interface), writes=writes
        )
    if not tasks:
        raise SpecError(f"the target's tools offer nothing to exercise {capability!r} with")
    sampled = [*(t.table for t in bound if t.table), *(s.table for t in tasks for s in t.slots.values())]
    spec = EnvSpec(
        name=f"{capability}-env",
        capability=capability,
        description=description,
        system_prompt=system_prompt,
        tables={table: interface.tables[table] for table in dict.fromkeys(sampled)},
        tools=bound,
        tasks=tasks,
        checks=checks,
    )
    spec = spec.model_copy(update={"hint": hint or worked_hint(spec)})
    check_spec(spec)
    return spec


Vocabulary = dict[str, re.Pattern[str]]  # a column's name -> what its values look like in a request
_EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")


def vocabulary(tables: Iterable[Table]) -> Vocabulary:
    """What each column's values look like, as the environment generates them: an id by its
    pattern, an email as any email, other text and choices by their values."""
    found: dict[str, set[str]] = {}
    for table in tables:
        for name, column in table.columns.items():
            values = [str(v) for v in column.values if str(v).strip()]
            if column.kind == "id" and column.pattern:
                found.setdefault(name, set()).add(_id_regex(column.pattern))
            elif values and all(_EMAIL.fullmatch(v) for v in values):
                found.setdefault(name, set()).add(_EMAIL.pattern)
            elif column.kind in ("text", "choice"):
                found.setdefault(name, set()).update(map(re.escape, values))
    return {
        name: re.compile(rf"(?<![\w.@])(?:{'|'.join(sorted(options, key=len, reverse=True))})(?![\w@]|\.\w)")
        for name, options in found.items()
        if options
    }


def _id_regex(pattern: str) -> str:
    """An id pattern (``#W{d7}``) as a regular expression."""
    parts = re.split(r"(\{d\d{1,2}\})", pattern)
    return "".join(rf"\d{{{p[2:-1]}}}" if re.fullmatch(r"\{d\d{1,2}\}", p) else re.escape(p) for p in parts)


def ticket_phrasing(request: str, words: Vocabulary) -> str:
    """``request`` with every value it states that a column could hold as that column's
    ``{name}``, the longest first (an email before the name inside it)."""
    text = request.replace("{", "(").replace("}", ")")
    spans = sorted(
        ((m.start(), m.end(), name) for name, pattern in words.items() for m in pattern.finditer(text)),
        key=lambda span: (span[0] - span[1], span[0]),
    )
    kept: list[tuple[int, int, str]] = []
    for start, end, name in spans:
        if all(end <= a or start >= b for a, b, _ in kept):
            kept.append((start, end, name))
    for start, end, name in sorted(kept, reverse=True):
        text = f"{text[:start]}{{{name}}}{text[end:]}"
    return text


_PLACEHOLDER = re.compile(r"\{([\w.]+)\}")


Identity = tuple[str, frozenset[str]]  # a table, and the columns a user is found by in it


def as_users_ask(
    tasks: list[TaskTemplate],
    requests: Sequence[str],
    words: Vocabulary,
    most: int = 3,
    identities: Sequence[Identity] = (),
    writes: Iterable[str] = (),
) -> list[TaskTemplate]:
    """``tasks``, each also worded as the target's users worded such a request: a captured
    request whose stated values are exactly the values the ticket states (an order, a
    reason, a name and a zip), those values drawn anew, or those values and one of the
    ``identities`` besides (users say who they are even where the ticket needs no search:
    "What is the status of my order …? My email is …"), drawn from a row of its own. A
    wording that names a change (the verb of one of the ``writes`` tools: "I want to return
    …") fits only a ticket that makes or refuses that change. Up to ``most`` wordings a
    ticket, the commonest first and its own after them, sharing its weight, and the tickets
    users asked for before the others; a wording that fits tickets acting on two tools is
    ambiguous and used for neither. An expert taught "Please cancel my order ... My first
    name is ..." skipped the search on the target's "I'm Kenji Lopez, zip 78701"; a lookups
    expert taught "What is the status of order …?" drew none of the target's lookups to it.
    A request past half a ticket's length limit is not a wording."""
    wordings = Counter(ticket_phrasing(r, words) for r in requests if len(r) <= MAX_TEXT // 2)
    changes = {name_words(w)[0] for w in writes if name_words(w)}

    def asked(text: str) -> set[str]:
        """The changes a request names, by their tools' verbs ("cancel" in "cancellation")."""
        return {v for v in changes if re.search(rf"\b{re.escape(v)}", text, re.IGNORECASE)}

    def stated(template: TaskTemplate) -> dict[str, str] | None:
        """The template's placeholders by column name (None: a name placed twice)."""
        full = _PLACEHOLDER.findall(template.prompt)
        names = {f.split(".")[-1]: f for f in full}
        return names if len(names) == len(set(full)) else None

    def fit(template: TaskTemplate, wording: str) -> tuple[dict[str, str], dict[str, Slot]] | None:
        """Where each value ``wording`` states goes in ``template`` (and the row a stated
        identity needs), or None where it does not fit."""
        names, placed = set(_PLACEHOLDER.findall(wording)), stated(template)
        if not names or placed is None or not set(placed) <= names:
            return None
        made = {
            w
            for tool in [*(a.tool for a in template.reference), *template.forbidden]
            for w in name_words(tool)
        }
        if not asked(wording) <= made:
            return None
        if names == set(placed):
            return placed, {}
        slot = next(f"p{i}" for i in range(len(template.slots) + 1) if f"p{i}" not in template.slots)
        for table, columns in identities:
            if names - set(placed) == columns:
                return {**placed, **{c: f"{slot}.{c}" for c in columns}}, {slot: Slot(table=table)}
        return None

    fits: dict[str, set[str]] = {}
    for wording in wordings:
        for template in tasks:
            if fit(template, wording) is not None:
                fits.setdefault(wording, set()).add(template.kind.removeprefix("refuse_"))
    own = [
        [w for w, _ in wordings.most_common() if len(fits.get(w, ())) == 1 and fit(t, w) is not None][:most]
        for t in tasks
    ]
    # The commonest wording of every ticket first, then the next: as many as a spec holds.
    room, chosen = MAX_TEMPLATES - len(tasks), [[] for _ in tasks]
    for rank in range(most):
        for i, wordings_of in enumerate(own):
            if rank < len(wordings_of) and room > 0:
                chosen[i].append(wordings_of[rank])
                room -= 1
    worded: list[TaskTemplate] = []
    # The tickets users asked for first: easing keeps the first of them where it drops some.
    for template, picked in sorted(zip(tasks, chosen, strict=True), key=lambda pair: not pair[1]):
        weight = template.weight / (len(picked) + 1)
        for wording in picked:
            placed, rows = fit(template, wording) or ({}, {})
            prompt = _PLACEHOLDER.sub(lambda m, placed=placed: "{" + placed[m[1]] + "}", wording)
            slots = {**template.slots, **rows}
            worded.append(template.model_copy(update={"weight": weight, "prompt": prompt, "slots": slots}))
        worded.append(template.model_copy(update={"weight": weight}))  # after the users' (easing keeps those)
    return worded


def is_generic(spec: EnvSpec) -> bool:
    """Whether ``spec`` is the generic family's: every tool a stateless ``respond``."""
    return all(t.behaviour == "respond" for t in spec.tools)


def worked_hint(spec: EnvSpec) -> str:
    """The capability's guidance plus the worked example training shows, as text."""
    from trace_plugin.environments.interpreter import (
        worked_example,
    )  # the interpreter imports this module's peers

    kind = KINDS.get(spec.capability)
    guidance = kind.hint if kind is not None else ""
    example = worked_example(spec)
    if not example:
        return guidance
    user, assistant = example
    function = assistant["tool_calls"][0]["function"]
    call = json.dumps({"name": function["name"], "arguments": json.loads(function["arguments"])})
    return (
        f"{guidance}\nExample. User: {user['content']}\nAssistant: <tool_call>\n{call}\n</tool_call>".strip()
    )


@dataclass(frozen=True, slots=True)
class CapturedInterface:
    """The agent's interface as its captured production traffic shows it: its tools, system
    prompt, observed values, and the few-shot examples it puts before every request
    (experts train behind them). What ``synthesize`` builds an environment from."""

    tools: list[dict[str, Any]]
    system_prompt: str
    observations: Observations
    examples: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_store(cls, store: Store, agent: str, *, limit: int = 500) -> CapturedInterface:
        episodes = store.load_episodes(agent, limit=limit)
        conversations = [
            s.input["messages"]
            for e in episodes
            for s in [s for s in e.steps if s.kind == "llm"][-1:]
            if isinstance(s.input, dict) and isinstance(s.input.get("messages"), list)
        ]
        prompts = Counter(
            content_text(m[0].get("content")) for m in conversations if m and m[0].get("role") == "system"
        )
        contexts = Counter(json.dumps(_context(m)) for m in conversations)
        # Calls paired with their results, whether the agent's tools were recorded as steps or
        # only inside its conversation (the gateway's view).
        trajectories = [Trajectory.from_episode(e) for e in episodes]
        calls = [
            (c.arguments, arguments_object(c.result)) for t in trajectories for c in t.calls if not c.error
        ]
        system_prompt = prompts.most_common(1)[0][0] if prompts else "You are a helpful assistant with tools."
        examples = json.loads(contexts.most_common(1)[0][0]) if contexts else []
        observed = replace(
            Observations.from_calls(calls),
            guards=observed_guards(trajectories),
            phrasings=observed_phrasings(trajectories),
            preconditions=observed_preconditions(trajectories, system_prompt),
            shapes=observed_shapes(trajectories),
            requests=[t.user for t in trajectories if t.user],
        )
        return cls(store.tool_schemas(agent), system_prompt, observed, examples)


def _context(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages between the system prompt and the request (the last user message)."""
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    start = 1 if messages and messages[0].get("role") == "system" else 0
    return messages[start : users[-1]] if users else []


# -- template families ------------------------------------------------------------------

# an interface -> (templates, checks, the tools they need)
Family = Callable[[Interface], tuple[list[TaskTemplate], list[Check], list[str]]]


def _lookups(interface: Interface) -> tuple[list[TaskTemplate], list[Check], list[str]]:
    """Single lookups across every entity: the right tool, a well-formed call, the facts."""
    tasks, needed = [], []
    for tool in interface.bindings.values():
        if tool.behaviour != "lookup" or tool.table is None:
            continue
        table = interface.tables[tool.table]
        facts = sorted(
            (c for c in table.columns if table.columns[c].kind != "id"), key=lambda c: c != "status"
        )
        if not facts:
            continue
        fact, noun = facts[0], tool.table
        tasks.append(
            TaskTemplate(
                kind=f"lookup_{noun}",
                slots={"x": {"table": noun}},
                prompt=f"What is the {fact.replace('_', ' ')} of {noun} {{x.{table.key}}}?",
                reference=[Action(tool=tool.name, arguments={tool.key: f"{{x.{table.key}}}"})],
                facts=[f"{{x.{fact}}}"],
            )
        )
        needed.append(tool.name)
    checks = [
        Check(kind="valid_calls", weight=0.5),
        Check(kind="required_calls", weight=2),
        Check(kind="facts"),
    ]
    return tasks, checks, needed


def _calls(interface: Interface) -> tuple[list[TaskTemplate], list[Check], list[str]]:
    """Well-formed calls of every kind of tool the agent has: single lookups, a search whose
    id the next call uses, and a write after its read; each ticket states what the calls
    need, and the reward is for the right calls, well formed, and the facts told. (Refusals
    are the ``refusals`` family's: mixed in here, a small model learned to refuse every
    request, 0.25 → 0.25 on the demo's gate tasks.)"""
    lookups, _, looked = _lookups(interface)
    found, _, searched = _grounding(interface)
    writes, written = _writes(interface, allowed=True)
    checks = [
        Check(kind="valid_calls", weight=0.5),
        Check(kind="required_calls", weight=2),
        Check(kind="facts"),
    ]
    return lookups + found + writes, checks, looked + searched + written


def _grounding(interface: Interface) -> tuple[list[TaskTemplate], list[Check], list[str]]:
    """Find an entity by what the user knows, then use the id the search returned."""
    tasks, needed = [], []
    for finder in interface.bindings.values():
        if finder.behaviour != "list" or finder.table is None:
            continue
        lookup = next(
            (t for t in interface.bindings.values() if t.behaviour == "lookup" and t.table == finder.table),
            None,
        )
        if lookup is None:
            continue
        table = interface.tables[finder.table]
        argument, column = next(iter(finder.filters.items()))
        fact = next((c for c in table.columns if c not in (table.key, column)), table.key)
        noun = finder.table
        tasks.append(
            TaskTemplate(
                kind=f"find_then_get_{noun}",
                slots={"x": {"table": noun}},
                prompt=f"My {column.replace('_', ' ')} is {{x.{column}}}. "
                f"What {fact.replace('_', ' ')} do you have for my {noun}?",
                reference=[
                    Action(tool=finder.name, arguments={argument: f"{{x.{column}}}"}),
                    Action(tool=lookup.name, arguments={lookup.key: f"{{x.{table.key}}}"}),
                ],
                facts=[f"{{x.{fact}}}"],
            )
        )
        needed += [finder.name, lookup.name]
    checks = [
        Check(kind="required_calls", weight=3),
        Check(kind="valid_calls", weight=0.5),
        Check(kind="facts"),
    ]
    return tasks, checks, needed


def _writes(interface: Interface, *, allowed: bool) -> tuple[list[TaskTemplate], list[str]]:
    """Tickets asking for a guarded write, on a row that allows it or (refusals) one that does not."""
    tasks, needed = [], []
    for writer in interface.bindings.values():
        if writer.behaviour != "update" or writer.table is None:
            continue
        lookup = next(
            (t for t in interface.bindings.values() if t.behaviour == "lookup" and t.table == writer.table),
            None,
        )
        if lookup is None:
            continue
        noun, table = writer.table, interface.tables[writer.table]
        statuses = table.columns["status"].values
        guard = writer.guard["status"]
        state = guard if allowed else [s for s in statuses if s not in guard]
        if not state:
            continue
        properties = writer.parameters.get("properties", {})
        params = {
            p: interface.param_column(p) for p in writer.parameters.get("required", []) if p != writer.key
        }
        arguments: dict[str, Any] = {writer.key: f"{{x.{table.key}}}"}
        for p in params:
            arguments[p] = [f"{{{p}}}"] if properties.get(p, {}).get("type") == "array" else f"{{{p}}}"
        asks = ", ".join(f"{p.replace('_', ' ')} {{{p}}}" for p in params)
        verb = name_words(writer.name)[0]
        read = Action(tool=lookup.name, arguments={lookup.key: f"{{x.{table.key}}}"})
        write = Action(tool=writer.name, arguments=arguments)
        ways = _prerequisites(interface, writer) if allowed else [([], {}, "")]
        if ways is None:
            continue  # a prerequisite the ticket cannot give the user's side of
        for first, slots, says in ways:
            tasks.append(
                TaskTemplate(
                    kind=f"{verb}_{noun}" if allowed else f"refuse_{verb}_{noun}",
                    weight=1 / len(ways),
                    slots={"x": {"table": noun, "where": {"status": state}}, **slots},
                    params=params,
                    prompt=f"Please {verb} my {noun} {{x.{table.key}}}{f' ({asks}).' if asks else '.'}{says}",
                    reference=[*first, read, write] if allowed else [read],
                    facts=[] if allowed else ["{x.status}"],
                    forbidden=[] if allowed else [writer.name],
                    answer=f"Your {noun} {{x.{table.key}}} is {past_tense(verb)}."
                    if allowed
                    else f"I cannot {verb} {noun} {{x.{table.key}}}: it is {{x.status}}.",
                )
            )
            needed += [*(a.tool for a in first), lookup.name, writer.name]
    return tasks, list(dict.fromkeys(needed))


Way = tuple[list[Action], dict[str, dict[str, Any]], str]  # calls, the rows they need, what the ticket says


def _prerequisites(interface: Interface, writer: ToolSpec) -> list[Way] | None:
    """The ways a ticket can give what ``writer`` requires before it: each the calls, the
    rows they need (slots ``p0``, ``p1``...) and what the ticket says so that the agent can
    make them ("My email is ..."), as users identify themselves; None where a required tool
    is neither a search nor a lookup. A search is made each of its ways (``_search_ways``):
    an expert that only ever saw emails skipped the search on every ticket that gave a name."""
    ways: list[Way] = [([], {}, "")]
    for i, name in enumerate(writer.requires):
        tool, slot = interface.bindings[name], f"p{i}"
        if tool.behaviour == "lookup" and tool.table == writer.table:
            # The ticket's own row, which the reference reads before writing: another row
            # here had tickets name a second order ("My order id is ...") for no reason.
            continue
        if tool.behaviour == "list" and tool.table:
            options = _search_ways(tool)
        elif tool.behaviour == "lookup" and tool.table and tool.key:
            options = [[(tool.key, interface.tables[tool.table].key)]]
        else:
            return None
        ways = [
            (
                [*actions, Action(tool=name, arguments={a: f"{{{slot}.{c}}}" for a, c in option})],
                {**slots, slot: {"table": tool.table}},
                says + _identify(slot, [c for _, c in option]),
            )
            for actions, slots, says in ways
            for option in options
        ]
    return ways


def _search_ways(search: ToolSpec) -> list[list[tuple[str, str]]]:
    """The ways a search by several fields is made: by its first alone, or by the others
    together ("first name, last name, zip"), as the target's users identify themselves
    either way; each way its (argument, column) pairs."""
    fields = list(search.filters.items())
    return [fields[:1], fields[1:]] if len(fields) >= 3 else [fields[:1]]


def _identities(interface: Interface) -> list[Identity]:
    """Every way a user says who they are: the columns of one way of one search."""
    return [
        (tool.table, frozenset(c for _, c in way))
        for tool in interface.bindings.values()
        if tool.behaviour == "list" and tool.table
        for way in _search_ways(tool)
    ]


def _identify(slot: str, columns: list[str]) -> str:
    """What a ticket says so that the agent can search by ``columns`` of row ``slot``."""
    told = [f"{c.replace('_', ' ')} is {{{slot}.{c}}}" for c in columns]
    return f" My {', '.join(told[:-1])} and {told[-1]}." if len(told) > 1 else f" My {told[0]}."


def _preconditions(interface: Interface) -> tuple[list[TaskTemplate], list[Check], list[str]]:
    tasks, needed = _writes(interface, allowed=True)
    refusals, more = _writes(interface, allowed=False)
    checks = [Check(kind="final_state", weight=2), Check(kind="required_calls"), Check(kind="forbidden")]
    checks += [Check(kind="order", before=a.tool, after=b.tool) for a, b in _pairs_of(tasks)]
    return tasks + refusals, _unique_checks(checks), needed + more


def _refusals(interface: Interface) -> tuple[list[TaskTemplate], list[Check], list[str]]:
    tasks, needed = _writes(interface, allowed=True)
    refusals, more = _writes(interface, allowed=False)
    checks = [Check(kind="forbidden", weight=2), Check(kind="final_state"), Check(kind="required_calls")]
    return refusals + tasks, checks, more + needed


def _completion(interface: Interface) -> tuple[list[TaskTemplate], list[Check], list[str]]:
    tasks, needed = _writes(interface, allowed=True)
    checks = [
        Check(kind="final_state", weight=2),
        Check(kind="required_calls"),
        Check(kind="valid_calls", weight=0.5),
    ]
    return tasks, checks, needed


def _facts(interface: Interface) -> tuple[list[TaskTemplate], list[Check], list[str]]:
    tasks, _, needed = _lookups(interface)
    return tasks, [Check(kind="facts", weight=2), Check(kind="required_calls")], needed


# family name -> its templates; each capability kind names its family in trace_plugin.mining.kinds
FAMILIES: dict[FamilyName, Family] = {
    "calls": _calls,
    "lookups": _lookups,
    "facts": _facts,
    "grounding": _grounding,
    "preconditions": _preconditions,
    "refusals": _refusals,
    "completion": _completion,
}


# -- helpers ------------------------------------------------------------------------------


def _done_status(verb: str, statuses: Sequence[str]) -> str:
    """The status a write leaves: the target's own word where traffic showed one that starts
    as the verb does ("cancelled", "return requested"), else the verb's past tense."""
    stem = verb[:5].lower()
    if len(stem) >= 4:  # shorter verbs ("set", "add") start too many words
        return next((s for s in statuses if s.lower().startswith(stem)), past_tense(verb))
    return past_tense(verb)


def past_tense(verb: str) -> str:
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y"):
        return verb[:-1] + "ied"
    return verb + "ed"


def _params(function: dict[str, Any]) -> list[str]:
    return list(((function.get("parameters") or {}).get("properties") or {}).keys())


def _nouns(function: dict[str, Any]) -> list[str]:
    nouns = [m["noun"] for p in _params(function) if (m := _ID_PARAM.match(p))]
    name = function.get("name", "")
    parts = name_words(name)
    if len(parts) == 2 and guess_role(name) == "read" and not nouns:
        nouns.append(parts[1].removesuffix("s"))  # find_user(email, ...) -> user
    return nouns


def _target(function: dict[str, Any], tables: Mapping[str, Any]) -> str | None:
    """The table a tool acts on: its first required id parameter's, else its name's noun."""
    parameters = function.get("parameters") or {}
    for param in [*parameters.get("required", []), *_params(function)]:
        match = _ID_PARAM.match(param)
        if match and match["noun"] in tables and not param.endswith("_ids"):
            return match["noun"]
    parts = name_words(function.get("name", ""))
    noun = parts[-1].removesuffix("s") if len(parts) > 1 else ""
    return noun if noun in tables else None


def _pairs() -> list[tuple[str, str]]:
    return list(zip(_POOLS["first_name"], _POOLS["last_name"], strict=True))


def _pairs_of(tasks: list[TaskTemplate]) -> list[tuple[Action, Action]]:
    """Each ticket's last two calls: the read, then the write it checks."""
    return [(t.reference[-2], t.reference[-1]) for t in tasks if len(t.reference) >= 2]


def _unique_checks(checks: list[Check]) -> list[Check]:
    return list({(c.kind, c.before, c.after): c for c in checks}.values())
