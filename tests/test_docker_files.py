"""The docker/ files, checked as far as this machine can without a Docker engine: the
files the image copies are enough to build the package, the compose file is valid under
the compose specification, every command the image and the compose file run is one the
CLI accepts (options and values included), and the services are wired to each other:
masters campaign in the compose etcd and advertise names the others resolve, nodes follow
them through etcd, each DRAM tier fits its container's /dev/shm, ports stay on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click
import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from kvstore.cli import DRY_RUN, main
from kvstore.security.service_flags import ServiceSecurity
from kvstore_client.cluster_address import parse_etcd_address
from kvstore_client.etcd import parse_endpoints

DOCKER = Path(__file__).resolve().parent.parent / "docker"
ROOT = DOCKER.parent


def dockerfile() -> list[str]:
    return (DOCKER / "Dockerfile").read_text().splitlines()


def image_user() -> int:
    """The uid the image runs as (its USER line, numeric so Kubernetes can check runAsNonRoot)."""
    (user,) = [line.split()[1] for line in dockerfile() if line.startswith("USER")]
    return int(user.split(":")[0])


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def kvstore_services() -> dict[str, dict]:
    """The compose services that run the image docker/Dockerfile builds."""
    return {
        name: service
        for name, service in compose()["services"].items()
        if service.get("build", {}).get("dockerfile") == "docker/Dockerfile"
    }


def image_commands() -> list[list[str]]:
    """The argument lists ``kvstore`` runs with: the image's CMD and each compose service's."""
    (entry,) = [json.loads(line.split(None, 1)[1]) for line in dockerfile() if line.startswith("ENTRYPOINT")]
    assert entry == ["kvstore"]
    commands = [json.loads(line.split(None, 1)[1]) for line in dockerfile() if line.startswith("CMD")]
    return commands + [service["command"] for service in kvstore_services().values()]


def parse_command(args: list[str], env: dict[str, str] | None = None) -> click.Context:
    """``kvstore ARGS`` parsed as the CLI would, environment ``env`` included (KVSTORE_*
    variables set options), without side effects (a data dir is not created). Raises
    click's errors on an unknown option or a bad value."""
    name, *rest = args
    command = main.commands[name]
    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if k.startswith("KVSTORE")]:
            del os.environ[key]
        os.environ.update(env or {})
        root = click.Context(main, info_name="kvstore", auto_envvar_prefix="KVSTORE")
        root.meta[DRY_RUN] = True
        return command.make_context(name, list(rest), parent=root)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_listening(name: str, params: dict, auth_file: str | None = None) -> None:
    """What the service would check before it listens: beyond loopback, an access file
    or --insecure (``auth_file`` stands in for the path the container reads)."""
    security = ServiceSecurity.from_flags(
        auth_file,
        params["insecure"],
        params.get("token"),
        params.get("tls_cert"),
        params.get("tls_key"),
        params.get("tls_ca"),
        params.get("tls_mutual"),
        needs_token=name == "node",
    )
    security.check_exposure(params["host"], name)


def host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    assert sep and host and port.isdigit(), f"{address!r} is not HOST:PORT"
    return host, int(port)


