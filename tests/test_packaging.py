"""The release artifacts: ``python -m build`` gives an sdist and a wheel without warnings,
and the wheel, installed in a fresh virtual environment, runs the README's usage example
from outside the checkout.

The fresh environment gets no network: the wheel is installed with ``--no-deps`` and finds
jax, jaxlib and numpy in this interpreter's site-packages through a ``.pth`` line. A path
line does not run that directory's own ``.pth`` files, so the checkout's editable install
(if any) stays invisible there, and ``pallas_flash`` can only come from the wheel.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

import pallas_flash

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    """The environment of the subprocesses: nothing that points Python at the checkout,
    and byte-compilation on (setuptools warns when it is off)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(args: list[str], cwd: pathlib.Path) -> str:
    done = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _usage_example() -> str:
    """The first Python block of the README's Usage section."""
    readme = (ROOT / "README.md").read_text()
    usage = readme.split("\n## Usage\n", 1)[1]
    return re.search(r"```python\n(.*?)```", usage, re.DOTALL).group(1)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path, str]:
    """``(sdist, wheel, build output)`` of ``python -m build`` (the wheel is built from the
    sdist, as a release is); without build isolation, so offline.

    It builds a copy of the files a build reads: setuptools writes into the source tree
    (``*.egg-info``), which pytest-xdist workers running this fixture at once would share.
    """
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "MANIFEST.in", "README.md", "CHANGELOG.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "pallas_flash", source / "pallas_flash",
                    ignore=shutil.ignore_patterns("__pycache__"))
    log = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out),
                str(source)], cwd=out)
    (sdist,), (wheel,) = sorted(out.glob("*.tar.gz")), sorted(out.glob("*.whl"))
    return sdist, wheel, log


def test_build_gives_both_artifacts_without_warnings(artifacts):
    sdist, wheel, log = artifacts
    assert [line for line in log.splitlines() if re.search("warn", line, re.I)] == []
    version = pallas_flash.__version__
    assert sdist.name == f"pallas_flash-{version}.tar.gz"
    assert wheel.name == f"pallas_flash-{version}-py3-none-any.whl"


def test_wheel_holds_the_package_alone_with_its_metadata(artifacts):
    _, wheel, _ = artifacts
    version = pallas_flash.__version__
    info = f"pallas_flash-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(info + "METADATA").decode()
    assert [n for n in names if not n.startswith(("pallas_flash/", info))] == []
    assert "pallas_flash/py.typed" in names and "pallas_flash/compat.py" in names
    assert not any(n.startswith("pallas_flash/") and "__pycache__" in n for n in names)
    assert f"\nVersion: {version}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert "\nRequires-Dist: jax<0.13,>=0.11.2\n" in metadata


def test_sdist_holds_the_package_readme_and_changelog(artifacts):
    sdist, _, _ = artifacts
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.removeprefix(top + "/") for name in archive.getnames()}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "pallas_flash/py.typed",
            "pallas_flash/api.py"} <= names
    assert not any(name.startswith(("tests/", "benchmarks/", "models/")) for name in names)


def test_wheel_runs_the_readme_example_in_a_fresh_venv(artifacts, tmp_path):
    _, wheel, _ = artifacts
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = pathlib.Path(_run([str(python), "-c", "import sysconfig; "
                              "print(sysconfig.get_path('purelib'))"], cwd=tmp_path).strip())
    # This interpreter's dependencies (jax, jaxlib, numpy), after the venv's own packages.
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "--quiet", str(wheel)], cwd=tmp_path)
    version = _run([str(venv / "bin" / "pallas-flash"), "--version"], cwd=tmp_path).strip()
    assert version == f"pallas-flash {pallas_flash.__version__}"
    (tmp_path / "usage.py").write_text(
        "import pallas_flash\nprint(pallas_flash.__file__)\n" + _usage_example())
    printed = _run([str(python), "usage.py"], cwd=tmp_path).strip().splitlines()
    assert pathlib.Path(printed[0]).is_relative_to(site), printed[0]
    assert float(printed[-1]) < 1e-5, printed  # the example's max |out - ref|
