"""LoRA adapters as the gateway serves them: validated paths, versions, hot-swap, rollback.

Adapters are named ``name@version`` (``refunds@3``). Clients ask for ``name``; the
registry answers with the live version, and counts the requests in flight on each version
so an old version is unloaded only once drained. A new version becomes live only after
the backend lists it and a probe request through it succeeds (ART issue #661: a stale
adapter silently served after a reload).

An adapter's name is a tool name (letters, digits, ``_`` and ``-``, at most 64) with at
most one ``@version`` of the same; names a request means something else by (``base``,
``default``, the base model's id, the served agent and its aliases) are reserved.

One ``name@version`` is one set of files for the life of the gateway: loading it again
from other files, or rolling back to it after its files changed, is refused (409). vLLM's
prefix cache keys blocks by adapter name (vllm#42125), so a name reloaded from other
files would serve blocks cached under the old weights; a new version is a new name.
Mixtures are named by their parts' versions and weights, so they inherit the rule.

A mixture of several adapters is served as one composed adapter
(``trace_plugin.gateway.composition``), written under the adapter root and loaded on
first use under its deterministic name. The registry keeps the few most recent, within a
count and a size on disk; an evicted one is unloaded once its requests are done, and only
then is its folder deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trace_plugin.adapter_files import (
    WEIGHTS,
    AdapterError,
    check_complete,
    check_weights,
    files_digest,
)
from trace_plugin.gateway.backend import Backend, BackendError, SamplingParams
from trace_plugin.gateway.composition import compose_adapter
from trace_plugin.records.expert import split_name
from trace_plugin.records.mixture import Mixture

MIXTURES_DIR = ".mixtures"  # under the adapter root: composed adapters, rebuilt on demand
MAX_MIXTURE_BYTES = 512 * 2**20  # composed adapters kept loaded, by their bytes on disk
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a tool name's characters: no NUL, path or ':'

log = logging.getLogger("trace_plugin.gateway")


def validate_adapter_dir(path: str | Path, root: Path, *, base_model: set[str], max_rank: int) -> Path:
    """The resolved adapter directory, if it is a PEFT LoRA adapter for our base model.

    It must resolve inside ``root`` (no ``..``, no symlink leading out, for the directory
    or any file in it), hold ``adapter_config.json`` and weights, target our base model,
    and have a rank the server accepts. A path the filesystem refuses (a name too long, no
    permission) is the request's fault too.
    """
    try:
        return _validate_adapter_dir(path, root, base_model=base_model, max_rank=max_rank)
    except OSError as exc:
        raise AdapterError(f"adapter path {path} cannot be read: {exc.strerror or exc}") from exc


def _validate_adapter_dir(path: str | Path, root: Path, *, base_model: set[str], max_rank: int) -> Path:
    root = root.resolve()
    candidate = Path(path) if Path(path).is_absolute() else root / path
    resolved = candidate.resolve()  # follows symlinks: a link leading out resolves outside
    if not resolved.is_relative_to(root):  # checked first, so nothing outside is even probed
        raise AdapterError(f"adapter path {path} resolves outside the adapter root", 403)
    if not resolved.exists():
        raise AdapterError(f"adapter path does not exist: {path}", 404)
    if not resolved.is_dir():
        raise AdapterError(f"adapter path {path} is not a directory")
    for item in resolved.rglob("*"):
        if not item.resolve().is_relative_to(root):
            raise AdapterError(f"{item.name} in adapter {path} links outside the adapter root", 403)
    config_file = resolved / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError as exc:
        raise AdapterError(f"{path} has no adapter_config.json") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}/adapter_config.json is not valid JSON") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{path} is not a LoRA adapter (peft_type={config.get('peft_type')!r})")
    if not any((resolved / f).is_file() for f in (WEIGHTS, "adapter_model.bin")):
        raise AdapterError(f"{path} has no adapter weights")
    if (resolved / WEIGHTS).is_file():
        check_complete(resolved / WEIGHTS, path)
    base = str(config.get("base_model_name_or_path") or "")
    if base and base not in base_model and Path(base).name not in base_model:
        raise AdapterError(f"adapter {path} was trained on {base!r}, not on {sorted(base_model)[0]!r}")
    rank = config.get("r")
    if not isinstance(rank, int) or not 0 < rank <= max_rank:
        raise AdapterError(f"adapter rank {rank!r} is outside 1..{max_rank}")
    return resolved


def check_adapter_name(full: str, reserved: frozenset[str] = frozenset()) -> None:
    """Refuse a name that is not ``name`` or ``name@version`` in the tool-name character set,
    or that would shadow what a request means by a reserved name."""
    name, version = split_name(full)
    if not _NAME.fullmatch(name) or (version is not None and not _NAME.fullmatch(version)):
        raise AdapterError(
            f"invalid adapter name {full!r}: a name of letters, digits, '_' and '-' (at most 64), "
            "with at most one @version of the same"
        )
    if name in reserved:
        raise AdapterError(
            f"adapter name {name!r} is reserved: a request means the base model or the router by it "
            f"({', '.join(sorted(reserved))})",
            409,
        )


def _rank(path: Path) -> int:
    """A loaded adapter's rank, as its config states it (checked when it was loaded)."""
    return int(json.loads((path / "adapter_config.json").read_text())["r"])