def docker_bytes(text: str) -> int:
    """A compose size ("3gb", "512m"): Docker reads its units as powers of 1024."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)b?", text.strip().lower()).groups()
    return int(float(number) * 1024 ** " kmgt".index(unit or " "))


def test_the_files_the_image_copies_build_the_package(tmp_path):
    context = tmp_path / "context"
    context.mkdir()
    for line in dockerfile():
        if line.startswith("COPY"):
            *sources, target = line.split()[1:]
            for source in sources:
                path = ROOT / source
                if path.is_dir():  # as Docker does: the folder's contents go into the target
                    shutil.copytree(
                        path, context / target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__")
                    )
                else:
                    shutil.copy(path, context / target)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-build-isolation",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(context),
        ],
        check=True,
        capture_output=True,
    )
    assert list((tmp_path / "wheel").glob("kvstore-*.whl"))


def test_the_image_creates_the_user_it_runs_as():
    run = " ".join(line.strip().rstrip("\\") for line in dockerfile() if not line.startswith("#"))
    assert re.search(rf"useradd [^&]*--uid {image_user()}\b", run)
    assert image_user() != 0


@pytest.mark.parametrize("args", image_commands(), ids=lambda args: " ".join(args[:2]))
def test_every_command_the_containers_run_is_one_the_cli_accepts(args):
    context = parse_command(args)  # raises on an unknown option or a bad value
    assert context.params
    check_listening(args[0], context.params)


def test_the_compose_file_is_valid_under_the_compose_specification():
    jsonschema.Draft202012Validator(get_builtin_schema("vendor.compose-spec")).validate(compose())


def test_compose_runs_etcd_two_masters_and_three_nodes():
    services = kvstore_services()
    roles = sorted(service["command"][0] for service in services.values())
    assert roles == ["master", "master", "node", "node", "node"]
    (etcd,) = [s for name, s in compose()["services"].items() if name not in services]
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", etcd["image"])


def etcd_client_endpoints() -> set[str]:
    """HOST:PORT of each etcd service, as the others reach it on the compose network."""
    found = set()
    for name, service in compose()["services"].items():
        if service.get("image", "").startswith("quay.io/coreos/etcd:"):
            command = service["command"]
            urls = command[command.index("--advertise-client-urls") + 1].split(",")
            listen = urlsplit(command[command.index("--listen-client-urls") + 1])
            for url in map(urlsplit, urls):
                assert url.hostname == name and url.port == listen.port
                found.add(f"{url.hostname}:{url.port}")
            data_dir = command[command.index("--data-dir") + 1]
            assert any(v.split(":")[1] == data_dir for v in service.get("volumes", [])), "etcd's data on a volume"
    return found


def test_masters_campaign_in_the_compose_etcd_and_advertise_a_name_the_network_resolves():
    masters = {
        name: parse_command(s["command"]).params
        for name, s in kvstore_services().items()
        if s["command"][0] == "master"
    }
    etcd = etcd_client_endpoints()
    assert len({(p["etcd_endpoints"], p["etcd_prefix"]) for p in masters.values()}) == 1, "one election"
    for name, params in masters.items():
        assert params["etcd_endpoints"] and set(parse_endpoints(params["etcd_endpoints"])) <= etcd
        assert params["advertise"], f"{name} would put 0.0.0.0:PORT in etcd"
        assert host_port(params["advertise"]) == (name, params["port"])


def test_nodes_follow_the_leader_through_etcd_and_advertise_their_service_name():
    masters = [parse_command(s["command"]).params for s in kvstore_services().values() if s["command"][0] == "master"]
    for name, service in kvstore_services().items():
        if service["command"][0] != "node":
            continue
        params = parse_command(service["command"]).params
        endpoints, prefix = parse_etcd_address(params["master_address"])
        assert set(endpoints) <= etcd_client_endpoints() and prefix == masters[0]["etcd_prefix"]
        assert params["advertise"] == name
        assert docker_bytes(service["shm_size"]) > params["dram"], "the arena is reserved whole in /dev/shm"
        assert f"{name}-data:{params['data_dir']}" in service["volumes"]


def test_ports_are_published_on_loopback_only_and_volumes_are_declared():
    spec = compose()
    for name, service in spec["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in spec["volumes"], f"{name}: undeclared {source}"


def test_health_checks_probe_the_ports_the_services_serve_metrics_on():
    services = kvstore_services()
    for name, service in services.items():
        params = parse_command(service["command"]).params
        test = " ".join(service["healthcheck"]["test"])
        (url,) = re.findall(r"http://[^'\" ]+", test)
        assert urlsplit(url).port == params["metrics_port"] and urlsplit(url).path == "/health", name
    for name, service in compose()["services"].items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in compose()["services"][dependency], f"{name} waits on {dependency}"
