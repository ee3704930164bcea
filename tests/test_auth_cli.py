"""The security flags of `kvstore master|node|up|status|keys`, run as an operator would, and the
metrics endpoint with an access file (admin token only).

Subprocesses with timeouts, every port 0 (chosen at run time), temp dirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from kvstore_client import BlockHasher, Client
from tests.access_files import ADMIN, NODE, NS_A, TENANT_A, TENANT_B, WRONG, write_access_file
from tests.processes import ROOT, Service, wait_for

TIMEOUT = 60


def kvstore(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    environment.pop("KVSTORE_TOKEN", None)
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment,
        timeout=TIMEOUT,
    )


def refused(result: subprocess.CompletedProcess, *phrases: str) -> str:
    """A clear refusal: non-zero exit, one message naming ``phrases``, no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    text = result.stderr
    assert "Traceback" not in text, text
    for phrase in phrases:
        assert phrase in text, text
    return text


MASTER = ("master", "--port", "0", "--metrics-port", "-1")


@pytest.fixture(scope="module")
def access_file(tmp_path_factory):
    return str(write_access_file(tmp_path_factory.mktemp("access")))


# -- exposure ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_non_loopback_master_without_auth_refuses_to_start(host):
    refused(kvstore(*MASTER, "--host", host), host, "--auth", "--insecure")


def test_a_non_loopback_node_without_auth_refuses_to_start(tmp_path):
    refused(
        kvstore(
            "node",
            "--master",
            "127.0.0.1:9",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--data-dir",
            str(tmp_path),
            "--dram",
            "8MiB",
            "--ssd",
            "0",
        ),
        "--auth",
        "--insecure",
    )


def test_insecure_starts_serves_and_warns(tmp_path):
    log = tmp_path / "master.err"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", *MASTER, "--host", "0.0.0.0", "--insecure", "--json"],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        port = json.loads(proc.stdout.readline())["master"].rsplit(":", 1)[1]
        with Client(f"127.0.0.1:{port}") as client:
            assert client.cluster_status().nodes == []  # serves, and answers anyone
        wait_for(lambda: "--insecure" in log.read_text(), timeout=TIMEOUT)
        assert "no access file" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=TIMEOUT)
        proc.stdout.close()


def test_loopback_without_auth_starts_quietly():
    service = Service(list(MASTER))
    try:
        assert service.record["master"].startswith("127.0.0.1:")
    finally:
        service.close()


# -- the access file ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_an_access_file_others_can_read_is_refused(tmp_path, mode):
    path = write_access_file(tmp_path, mode=mode)
    refused(kvstore(*MASTER, "--auth", str(path)), str(path), "chmod 600")


def test_a_broken_access_file_is_refused_clearly(tmp_path):
    short = write_access_file(tmp_path / "short", '[tokens.x]\nsecret = "too-short"\nrole = "admin"\n')
    refused(kvstore(*MASTER, "--auth", str(short)), "tokens.x", "16")
    bad_role = write_access_file(tmp_path / "role", f'[tokens.x]\nsecret = "{ADMIN}"\nrole = "root"\n')
    refused(kvstore(*MASTER, "--auth", str(bad_role)), "tokens.x", "role")
    refused(kvstore(*MASTER, "--auth", str(tmp_path / "missing.toml")), "missing.toml")


def test_a_tenants_token_for_a_service_is_refused(access_file, tmp_path):
    refused(kvstore(*MASTER, "--auth", access_file, "--token", TENANT_A), "tenant", "acme")
    result = kvstore(
        "node",
        "--master",
        "127.0.0.1:9",
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--data-dir",
        str(tmp_path),
        "--dram",
        "8MiB",
        "--ssd",
        "0",
        "--auth",
        access_file,
        env={"KVSTORE_TOKEN": TENANT_B},
    )
    refused(result, "tenant", "globex")
    refused(kvstore(*MASTER, "--auth", access_file, "--token", WRONG), "not a token of")


# -- kvstore up --auth, status and keys with tokens, metrics ----------------------------------------------
@pytest.fixture(scope="module")
def up(access_file, tmp_path_factory):
    service = Service(
        [
            "up",
            "--port",
            "0",
            "--data-port",
            "0",
            "--metrics-port",
            "0",
            "--data-dir",
            str(tmp_path_factory.mktemp("up")),
            "--dram",
            "16MiB",
            "--ssd",
            "0",
            "--auth",
            access_file,
        ]
    )
    yield service.record
    service.close()


def test_up_with_an_access_file_runs_its_node_with_the_files_node_token(up):
    """`kvstore up --auth FILE` takes the file's node token; `kvstore status --token ADMIN` shows the node."""
    master = up["master"]
    wait_for(
        lambda: up["node_id"] in kvstore("status", "--master", master, "--token", ADMIN, "--json").stdout,
        timeout=TIMEOUT,
    )
    record = json.loads(kvstore("status", "--master", master, "--token", ADMIN, "--json").stdout)
    assert up["node_id"] in json.dumps(record)
    refused(kvstore("status", "--master", master), "Unauthenticated")
    refused(kvstore("status", "--master", master, "--token", WRONG), "Unauthenticated")
    as_env = kvstore("status", "--master", master, "--json", env={"KVSTORE_TOKEN": ADMIN})
    assert as_env.returncode == 0 and up["node_id"] in as_env.stdout, as_env.stderr
    refused(kvstore("status", "--master", master, "--token", NODE), "PermissionDenied")  # nodes: membership only


def test_keys_with_a_tenants_token_lists_only_its_own(up):
    master = up["master"]
    keys = BlockHasher(NS_A, 4).keys(list(range(4 * 3)))
    with Client(master, token=TENANT_A, location_ttl=0) as a:
        a.batch_put(keys, [b"a" * 4096] * len(keys))
        wait_for(lambda: all(a.batch_exists(keys)), timeout=TIMEOUT)
    mine = kvstore("keys", "--master", master, "--token", TENANT_A, "--json")
    assert mine.returncode == 0, mine.stderr
    assert NS_A in mine.stdout
    theirs = kvstore("keys", "--master", master, "--token", TENANT_B, "--json")
    assert theirs.returncode == 0, theirs.stderr
    assert NS_A not in theirs.stdout
    refused(kvstore("keys", "--master", master, "--token", TENANT_B, "--namespace", NS_A), "PermissionDenied")
    admin = kvstore("keys", "--master", master, "--token", ADMIN, "--json")
    assert admin.returncode == 0 and NS_A in admin.stdout, admin.stderr


def scrape(address: str, token: str | None) -> int:
    request = urllib.request.Request(f"http://{address}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
            body = reply.read()
            assert b"kvstore" in body
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.mark.parametrize("which", ["master_metrics", "metrics"])
def test_metrics_with_an_access_file_want_an_admin_token(up, which):
    address = up[which]
    assert address
    assert scrape(address, None) == 401
    assert scrape(address, WRONG) == 401
    assert scrape(address, TENANT_A) == 403
    assert scrape(address, NODE) == 403
    assert scrape(address, ADMIN) == 200
    with urllib.request.urlopen(f"http://{address}/health", timeout=TIMEOUT) as health:  # probes carry no token
        assert (health.status, health.read()) == (200, b"ok\n")
