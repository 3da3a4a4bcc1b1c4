"""The documentation site builds offline, and every ```python block in docs/*.md runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def python_blocks(page: Path) -> list[str]:
    """The ```python fenced blocks of a markdown page, in order."""
    return _BLOCK.findall(page.read_text())


def test_docs_build_offline(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for page in PAGES:
        assert (site / f"{page.stem}.html").is_file(), page
    api = (site / "api.html").read_text()
    assert "pallas_flash.api.attention" in api and "TritonConfig" in api
    measured = (site / "measured.html").read_text()
    images = re.findall(r'src="(bench/[^"]+\.png)"', measured)
    assert len(images) >= 8
    for image in images:
        assert (site / image).is_file(), image
    assert "Attention benchmark: NVIDIA H200" in measured  # the results tables, included
    # Offline: no script, stylesheet or font is fetched from the network.
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert not re.search(r'<script[^>]+src="(https?:)?//', text), html
        assert not re.search(r'<link[^>]+href="(https?:)?//', text), html


def test_every_page_has_been_checked_for_code():
    assert sum(len(python_blocks(page)) for page in PAGES) >= 8


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_python_blocks_run(page, capsys):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for index, block in enumerate(python_blocks(page)):
        try:
            exec(compile(block, f"{page.name}[block {index}]", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"{page.name}, python block {index} failed:\n{block}") from exc


def test_architecture_references_exist():
    """Every `path.py:name` on the architecture page names a def, class or constant there."""
    text = (DOCS / "architecture.md").read_text()
    refs = re.findall(r"`((?:pallas_flash/)?[\w/]+\.py):(\w+)", text)
    assert len(refs) >= 15
    for path, name in refs:
        file = ROOT / path if path.startswith("pallas_flash/") else ROOT / "pallas_flash" / path
        source = file.read_text()
        assert re.search(rf"^\s*(def|class) {name}\b|^{name}\s*[:=]", source, re.MULTILINE), \
            f"{path}:{name} not found"
