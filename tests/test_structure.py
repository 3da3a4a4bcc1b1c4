"""The house rules on the package's structure (tools/check_structure.py): the repository keeps
them, each rule catches its violation in a tiny fake repository, and every backend module
meets the contract's Backend protocol."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pallas_flash import dispatch
from pallas_flash.contract import Backend

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "check_structure.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("check_structure", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


structure = _load_tool()

PYPROJECT = """[project]
name = "fake"

[tool.setuptools.packages.find]
include = [{include}]
"""
# A fake repository that keeps every rule: each test below breaks one.
CLEAN = {
    "pallas_flash/__init__.py": "from pallas_flash.api import attention\n",
    "pallas_flash/__main__.py": "from pallas_flash.tutorial.cli import main\n",
    "pallas_flash/tutorial/__init__.py": "",
    "pallas_flash/tutorial/cli.py": "import pallas_flash as pf\n"
                                    "from pallas_flash import dispatch\n",
    "pallas_flash/api.py": "from pallas_flash import dispatch\n\n\ndef attention():\n"
                           "    return dispatch.backend()\n",
    "pallas_flash/decode.py": "from pallas_flash.contract import EMPTY_ROW_LSE\n",
    "pallas_flash/dispatch.py": "def backend():\n    from pallas_flash import xla\n\n"
                                "    return xla\n\n\ndef _check():\n    pass\n",
    "pallas_flash/sharding.py": "from pallas_flash.contract import varying_like\n",
    "pallas_flash/contract.py": "from pallas_flash.masking import MaskSpec\n",
    "pallas_flash/masking.py": "",
    "pallas_flash/padding.py": "",
    "pallas_flash/xla.py": "from pallas_flash.contract import Kernels\n",
    "pallas_flash/triton/__init__.py": "from pallas_flash.triton.forward import forward\n",
    "pallas_flash/triton/forward.py": "from pallas_flash.contract import kernel_output\n"
                                      "from pallas_flash.padding import pad_axis\n",
    "models/__init__.py": "",
    "pyproject.toml": PYPROJECT.format(include='"pallas_flash*"'),
}


def _violations(tmp_path: Path, changes: dict[str, str]) -> list[str]:
    """The check's violations in the fake repository with ``changes`` applied."""
    for name, text in {**CLEAN, **changes}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return structure.check(tmp_path)


def test_the_repository_keeps_the_house_rules():
    done = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every rule holds" in done.stdout


def test_the_fake_repository_is_clean(tmp_path):
    assert _violations(tmp_path, {}) == []