@dataclass(slots=True)
class _Version:
    path: Path
    in_flight: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    size: int = 0  # bytes on disk, for a composed adapter


class AdapterRegistry:
    """Which version of each adapter is live, and how to change that safely."""

    def __init__(
        self,
        backend: Backend,
        root: str | Path,
        *,
        hot_swap: bool = True,
        mixtures: int = 4,
        mixture_bytes: int = MAX_MIXTURE_BYTES,
        reserved: frozenset[str] = frozenset(),
    ) -> None:
        self.backend = backend
        self.root = Path(root)
        self.max_mixtures = max(1, mixtures)  # composed adapters kept loaded
        self.max_mixture_bytes = mixture_bytes  # and their bytes on disk (the newest is always kept)
        self.reserved = reserved
        # False: vLLM's own semantics, every name independent, "a@2" does not replace "a@1".
        self.hot_swap = hot_swap
        self.live: dict[str, str] = {}  # name -> "name@version" serving new requests
        self.history: dict[str, list[str]] = {}  # name -> earlier live versions, newest last
        self._versions: dict[str, _Version] = {}  # every loaded "name@version"
        self._paths: dict[str, Path] = {}  # every version ever loaded, for rollback
        self._digests: dict[str, str] = {}  # every version ever loaded -> its files' digest
        self._mixtures: OrderedDict[str, _Version] = OrderedDict()  # composed, least recent first
        self._draining: dict[str, _Version] = {}  # composed, evicted, still serving requests
        self._background: set[asyncio.Task] = set()  # unloads waiting to drain (the loop holds tasks weakly)
        self._lock = asyncio.Lock()

    # -- request side (synchronous: atomic on the event loop) ------------------------------

    def acquire(self, model: str) -> str | None:
        """The loaded adapter that serves ``model`` now, pinned until ``release``."""
        full = self.live.get(model) or (model if model in self._versions else None)
        if full is not None:
            version = self._versions[full]
            version.in_flight += 1
            version.drained.clear()
        return full

    def release(self, full: str) -> None:
        version = self._versions.get(full) or self._mixtures.get(full) or self._draining.get(full)
        if version is not None:
            version.in_flight -= 1
            if version.in_flight == 0:
                version.drained.set()

    async def acquire_mixture(self, mixture: Mixture) -> tuple[str | None, Mixture]:
        """The backend adapter that serves ``mixture`` now (None: the base model), pinned
        until ``release``, and the mixture on the versions it was made of.

        One adapter is served as itself. Several are composed on first use, from the live
        versions of their names: a new version makes a new composition, and the old one
        ages out of the cache.
        """
        if (one := mixture.single()) is not None or not mixture:
            full = self.acquire(one) if one is not None else None
            return full, Mixture.of(full)
        pinned = [self.acquire(name) for name in mixture.adapters]
        try:
            if None in pinned:
                missing = [n for n, f in zip(mixture.adapters, pinned, strict=True) if f is None]
                raise AdapterError(f"mixture names adapters that are not loaded: {missing}", 404)
            resolved = mixture.resolved(dict(zip(mixture.adapters, pinned, strict=True)))  # type: ignore[arg-type]
            served = resolved.served_name()
            if served not in self._mixtures:
                async with self._lock:
                    if served in self._draining:  # evicted but not yet unloaded: keep it
                        self._mixtures[served] = self._draining.pop(served)
                    elif served not in self._mixtures:
                        self._mixtures[served] = await self._compose(served, resolved)
            self._mixtures.move_to_end(served)
            self._evict()
            version = self._mixtures[served]
            version.in_flight += 1
            version.drained.clear()
            return served, resolved
        finally:
            for full in pinned:
                if full is not None:
                    self.release(full)

    async def _compose(self, served: str, mixture: Mixture) -> _Version:
        parts = [(self._versions[name].path, weight) for name, weight in mixture.parts()]
        rank = sum(_rank(path) for path, _ in parts)  # the composition's: its parts' ranks side by side
        if rank > self.backend.max_lora_rank:
            raise AdapterError(
                f"the mixture {mixture.label()} has rank {rank}, the sum of its adapters' ranks, over the "
                f"{self.backend.max_lora_rank} this server takes (vLLM's --max-lora-rank): mix fewer or "
                "smaller adapters"
            )
        # Composed afresh on every load: a name@version unloaded and loaded again may be other files.
        path = await asyncio.to_thread(compose_adapter, parts, self.root / MIXTURES_DIR / served)
        try:  # weighted sums of finite weights can overflow: checked as a loaded adapter is
            await asyncio.to_thread(check_weights, path, getattr(self.backend, "lora_modules", None))
            version = await self._load_verified(served, path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # never loaded: nothing else reads it
            raise
        version.size = sum(f.stat().st_size for f in path.iterdir())
        return version

    def clear_mixtures(self) -> None:
        """Delete composed adapters left on disk by an earlier run: none of them is loaded."""
        shutil.rmtree(self.root / MIXTURES_DIR, ignore_errors=True)

    def _evict(self) -> None:
        """Keep the most recent composed adapters, within the count and the bytes; the others
        unload once drained, and their folders go after that."""

        def over() -> bool:
            held = sum(v.size for v in self._mixtures.values())  # the draining ones are on their way out
            return len(self._mixtures) > self.max_mixtures or (
                held > self.max_mixture_bytes and len(self._mixtures) > 1
            )

        while over():
            oldest, version = self._mixtures.popitem(last=False)
            self._draining[oldest] = version
            self._in_background(self._unload_evicted(oldest, version))

    def _in_background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def listing(self) -> dict[str, str]:
        """Every servable model name → the loaded adapter behind it."""
        names = {full: full for full in self._versions}
        names.update(self.live)
        return names

    # -- admin side ---------------------------------------------------------------------

    async def load(self, full: str, path: str | Path) -> str:
        """Load ``name@version`` from ``path``, verify it, make it live, retire the old one.
        Weights that are NaN or Inf, or for modules the base model lacks, are refused before
        the backend sees them: the live version keeps serving."""
        check_adapter_name(full, self.reserved)
        name, version = split_name(full) if self.hot_swap else (full, None)
        base_ids = {self.backend.model_id, str(getattr(self.backend, "model_dir", self.backend.model_id))}
        resolved = validate_adapter_dir(
            path, self.root, base_model=base_ids, max_rank=self.backend.max_lora_rank
        )
        await asyncio.to_thread(check_weights, resolved, getattr(self.backend, "lora_modules", None))
        async with self._lock:
            if full in self._versions:
                raise AdapterError(f"adapter {full!r} is already loaded")
            digest = await asyncio.to_thread(files_digest, resolved)
            if self._digests.get(full, digest) != digest:
                raise AdapterError(
                    f"adapter {full!r} was served from other files before: vLLM's prefix cache keys "
                    "blocks by adapter name, so load these files as a new version",
                    409,
                )
            self._versions[full] = await self._load_verified(full, resolved)
            self._paths[full], self._digests[full] = resolved, digest
            return await self._make_live(name, full)

    async def unload(self, model: str) -> list[str]:
        """Unload one version, or every version of a name; waits for their requests."""
        async with self._lock:
            name, version = split_name(model) if self.hot_swap else (model, model)
            targets = (
                [model] if version is not None else [f for f in self._versions if split_name(f)[0] == name]
            )
            if not targets or any(t not in self._versions for t in targets):
                raise AdapterError(f"adapter {model!r} is not loaded", 404)
            for full in targets:
                if self.live.get(name) == full:
                    del self.live[name]
                await self._retire(full)
            return targets

    async def rollback(self, name: str) -> str:
        """Make the previous version of ``name`` live again (reloading it if needed)."""
        async with self._lock:
            history = self.history.get(name) or []
            if not history:
                raise AdapterError(f"adapter {name!r} has no previous version", 404)
            previous = history.pop()
            current = self.live.get(name)
            if previous not in self._versions:
                path = self._paths[previous]
                if await asyncio.to_thread(files_digest, path) != self._digests[previous]:
                    history.append(previous)
                    raise AdapterError(
                        f"cannot roll back to {previous!r}: its files at {path} changed since it was "
                        "served; load them as a new version",
                        409,
                    )
                self._versions[previous] = await self._load_verified(previous, path)
            self.live[name] = previous
            if current is not None:
                await self._retire(current)
            return previous

    async def _load_verified(self, full: str, path: Path) -> _Version:
        try:
            await self.backend.load_adapter(full, path)
        except BackendError as exc:
            raise AdapterError(str(exc), exc.status) from exc
        try:
            if full not in await self.backend.adapters():
                raise AdapterError(f"{full!r} did not appear in the server's models after loading", 502)
            await self.backend.generate("ping", SamplingParams(max_tokens=1), full)
        except Exception:
            await self.backend.unload_adapter(full)
            raise
        version = _Version(path)
        version.drained.set()
        return version

    async def _make_live(self, name: str, full: str) -> str:
        previous = self.live.get(name)
        self.live[name] = full
        if previous is not None:
            self.history.setdefault(name, []).append(previous)
            self._in_background(self._retire(previous))
        return full

    async def _retire(self, full: str) -> None:
        """Unload a version once no request is using it."""
        version = self._versions.get(full)
        if version is None:
            return
        while version.in_flight:  # a request may pin it again before this task resumes
            await version.drained.wait()
        if any(v == full for v in self.live.values()):  # rolled back to it meanwhile
            return
        self._versions.pop(full, None)
        await self._unload(full)

    async def _unload_evicted(self, full: str, version: _Version) -> None:
        """Unload a composed adapter evicted from the cache, once its requests are done,
        unless a request brought it back meanwhile."""
        while version.in_flight:
            await version.drained.wait()
        async with self._lock:  # composing the same mixture again waits for its folder to go
            if self._draining.get(full) is version:
                del self._draining[full]
                await self._unload(full)
                await asyncio.to_thread(shutil.rmtree, version.path, True)

    async def _unload(self, full: str) -> None:
        try:
            await self.backend.unload_adapter(full)
        except BackendError as exc:  # it no longer serves requests either way
            log.warning("unloading retired adapter %s failed: %s", full, exc)

    def describe(self) -> dict[str, Any]:
        return {
            "live": dict(self.live),
            "loaded": {f: {"path": str(v.path), "in_flight": v.in_flight} for f, v in self._versions.items()},
            "history": {k: list(v) for k, v in self.history.items()},
            "mixtures": {
                f: {"path": str(v.path), "in_flight": v.in_flight} for f, v in self._mixtures.items()
            },
        }
