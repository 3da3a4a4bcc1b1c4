"""pallas_flash.compat: the supported JAX range, and the one home of ``jax._src``."""

from __future__ import annotations

import pathlib
import re

import jax
import jaxlib
import pytest

from pallas_flash import compat

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, expected", [
    ("0.11.2", (0, 11, 2)), ("0.12.0.1", (0, 12, 0)), ("0.13.0.dev20261201", (0, 13, 0)),
    ("1.0.0rc1", (1, 0, 0))])
def test_release_reads_major_minor_patch(version, expected):
    assert compat.release(version) == expected


@pytest.mark.parametrize("version", ["0.12", "", "jax", None])
def test_release_rejects_what_is_no_version(version):
    with pytest.raises(ValueError, match=re.escape("version must be a string like '0.12.1'")):
        compat.release(version)


@pytest.mark.parametrize("version", ["0.11.2", "0.12.0", "0.12.0.1", "0.12.1", "0.12.9"])
def test_supported_versions_pass(version):
    compat.check_version("jax", version)
    compat.check_version("jaxlib", version)


@pytest.mark.parametrize("version", ["0.11.1", "0.10.2", "0.13.0", "0.13.0.dev20261201",
                                     "1.0.0"])
def test_unsupported_versions_name_the_range(version):
    with pytest.raises(ImportError, match=re.escape(
            f"pallas-flash supports jaxlib >=0.11.2,<0.13 (0.11.2 through 0.12.x), found "
            f"jaxlib {version}")):
        compat.check_version("jaxlib", version)


def test_check_version_rejects_other_packages():
    with pytest.raises(ValueError, match="package must be 'jax' or 'jaxlib'"):
        compat.check_version("flax", "0.12.12")


def test_the_installed_jax_is_in_range_and_matches_the_package_metadata():
    compat.check_version("jax", jax.__version__)
    compat.check_version("jaxlib", jaxlib.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    for package in ("jax", "jaxlib"):
        assert f'"{package}{compat.SUPPORTED_RANGE}"' in pyproject


def test_jax_private_names_are_imported_in_compat_alone():
    private_import = re.compile(r"^\s*(from|import)\s+jax\._src\b", re.MULTILINE)
    importers = sorted(
        str(path.relative_to(ROOT)) for folder in ("pallas_flash", "tests", "models")
        for path in (ROOT / folder).rglob("*.py") if private_import.search(path.read_text()))
    assert importers == ["pallas_flash/compat.py"]
