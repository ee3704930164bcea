"""One configuration story: flag > KVSTORE_<COMMAND>_<OPTION> > the --config file's table >
default, for every command; the new knobs reach what they set; docs/configuration.md is
generated from the same definitions and current."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from kvstore.cli import build_store_config, main
from kvstore.configuration_doc import main_ as configuration_doc
from kvstore.master.server import MasterServer
from kvstore.scheduler.cost_model import CostModel, CostParams
from processes import Service


def effective(*args, env=None) -> dict:
    result = CliRunner().invoke(main, ["config", *args, "--json"], env=env or {})
    assert result.exit_code == 0, result.output
    return {r["option"]: r for r in json.loads(result.output)}


def test_each_source_in_its_order_of_precedence(tmp_path):
    config = tmp_path / "kv.toml"
    config.write_text(
        '[node]\ndram = "2GiB"\npolicy = "lfu"\nmax-connections = 77\nhigh_watermark = 0.9\nport = 9000\n'
    )
    got = effective(
        "node",
        "--config",
        str(config),
        "--port",
        "9001",
        env={"KVSTORE_NODE_POLICY": "length_aware", "KVSTORE_NODE_SSD": "1GiB"},
    )
    assert (got["--port"]["value"], got["--port"]["source"]) == (9001, "command line")
    assert (got["--policy"]["value"], got["--policy"]["source"]) == ("length_aware", "environment")
    assert (got["--ssd"]["value"], got["--ssd"]["source"]) == (1 << 30, "environment")
    assert (got["--dram"]["value"], got["--dram"]["source"]) == (2 << 30, "config file")
    assert (got["--max-connections"]["value"], got["--high-watermark"]["value"]) == (77, 0.9)
    assert (got["--max-block"]["value"], got["--max-block"]["source"]) == (16 << 20, "default")
    assert got["--dram"]["env"] == "KVSTORE_NODE_DRAM" and got["--token"]["env"] == "KVSTORE_TOKEN"
    assert not (tmp_path / "kvstore-data").exists()  # `kvstore config` runs nothing


def test_the_config_file_env_var_and_the_master_table(tmp_path):
    config = tmp_path / "kv.toml"
    config.write_text("[master]\nreplicas = 3\n\n[cost_model]\nlayers = 32\nblock_tokens = 16\n")
    got = effective("master", env={"KVSTORE_CONFIG": str(config)})
    assert (got["--replicas"]["value"], got["--replicas"]["source"]) == (3, "config file")
    assert (got["[cost_model] layers"]["value"], got["[cost_model] layers"]["source"]) == (32, "config file")
    assert got["[cost_model] hidden"]["source"] == "default"


@pytest.mark.parametrize(
    "text,message",
    [
        ("[node]\nbogus = 1\n", "[node] has no option 'bogus'"),
        ("[nod]\n", "unknown table [nod]"),
        ("[node\n", "not valid TOML"),
        ("[node]\nmax-connections = 0\n", "max-connections"),
        ("[cost_model]\nlayerz = 3\n", "[cost_model] has no key(s) ['layerz']"),
    ],
)
def test_a_bad_file_is_refused_with_a_message_naming_what(tmp_path, text, message):
    config = tmp_path / "kv.toml"
    config.write_text(text)
    command = "master" if "cost_model" in text else "node"
    result = CliRunner().invoke(main, ["config", command, "--config", str(config)])
    assert result.exit_code != 0 and message in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback


def test_tuning_flags_reach_the_store_config(tmp_path):
    config = build_store_config(
        str(tmp_path),
        64 << 20,
        0,
        1 << 20,
        "lru",
        {
            "high_watermark": 0.8,
            "low_watermark": 0.5,
            "eviction_batch": 8,
            "ssd_policy": "lfu",
            "promote_on_hit": False,
            "max_connections": 9,
        },
    )
    assert (config.high_watermark, config.low_watermark, config.eviction_batch) == (0.8, 0.5, 8)
    assert (config.ssd_policy, config.promote_on_hit, config.connections.max_connections) == ("lfu", False, 9)


def test_lease_ttl_and_a_file_reach_a_running_node(tmp_path):
    from kvstore_client.transport import TcpConnection

    config = tmp_path / "kv.toml"
    config.write_text('[node]\nlease-ttl = 0\nmax-table = "1MiB"\n')
    node = Service(
        [
            "node",
            "--config",
            str(config),
            "--master",
            "127.0.0.1:1",
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--data-dir",
            str(tmp_path / "data"),
            "--dram",
            "32MiB",
            "--ssd",
            "0",
        ]
    )
    try:
        with TcpConnection(node.record["data"]) as conn:
            info = conn.info()
        assert info["lease_ttl"] is None and info["max_table_bytes"] == 1 << 20
    finally:
        node.close()


def test_the_cost_model_reaches_the_conductor():
    model = CostModel(CostParams(layers=32, block_tokens=16))
    server = MasterServer(port=0, cost=model)
    assert server.conductor.cost is model


def test_the_configuration_doc_is_current():
    assert configuration_doc(["--check"]) == 0, "run: python -m kvstore.configuration_doc"


def test_a_file_may_set_the_shared_memory_directory(tmp_path):
    """--shm-dir acts in its callback (it is no StoreConfig field) and still takes a file value."""
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[node]\nshm-dir = "{tmp_path / "missing"}"\n')
    keep_env = {"KVSTORE_SHM_DIR": None}  # the callback exports it; CliRunner restores what env names
    refused = CliRunner().invoke(main, ["config", "node", "--config", str(config)], env=keep_env)
    assert refused.exit_code == 2 and "--shm-dir" in refused.output and "not a directory" in refused.output
    (tmp_path / "shm").mkdir()
    config.write_text(f'[node]\nshm-dir = "{tmp_path / "shm"}"\n')
    assert CliRunner().invoke(main, ["config", "node", "--config", str(config)], env=keep_env).exit_code == 0
    assert "KVSTORE_SHM_DIR" not in os.environ
