"""Router specs: the JSON that describes a router, as a versioned pydantic model.

Deployments store a spec, the gateway's admin API accepts one, the improver builds them
and ``training.gate`` fits the weights of one; ``router_from_spec``
turns a spec into a router. A spec is one of five kinds, told apart by ``kind``:

- ``{"kind": "static", "adapter": NAME | null}``;
- ``{"kind": "keyword", "rules": [[[WORDS], NAME]], "default": NAME | null}``;
- ``{"kind": "classifier", "experts": [{"adapter", "name", "description"}], "threshold"}``:
  the base model as classifier, hard top-1; with ``"retrieval": {"corpus", "k", "top_p"}``
  it is TRACE's: the most similar successful trajectories pick the candidates, and the
  label probabilities, nucleus-filtered, weigh a mixture of them; with ``"fallback": SPEC``,
  that router (the deployment it replaces) decides where the classifier chooses none;
- ``{"kind": "gate", "choices": [null, NAME, ...], "mean", "scale", "projection", "weight", "bias"}``:
  the paper's learned gate, a softmax per decoder layer over the base model and the
  experts, from the base model's embedding of the request;
- ``{"kind": "canary", "share", "main": SPEC, "candidate": SPEC}``: a deployment on
  trial, ``share`` of the conversations routed by ``candidate`` and the rest by ``main``.

A spec's digest (``router_version``) is stamped on every episode the router served and
kept with every deployment, so a model serializes to exactly the JSON these dicts always had:
format 1 writes no version key. A later format will write ``format_version``; a spec
without one is format 1. Imports no torch: the gateway, the improver and training share it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_serializer,
    model_validator,
)

from trace_plugin.errors import TracePluginError

FORMAT_VERSION = 1
KINDS = ("static", "keyword", "classifier", "gate", "canary")


class RouterSpecError(TracePluginError, ValueError):
    """A router spec that is not one, and why."""


class _Spec(BaseModel):
    # Unknown keys are dropped, as the gateway always did: the spec it serves is the normalized one.
    model_config = ConfigDict(extra="ignore", frozen=True)

    format_version: Literal[1] = Field(FORMAT_VERSION, exclude=True)

    def to_dict(self) -> dict[str, Any]:
        """The wire form: what deployments store and the gateway's admin API speaks."""
        return self.model_dump()

    def adapters(self) -> list[str | None]:
        """Every adapter this spec can send requests to (None: the base model)."""
        raise NotImplementedError


class StaticSpec(_Spec):
    """Always the same adapter (or always the base model)."""

    kind: Literal["static"] = "static"
    adapter: str | None = None

    def adapters(self) -> list[str | None]:
        return [self.adapter]


class KeywordSpec(_Spec):
    """The first rule whose keyword occurs in the latest user message, else ``default``."""

    kind: Literal["keyword"] = "keyword"
    rules: list[tuple[list[str], str]]
    default: str | None = None

    @field_serializer("rules")
    def _rules_as_lists(self, rules: list[tuple[list[str], str]]) -> list[list[Any]]:
        return [[list(words), adapter] for words, adapter in rules]

    def adapters(self) -> list[str | None]:
        return [self.default, *(adapter for _, adapter in self.rules)]


