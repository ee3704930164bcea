"""The docker/ files, checked as far as this machine can without a Docker engine: the
files the image copies are enough to build the package, and every command the image
and the compose file run is one the CLI accepts, options and values included."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import main

DOCKER = Path(__file__).resolve().parent.parent / "docker"
ROOT = DOCKER.parent


def dockerfile() -> list[str]:
    return (DOCKER / "Dockerfile").read_text().splitlines()


def image_commands() -> list[list[str]]:
    """The argument lists ``kvstore`` runs with: the image's CMD and each compose service's."""
    (entry,) = [json.loads(line.split(None, 1)[1]) for line in dockerfile() if line.startswith("ENTRYPOINT")]
    assert entry == ["kvstore"]
    commands = [json.loads(line.split(None, 1)[1]) for line in dockerfile() if line.startswith("CMD")]
    compose = (DOCKER / "compose.yaml").read_text()
    commands += [json.loads(found) for found in re.findall(r"command: (\[.*?\])", compose, re.S)]
    return commands


def test_the_files_the_image_copies_build_the_package(tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    for line in dockerfile():
        if line.startswith("COPY"):
            *sources, target = line.split()[1:]
            for source in sources:
                path = ROOT / source
                if path.is_dir():  # as Docker does: the folder's contents go into the target
                    shutil.copytree(path, context / target, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(path, context / target)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                    "-w", str(tmp_path / "wheel"), str(context)], check=True, capture_output=True)
    assert list((tmp_path / "wheel").glob("kvstore-*.whl"))


@pytest.mark.parametrize("args", image_commands(), ids=lambda args: " ".join(args[:2]))
def test_every_command_the_containers_run_is_one_the_cli_accepts(args):
    name, *rest = args
    command = main.commands[name]
    context = command.make_context(name, list(rest))  # raises on an unknown option or a bad value
    assert context.params
