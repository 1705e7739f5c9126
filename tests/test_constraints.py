"""infra/constraints.txt pins what `make` installs: every requirement of the project and of its dev and serving
extras, at a version pyproject.toml accepts, and the same torch as the Makefile's CPU pin."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _pins(text: str) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"infra/constraints.txt line {number}: {line!r} is not an exact pin (name==version)"
        pins[canonicalize_name(name)] = Version(version)
    return pins


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["dev"], *extras["serving"]]]


def test_every_requirement_is_pinned_inside_its_range() -> None:
    pins = _pins((ROOT / "infra" / "constraints.txt").read_text())
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) has no pin in infra/constraints.txt: run `make constraints`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"infra/constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {req}")


def test_torch_pin_is_the_makefile_one() -> None:
    pins = _pins((ROOT / "infra" / "constraints.txt").read_text())
    makefile = (ROOT / "Makefile").read_text()
    cpu_pins = set(re.findall(r"torch==([\w.]+)", makefile))
    assert cpu_pins == {str(pins["torch"])}, (cpu_pins, pins["torch"])


def test_pins_are_read_strictly() -> None:
    assert _pins("# header\nNumPy==2.4.6  # comment\n\ntyping_extensions==4.15.0\n") == {
        "numpy": Version("2.4.6"), "typing-extensions": Version("4.15.0")}
    with pytest.raises(AssertionError, match="line 1"):
        _pins("numpy>=2\n")
