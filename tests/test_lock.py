"""The installed test environment is the one ``requirements/dev.lock`` pins.

README command 2 installs with ``-c requirements/dev.lock``; a package at another version
(a tool upgraded by hand, an install without the lock) fails here, naming each difference,
so a suite that passes was run on the pinned versions. Machines that bring their own torch
build (a GPU box) are not that environment: the check applies where torch is the README's
CPU pin.
"""

from __future__ import annotations

import pathlib
import re
from importlib import metadata

import pytest
import torch
from packaging.markers import Marker
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "dev.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+))?$")


def locked() -> dict[str, str]:
    """``{name: version}`` of the lock's pins whose markers hold in this environment."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = PIN.match(line.strip())
        if match is None:
            continue
        name, version, marker = match.groups()
        if marker is None or Marker(marker).evaluate():
            pins[canonicalize_name(name)] = version
    return pins


def torch_pin() -> str:
    text = (ROOT / "requirements" / "dev.in").read_text()
    return re.search(r"^torch==(\S+)", text, re.M).group(1)


def test_the_lock_parses_and_pins_the_test_tools():
    pins = locked()
    for tool in ("pytest", "pytest-benchmark", "schemathesis", "openai", "nbclient", "playwright"):
        assert tool in pins, f"{tool} is not pinned in {LOCK.name}"
    assert "torch" not in pins  # the README pins the CPU build itself, first


def test_installed_packages_match_the_lock():
    if torch.__version__.split("+")[0] != torch_pin():
        pytest.skip(f"torch {torch.__version__} is not the README's CPU pin {torch_pin()}: "
                    "not the locked test environment")
    wrong = []
    for name, version in sorted(locked().items()):
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed (lock: {version})")
            continue
        if installed != version:
            wrong.append(f"{name}: {installed} installed, lock: {version}")
    assert not wrong, (
        "installed versions differ from requirements/dev.lock; reinstall with "
        "pip install -e '.[dev]' -c requirements/dev.lock\n  " + "\n  ".join(wrong)
    )
