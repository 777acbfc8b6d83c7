"""The README stays short and true to the documentation site, and the site builds strictly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIGURES = re.compile(r"<!-- figures: (?P<page>\S+) -->\n(?P<block>.*?)<!-- /figures -->", re.S)
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def test_the_readme_is_short_and_its_first_code_block_holds_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    block = re.search(r"```bash\n(.*?)```", text, re.S)[1].strip().splitlines()
    assert block == [
        "bash scripts/setup.sh && .venv/bin/trace-plugin demo --quick",
        "bash scripts/setup.sh && .venv/bin/python -m pytest",
    ]
    assert "python -m pytest" in (ROOT / ".ci" / "run").read_text()  # CI runs the second


def test_every_figure_the_readme_quotes_stands_in_the_docs_page_of_its_run():
    """A figure is quoted in the README only where the page of its run states it too: the
    README's blocks of figures each name their page, and every number in them is there."""
    text = README.read_text()
    blocks = list(FIGURES.finditer(text))
    assert len(blocks) >= 2  # the demo's and the headline's
    for found in blocks:
        page = (ROOT / found["page"]).read_text()
        missing = [n for n in NUMBER.findall(found["block"]) if n not in page]
        assert not missing, (found["page"], missing)
    outside = FIGURES.sub("", text)
    assert not re.search(r"\b0\.\d\d\b", outside), "a success rate quoted outside a block of figures"


@pytest.mark.timeout(300)
def test_the_documentation_site_builds_strictly(tmp_path):
    """mkdocs-material with the API reference from the docstrings; ``--strict`` fails on a
    broken link, a missing anchor or a reference mkdocstrings cannot render."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    api = (tmp_path / "site" / "reference" / "improver" / "index.html").read_text()
    assert "run_cycle" in api  # the reference is rendered from the docstrings
