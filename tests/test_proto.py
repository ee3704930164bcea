"""The checked-in protobuf/gRPC code matches proto/kvstore.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_up_to_date():
    result = subprocess.run(
        [sys.executable, "-m", "kvstore_client.proto.generate", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_domain_code_does_not_import_grpc():
    """House rule: tiers, policies, the index and the store never import grpc."""
    script = (
        "import sys; import kvstore.node.store, kvstore.master.index, kvstore.master.membership, "
        "kvstore.master.placement, kvstore.policy, kvstore_client.hashing; print('grpc' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
