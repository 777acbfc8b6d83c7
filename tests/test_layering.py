"""Layers import only downward: the allowed directions, checked on the source.

Every import counts, lazy ones inside functions too: a lazy import still ties a lower
layer to a higher one. Each unit (a subpackage of trace_plugin, a module of its core, or a
top-level package) sits in one layer and may import its own layer's unit and any unit in a
lower layer, never a sibling or anything above.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGES = ("trace_plugin", "training", "integrations", "mcp_server")

LAYERS: list[set[str]] = [  # lowest first
    {"trace_plugin.errors"},
    {"trace_plugin.records"},  # what the store persists
    {"trace_plugin.chat_template", "trace_plugin.tool_calls"},  # the model's text formats
    {"trace_plugin.store"},
    {"trace_plugin.attention"},  # registered with transformers by model_files
    {
        "trace_plugin.payload",
        "trace_plugin.model_files",
        "trace_plugin.generation",
        "trace_plugin.stage_results",
        "trace_plugin.freed_memory",
    },
    {"trace_plugin.adapter_files"},  # an adapter's files: names, checks, digests
    {"trace_plugin.recorder"},
    {"trace_plugin.tracer"},
    {"trace_plugin.capture", "trace_plugin.conversations"},
    {"trace_plugin"},  # the package's public face: capture, Recorder, Store, the records
    {"trace_plugin.mining"},
    {"trace_plugin.environments", "trace_plugin.gateway"},
    {"trace_plugin.export"},  # fine-tuning datasets: episodes, and environments' reference plays
    {"training"},
    {"trace_plugin.improver", "trace_plugin.dashboard", "mcp_server", "integrations"},
    {"trace_plugin.demo"},
    {"trace_plugin.cli"},
    {"trace_plugin.__main__"},
]


def unit_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "trace_plugin" and len(parts) > 1 else parts[0]


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def violations(root: Path = ROOT) -> list[str]:
    layer_of = {unit: index for index, layer in enumerate(LAYERS) for unit in layer}
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue  # Alembic's scripts, loaded by the store's upgrade
            source = unit_of(module_name(path, root))
            if source not in layer_of:
                found.append(f"{path.relative_to(root)}: {source} is in no layer")
                continue
            for line, name in imports(path):
                target = unit_of(name)
                if target == source:
                    continue
                if target not in layer_of:
                    found.append(f"{path.relative_to(root)}:{line}: {target} is in no layer")
                elif layer_of[target] >= layer_of[source]:
                    found.append(f"{path.relative_to(root)}:{line}: {source} imports {name}, not below it")
    return found


def test_layers_import_only_downward():
    assert violations() == []


def test_the_checker_sees_an_upward_import(tmp_path):
    store = tmp_path / "trace_plugin" / "store"
    store.mkdir(parents=True)
    (store / "__init__.py").write_text("from trace_plugin.records import trajectory\n")
    (store / "probe.py").write_text("def f():\n    from trace_plugin.improver import Improver\n")
    (tmp_path / "trace_plugin" / "stray.py").write_text("")
    assert violations(tmp_path) == [
        "trace_plugin/store/probe.py:2: trace_plugin.store imports trace_plugin.improver, not below it",
        "trace_plugin/stray.py: trace_plugin.stray is in no layer",
    ]


def test_importing_the_package_loads_only_the_capture_path():
    above = (
        "trace_plugin.mining",
        "trace_plugin.environments",
        "trace_plugin.gateway",
        "trace_plugin.improver",
    )
    code = f"""
import sys
import trace_plugin
heavy = ("training", "torch", "transformers", "vllm", "litellm", "trl", "peft", "langchain_core")
print(" ".join(sorted(m for m in sys.modules if m.startswith({above!r}) or m.split(".")[0] in heavy)))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []


def test_no_test_module_imports_another():
    """Shared helpers live in tests/support/ and shared fixtures in conftest.py: a test
    module that imports another runs that module's import-time work, and ties the two."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0].startswith("test_")
            ]
    assert found == []
