"""Bad values on the kvstore command line: one clear line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os

import click
import pytest
from click.testing import CliRunner

from kvstore.cli import Size, main
from tests.test_cli import kvstore

NUMERIC = (click.types.IntParamType, click.types.FloatParamType, Size)  # IntRange and FloatRange included

# The lowest value each numeric option means something at, where that is not "at least 1" (a size: one byte;
# a float: anything above 0). Every other numeric option, a new one included, must refuse 0 and -1.
LOWEST = {
    ("master", "port"): 0,
    ("master", "metrics_port"): -1,
    ("master", "conductor_port"): -1,  # -1: off
    ("node", "port"): 0,
    ("node", "metrics_port"): -1,
    ("up", "port"): 0,
    ("up", "data_port"): 0,
    ("up", "metrics_port"): -1,
    ("node", "ssd"): 0,
    ("up", "ssd"): 0,  # 0: no SSD tier
    ("node", "idle_timeout"): 0,
    ("up", "idle_timeout"): 0,  # 0: never
    ("node", "write_ttl"): 0,
    ("up", "write_ttl"): 0,  # 0: reserved space never expires
    ("node", "lease_ttl"): 0,
    ("up", "lease_ttl"): 0,  # 0: leases never expire
    ("token", "quota"): 0,
    ("router", "port"): 0,
    ("router", "index_wait"): 0,  # 0: any free port; do not wait for the index
    ("drain", "wait_s"): 0,  # 0: do not wait
}
PORTS = {"port", "data_port", "metrics_port", "conductor_port"}


def numeric_options():
    for name, command in sorted(main.commands.items()):
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, NUMERIC):
                yield name, param


def required_args(command: click.Command) -> list[str]:
    """Values for the command's required parameters, so parsing gets to the one under test."""
    args = []
    for param in command.params:
        if not param.required:
            continue
        value = param.type.choices[0] if isinstance(param.type, click.Choice) else "x"
        args += [value] if isinstance(param, click.Argument) else [param.opts[0], value]
    return args


def refused(name: str, param: click.Option, value: str) -> str | None:
    """The error parsing ``--opt value`` gives for that option (None: accepted). Nothing is run."""
    command = main.commands[name]
    try:
        command.make_context(name, required_args(command) + [f"{param.opts[0]}={value}"])
    except click.BadParameter as exc:
        if exc.param is not None and exc.param.name == param.name:
            return exc.format_message()
        raise
    return None


def test_there_are_numeric_options_to_check():
    names = {(c, p.name) for c, p in numeric_options()}
    assert {("keys", "limit"), ("bench", "rounds"), ("bench", "batch"), ("master", "ttl")} <= names
    assert set(LOWEST) <= names  # the table names no option that has gone


@pytest.mark.parametrize("name,param", list(numeric_options()), ids=lambda v: getattr(v, "name", v))
def test_numeric_options_refuse_values_that_make_no_sense(name, param):
    lowest = LOWEST.get((name, param.name))
    if lowest is None:
        lowest = 1 if isinstance(param.type, (click.types.IntParamType, Size)) else 0.001
        for value in ("0", "-1"):
            assert refused(name, param, value), f"{name} {param.opts[0]} {value} accepted"
    else:
        assert refused(name, param, str(lowest)) is None
        assert refused(name, param, str(lowest - 1)), f"{name} {param.opts[0]} {lowest - 1} accepted"
    if param.name in PORTS:
        assert refused(name, param, "65536")
    assert refused(name, param, str(lowest)) is None


@pytest.mark.parametrize(
    "args",
    [
        ["keys", "--limit", "-1"],
        ["keys", "--limit", "0"],
        ["bench", "--rounds", "0"],
        ["bench", "--batch", "-1"],
        ["master", "--port", "-5"],
        ["demo", "--blocks", "-1"],
    ],
)
def test_bad_numbers_are_usage_errors(args):
    result = kvstore(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Invalid value" in result.stderr
    assert args[1] in result.stderr


@pytest.mark.parametrize("clients,expected", [("0", "client count"), ("1,-2", "client count"), (",", "clients")])
def test_bench_refuses_client_counts_that_make_no_sense(clients, expected):
    # small settings, in case it ever runs
    out = CliRunner().invoke(
        main,
        [
            "bench",
            "--clients",
            clients,
            "--sizes",
            "16KiB",
            "--bytes",
            "64KiB",
            "--ops",
            "put",
            "--transports",
            "tcp",
            "--rounds",
            "1",
            "--no-redis",
            "--quiet",
        ],
    )
    assert out.exit_code == 2, out.output
    assert expected in out.output


def test_bench_refuses_a_zero_value_size():
    out = CliRunner().invoke(
        main,
        [
            "bench",
            "--sizes",
            "0",
            "--ops",
            "put",
            "--transports",
            "tcp",
            "--clients",
            "1",
            "--rounds",
            "1",
            "--no-redis",
            "--quiet",
        ],
    )
    assert out.exit_code == 2 and "value size must be positive" in out.output


def unusable_dirs(tmp_path) -> list[str]:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    dirs = [str(a_file), str(a_file / "data")]
    if os.path.isdir("/proc/self"):
        dirs.append("/proc/kvstore-data")  # nothing may be made there, root included
    return dirs


@pytest.mark.parametrize(
    "command",
    [
        ["demo"],
        ["node", "--port", "0", "--metrics-port", "-1"],
        ["up", "--port", "0", "--data-port", "0", "--metrics-port", "-1"],
    ],
)
def test_an_unusable_data_dir_is_a_usage_error(tmp_path, command):
    for data_dir in unusable_dirs(tmp_path):
        result = kvstore(*command, "--data-dir", data_dir)
        assert result.returncode == 2, (data_dir, result.stderr)
        assert "Traceback" not in result.stderr and "--data-dir" in result.stderr and data_dir in result.stderr
        assert len([line for line in result.stderr.splitlines() if line.startswith("Error")]) == 1


def test_a_data_dir_is_made_when_missing(tmp_path):
    result = kvstore(
        "demo",
        "--data-dir",
        str(tmp_path / "new" / "dir"),
        "--dram",
        "4MiB",
        "--ssd",
        "8MiB",
        "--blocks",
        "4",
        "--block-size",
        "256KiB",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "new" / "dir").is_dir() and not [
        p for p in os.listdir(tmp_path / "new" / "dir") if p.startswith(".kvstore-probe")
    ]


@pytest.mark.parametrize("value", ["master1", "master1:0", "master1:99999", "two words:7700", ":7700"])
def test_the_masters_advertised_address_must_be_one_others_can_dial(value):
    message = refused("master", next(p for p in main.commands["master"].params if p.name == "advertise"), value)
    assert message and "host:port" in message
