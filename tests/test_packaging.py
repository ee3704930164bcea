"""What an install puts into site-packages: kvstore and kvstore_client, nothing generic."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("kvstore-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_only_namespaced_top_level_modules(wheel_names):
    top = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"kvstore", "kvstore_client"}


def test_every_package_folder_is_shipped(wheel_names):
    for init in (ROOT / "kvstore").rglob("__init__.py"):
        assert str(init.relative_to(ROOT)) in wheel_names
    for module in (ROOT / "client").rglob("*.py"):
        assert f"kvstore_client/{module.relative_to(ROOT / 'client')}" in wheel_names


def test_console_command_is_declared(wheel_names):
    entry = next(n for n in wheel_names if n.endswith("entry_points.txt"))
    assert entry
