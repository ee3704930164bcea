"""Regenerate kvstore_pb2.py and kvstore_pb2_grpc.py from proto/kvstore.proto, and
etcd/{kv,rpc}_pb2*.py from proto/etcd/ (the subset of etcd's v3 API that the
masters' election and the etcd:// cluster address use, see kvstore_client.etcd).

    python -m kvstore_client.proto.generate [--check]

Run from the repository root. ``--check`` exits 1 when the checked-in code is
stale (what tests/test_proto.py asserts).
"""

from __future__ import annotations

import filecmp
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTPUTS = (
    "kvstore_pb2.py",
    "kvstore_pb2_grpc.py",
    "kvstore_pb2.pyi",
    "etcd/kv_pb2.py",
    "etcd/rpc_pb2.py",
    "etcd/rpc_pb2_grpc.py",
)


def proto_dir() -> Path:
    for root in (Path.cwd(), HERE.parent.parent):
        if (root / "proto" / "kvstore.proto").exists():
            return root / "proto"
    raise SystemExit("proto/kvstore.proto not found: run from the repository root")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    src = proto_dir()
    args = [
        "protoc",
        f"-I{src}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(src / "kvstore.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    grpc_file = out_dir / "kvstore_pb2_grpc.py"  # generated code imports its sibling absolutely
    grpc_file.write_text(
        grpc_file.read_text().replace(
            "import kvstore_pb2 as kvstore__pb2", "from kvstore_client.proto import kvstore_pb2 as kvstore__pb2"
        )
    )
    (out_dir / "etcd").mkdir(exist_ok=True)
    args = [
        "protoc",
        f"-I{src}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(src / "etcd" / "kv.proto"),
        str(src / "etcd" / "rpc.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed (etcd)")
    (out_dir / "etcd" / "kv_pb2_grpc.py").unlink()  # kv.proto has no service
    for name in ("rpc_pb2.py", "rpc_pb2_grpc.py"):
        path = out_dir / "etcd" / name
        path.write_text(
            path.read_text()
            .replace("from etcd import kv_pb2", "from kvstore_client.proto.etcd import kv_pb2")
            .replace("from etcd import rpc_pb2", "from kvstore_client.proto.etcd import rpc_pb2")
        )


def main() -> None:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            generate(Path(tmp))
            stale = [f for f in OUTPUTS if not filecmp.cmp(Path(tmp) / f, HERE / f, shallow=False)]
        if stale:
            print("stale generated code:", ", ".join(stale), "- run python -m kvstore_client.proto.generate")
            raise SystemExit(1)
        print("generated code is up to date")
        return
    generate(HERE)
    print("wrote", ", ".join(OUTPUTS), "to", os.path.relpath(HERE))


if __name__ == "__main__":
    main()
