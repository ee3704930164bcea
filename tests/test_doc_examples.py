"""Every Python example in the README and docs/ runs as printed against a pool started here.

A block is skipped only when the line before it says why (``<!-- example not run: ... -->``);
the master address the docs print, 127.0.0.1:7700, is replaced with this pool's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from processes import ROOT, start_master, start_node

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:^(<!-- example not run: (?P<why>[^\n]*?) -->)\n)?^```python\n(?P<code>.*?)^```", re.M | re.S)
DOC_MASTER = "127.0.0.1:7700"


def examples():
    for path in DOCS:
        for n, match in enumerate(_BLOCK.finditer(path.read_text()), start=1):
            yield pytest.param(match.group("code"), match.group("why"), id=f"{path.name}#{n}")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    master = start_master(ttl=5.0)
    node = start_node(master.record["master"], tmp_path_factory.mktemp("doc-pool"), dram="256MiB", ssd="256MiB")
    yield master.record["master"]
    node.close()
    master.close()


def test_the_docs_have_examples():
    assert sum(1 for _ in examples()) >= 5


@pytest.mark.parametrize("code,why", list(examples()))
def test_example_runs_as_printed(code, why, pool, tmp_path):
    if why is not None:
        assert why.strip(), "a skipped example says why"
        pytest.skip(why)
    script = tmp_path / "example.py"
    script.write_text(code.replace(DOC_MASTER, pool))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KVSTORE_TOKEN", None)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
