"""`kvstore token`: every entry it prints is one the access file accepts, with a token that
authenticates as that entry."""

from __future__ import annotations

import tomllib

from click.testing import CliRunner

from kvstore.cli import main
from kvstore.security.access import AccessList


def run(*args):
    return CliRunner().invoke(main, ["token", *args])


def test_a_tenant_entry_loads_and_its_token_is_that_tenant():
    result = run("acme", "--role", "tenant", "--namespace", "acme", "--namespace", "acme-*", "--quota", "8GiB")
    assert result.exit_code == 0, result.output
    document = tomllib.loads(result.output)
    access = AccessList.parse(document)
    principal = access.bearer(document["tokens"]["acme"]["secret"])
    assert (principal.name, principal.role, principal.quota) == ("acme", "tenant", 8 << 30)
    assert principal.may_use("acme-chat") and not principal.may_use("globex")


def test_hashed_keeps_the_token_out_of_the_entry():
    result = CliRunner().invoke(main, ["token", "storage", "--role", "node", "--hashed"])
    assert result.exit_code == 0, result.output
    entry, token = result.stdout, result.stderr.rsplit(": ", 1)[1].strip()
    assert token not in entry and "secret_sha256" in entry
    assert AccessList.parse(tomllib.loads(entry)).bearer(token).role == "node"


def test_two_tokens_differ_and_bad_entries_are_refused_with_a_clear_error():
    first, second = (tomllib.loads(run("x", "--role", "admin").output)["tokens"]["x"]["secret"] for _ in range(2))
    assert first != second and len(first) >= 40
    for args, message in (
        (["t", "--role", "tenant"], "needs namespaces"),
        (["n", "--role", "node", "--namespace", "a"], "for tenants"),
        (["bad name", "--role", "admin"], "token name"),
        (["t", "--role", "tenant", "--namespace", "a*b"], "may only end"),
    ):
        result = run(*args)
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