class ExpertEntry(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    adapter: str  # the served name
    name: str  # the capability
    description: str = ""


class CorpusEntry(BaseModel):
    """A successful trajectory of one capability's environment, as the classifier retrieves it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    capability: str  # an expert's ``name``
    request: str  # the first user turn
    solution: str  # what solved it: the reference's tool calls, as text
    embedding: list[float]  # the base model's, of ``gate_input(request)``: the spec pins its corpus


class Retrieval(BaseModel):
    """Candidates by retrieval (the ``k`` nearest trajectories' capabilities), weights by top-p."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    corpus: list[CorpusEntry] = Field(min_length=1)
    k: int = Field(4, ge=1)
    top_p: float = Field(0.9, gt=0, le=1)


class ClassifierSpec(_Spec):
    """The base model as classifier over ``experts``: hard top-1 above ``threshold``, or with
    ``retrieval`` a weighted mixture of the retrieved candidates (``threshold`` unused).
    Where it chooses none, ``fallback`` routes (the deployment it replaces), else the base
    model serves: a new candidate never loses what the live agent already does well."""

    kind: Literal["classifier"] = "classifier"
    experts: list[ExpertEntry]
    threshold: float = 0.5
    # Absent from the wire form when unset, so a spec without them keeps the digest it had.
    retrieval: Retrieval | None = Field(None, exclude_if=lambda value: value is None)
    fallback: RoutingSpec | None = Field(None, exclude_if=lambda value: value is None)

    @model_validator(mode="after")
    def _corpus_fits_the_experts(self) -> ClassifierSpec:
        if self.retrieval is not None:
            unknown = {e.capability for e in self.retrieval.corpus} - {e.name for e in self.experts}
            if unknown:
                raise ValueError(f"corpus entries for capabilities without an expert: {sorted(unknown)}")
            if len({len(e.embedding) for e in self.retrieval.corpus}) != 1:
                raise ValueError("corpus embeddings must all have one size")
        return self

    def adapters(self) -> list[str | None]:
        return [e.adapter for e in self.experts] + (self.fallback.adapters() if self.fallback else [])


class GateSpec(_Spec):
    """A learned per-layer gate over ``choices`` (None, the base model's slot, first).

    The request's embedding x is standardized (``mean``, ``scale``) and projected to a few
    dimensions, z = ``projection`` · x, shared by every layer; layer l weighs the choices
    by softmax(``weight[l]`` · z + ``bias[l]``). Shared, so a spec stays small.
    """

    kind: Literal["gate"] = "gate"
    choices: list[str | None]
    mean: list[float]
    scale: list[float]
    projection: list[list[float]]  # rank × embedding size
    weight: list[list[list[float]]]  # layers × choices × rank
    bias: list[list[float]]  # layers × choices

    def adapters(self) -> list[str | None]:
        return list(self.choices)


# A router that routes by itself; a canary splits traffic between two of them.
RoutingSpec = Annotated[StaticSpec | KeywordSpec | ClassifierSpec | GateSpec, Field(discriminator="kind")]
ClassifierSpec.model_rebuild()  # its fallback is a RoutingSpec


class CanarySpec(_Spec):
    """``share`` of the conversations to ``candidate``, the rest to ``main``. A request's
    arm follows from its latest user message, so an agent's turns on one request stay on
    one arm, and each episode records its arm's router version: that is how canary traffic
    is told from the rest."""

    kind: Literal["canary"] = "canary"
    share: float = Field(gt=0, lt=1)
    main: RoutingSpec
    candidate: RoutingSpec

    def adapters(self) -> list[str | None]:
        return [*self.main.adapters(), *self.candidate.adapters()]


RouterSpec = Annotated[
    StaticSpec | KeywordSpec | ClassifierSpec | GateSpec | CanarySpec, Field(discriminator="kind")
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(RouterSpec)


def parse_router_spec(spec: RouterSpec | dict[str, Any]) -> RouterSpec:
    """The model a spec describes; RouterSpecError says what is wrong with it."""
    if isinstance(spec, _Spec):
        return spec  # type: ignore[return-value]
    if not isinstance(spec, dict):
        raise RouterSpecError(f"a router spec is a JSON object, not {type(spec).__name__}")
    kind = spec.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise RouterSpecError(f"unknown router kind {kind!r}; known: {', '.join(KINDS)}")
    try:
        return _ADAPTER.validate_python(spec)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'][1:])) or 'spec'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise RouterSpecError(f"bad {kind} router spec: {problems}") from None


def router_spec_dict(spec: RouterSpec | dict[str, Any]) -> dict[str, Any]:
    """A spec's wire form (a dict is validated first)."""
    return parse_router_spec(spec).to_dict()


def router_version(spec: RouterSpec | dict[str, Any]) -> str:
    """A router's version: the digest of its spec, recorded on every episode it routed."""
    data = spec.to_dict() if isinstance(spec, _Spec) else spec
    return "r-" + hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]