@pytest.mark.parametrize(("changes", "expected"), [
    # A cycle through importlib, between two modules allowed to import each other.
    ({"pallas_flash/decode.py": "import importlib\n\n"
                                "api = importlib.import_module('pallas_flash.api')\n",
      "pallas_flash/api.py": "from pallas_flash import decode\n"},
     "import cycle among pallas_flash.api, pallas_flash.decode"),
    ({"pallas_flash/api.py": "from importlib import import_module\n\n\ndef load(name):\n"
                             "    return import_module(name)\n"},
     "pallas_flash.api imports a computed module name (line 5)"),
    ({"pallas_flash/api.py": "from pallas_flash.dispatch import _check\n"},
     "pallas_flash.api imports the private name pallas_flash.dispatch._check (line 1)"),
    ({"pallas_flash/triton/_tiles.py": "",
      "pallas_flash/triton/forward.py": "from pallas_flash.triton import _tiles\n"},
     "pallas_flash.triton.forward imports the private name pallas_flash.triton._tiles"),
    ({"pallas_flash/api.py": "from pallas_flash import dispatch as d\n\nd._check()\n"},
     "pallas_flash.api reads the private name pallas_flash.dispatch._check (line 3)"),
    ({"pallas_flash/triton/forward.py": "from pallas_flash.sharding import varying_like\n"},
     "pallas_flash.triton.forward -> pallas_flash.sharding: a backend imports only the "
     "contract, the core and itself"),
    ({"pallas_flash/xla.py": "def forward():\n    from pallas_flash.triton import forward\n"},
     "pallas_flash.xla -> pallas_flash.triton.forward: a backend imports only the "
     "contract, the core and itself"),
    ({"pallas_flash/decode.py": "import pallas_flash.triton.forward\n"},
     "pallas_flash.decode -> pallas_flash.triton.forward: an entry point imports no "
     "backend"),
    ({"pallas_flash/padding.py": "from pallas_flash.contract import DTYPES\n"},
     "pallas_flash.padding -> pallas_flash.contract: the core imports only the core"),
    ({"pallas_flash/sharding.py": "from pallas_flash import dispatch\n"},
     "pallas_flash.sharding -> pallas_flash.dispatch: sharding imports only the core, "
     "the contract and nothing else"),
    ({"pallas_flash/decode.py": "from pallas_flash.tutorial import cli\n"},
     "pallas_flash.decode -> pallas_flash.tutorial.cli: only the tutorial and __main__ "
     "import the tutorial"),
    ({"pallas_flash/tutorial/cli.py": "from pallas_flash.mosaic.config import SMEM_BUDGET\n",
      "pallas_flash/mosaic/__init__.py": "", "pallas_flash/mosaic/config.py": ""},
     "pallas_flash.tutorial.cli -> pallas_flash.mosaic.config: the tutorial imports no "
     "backend"),
    ({"pallas_flash/helpers.py": ""},
     "pallas_flash.helpers has no place in the layers"),
    ({"pallas_flash/api.py": "from models import train\n"},
     "pallas_flash.api imports models.train (line 1): the package imports no lab code"),
    ({"pallas_flash/api.py": "import importlib\n\nimportlib.import_module('benchmarks.suite')\n"},
     "pallas_flash.api imports benchmarks.suite (line 3)"),
    ({"pyproject.toml": PYPROJECT.format(include='"pallas_flash*", "models*"')},
     "pyproject.toml: packages.find includes 'models*'"),
    ({"pyproject.toml": "[project]\nname = 'fake'\n"},
     "pyproject.toml: no [tool.setuptools.packages.find] include rule"),
    ({"pallas_flash_extras/__init__.py": ""},
     "pyproject.toml: packages.find include 'pallas_flash*' also ships pallas_flash_extras/"),
], ids=["cycle-through-importlib", "computed-import", "private-import", "private-module",
        "private-attribute",
        "backend-imports-call-layer", "backend-imports-backend", "entry-imports-backend",
        "core-imports-contract", "call-layer-table", "imports-tutorial",
        "tutorial-imports-backend", "unplaced-module", "imports-models",
        "imports-benchmarks", "wheel-pattern", "wheel-discovery", "wheel-sibling"])
def test_each_rule_catches_its_violation(tmp_path, changes, expected):
    violations = _violations(tmp_path, changes)
    assert len(violations) == 1, violations
    assert violations[0].startswith(expected), violations


def test_architecture_lists_every_module_and_what_it_may_import():
    """The page's table names every module the check places (the core, the contract, the
    call layer, the entry points), every backend and the tutorial."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Modules and what they may import", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/]+?)(?:\.py|/)?`", section))
    places = (structure.CORE | {structure.CONTRACT} | set(structure.CALL_LAYER)
              | (structure.ENTRY_POINTS - {""}) | structure.BACKENDS | {"__init__"}
              | {structure.TUTORIAL})
    assert places <= named, sorted(places - named)


@pytest.mark.parametrize("name", sorted(dispatch.BACKENDS))
def test_every_backend_meets_the_contract(name):
    assert isinstance(dispatch.backend(name), Backend)


def test_the_protocol_refuses_an_incomplete_backend():
    incomplete = types.ModuleType("incomplete")
    incomplete.KERNELS = dispatch.backend("xla").KERNELS
    incomplete.default_config = dispatch.backend("xla").default_config
    assert not isinstance(incomplete, Backend)
    incomplete.unsupported = dispatch.backend("xla").unsupported
    assert isinstance(incomplete, Backend)
