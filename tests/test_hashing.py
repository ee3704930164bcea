"""Chained block hashing and key normalisation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore_client.errors import InvalidKey
from kvstore_client.hashing import BlockHasher, chain_hashes, namespace_name, namespace_seed
from kvstore_client.keys import check_key, digest_of, make_key, make_keys

TOKENS = list(range(1000, 1100))


def test_chain_definition():
    """h_i = XXH3_128(h_{i-1} || block tokens as LE u32), h_0 from the namespace."""
    h0 = xxhash.xxh3_128_digest(b"kvstore/v1\0" + b"llama")
    assert namespace_seed("llama") == h0
    block0 = np.array(TOKENS[:16], dtype="<u4").tobytes()
    block1 = np.array(TOKENS[16:32], dtype="<u4").tobytes()
    h1 = xxhash.xxh3_128_digest(h0 + block0)
    h2 = xxhash.xxh3_128_digest(h1 + block1)
    assert chain_hashes(TOKENS, 16, "llama")[:2] == [h1, h2]


def test_only_full_blocks_and_prefix_property():
    hashes = chain_hashes(TOKENS, 16, "m")
    assert len(hashes) == 100 // 16
    assert chain_hashes(TOKENS[:40], 16, "m") == hashes[:2]
    changed = TOKENS.copy()
    changed[20] += 1  # second block differs: its hash and every later one change
    other = chain_hashes(changed, 16, "m")
    assert other[0] == hashes[0] and all(a != b for a, b in zip(other[1:], hashes[1:]))


def test_namespaces_never_share_keys():
    a = chain_hashes(TOKENS, 16, namespace_name("llama", lora="a"))
    b = chain_hashes(TOKENS, 16, namespace_name("llama", lora="b"))
    assert not set(a) & set(b)
    assert namespace_name("llama", tenant="t1") == "llama|t1"
    assert namespace_name("llama") == "llama"
    with pytest.raises(InvalidKey):
        namespace_name("lla|ma")


def test_parent_continues_a_chain_and_extras_change_it():
    full = chain_hashes(TOKENS, 16, "m")
    tail = chain_hashes(TOKENS[32:], 16, "m", parent=full[1])
    assert tail == full[2:]
    extras = [b"img%d" % i for i in range(6)]
    assert chain_hashes(TOKENS, 16, "m", extras=extras) != full
    with pytest.raises(InvalidKey):
        chain_hashes(TOKENS, 16, "m", extras=extras[:2])


def test_token_containers_agree():
    expected = chain_hashes(TOKENS, 16, "m")
    assert chain_hashes(tuple(TOKENS), 16, "m") == expected
    assert chain_hashes(np.array(TOKENS, dtype=np.int64), 16, "m") == expected
    assert chain_hashes(np.array(TOKENS, dtype=np.int32), 16, "m") == expected
    with pytest.raises(InvalidKey):
        chain_hashes([-1] * 16, 16, "m")
    with pytest.raises(InvalidKey):
        chain_hashes(np.array([2**33] * 16), 16, "m")
    with pytest.raises(InvalidKey):
        chain_hashes(TOKENS, 0, "m")


def test_hasher_keys():
    hasher = BlockHasher("m", 16)
    keys = hasher.keys(TOKENS)
    assert keys == [("m", h) for h in chain_hashes(TOKENS, 16, "m")]
    assert all(check_key(k) is k for k in keys)


def test_same_hashes_in_other_interpreters_with_other_hash_seeds():
    script = (
        "import json; from kvstore_client.hashing import chain_hashes;"
        f"print(json.dumps([h.hex() for h in chain_hashes({TOKENS!r}, 16, 'model|tenant')]))"
    )
    runs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
    assert runs[0] == runs[1] == [h.hex() for h in chain_hashes(TOKENS, 16, "model|tenant")]


def test_engine_supplied_hashes():
    assert digest_of(5) == (5).to_bytes(16, "little")
    assert digest_of(-5) == (-5).to_bytes(16, "little", signed=True)
    assert digest_of(b"\x01" * 32) == b"\x01" * 32
    assert digest_of("00ff") == b"\x00\xff"
    assert make_keys("m", [1, b"ab"]) == [("m", (1).to_bytes(16, "little")), ("m", b"ab")]
    for bad in (2**128, -(2**127) - 1, b"", b"x" * 65, "zz", 1.5, True, None):
        with pytest.raises(InvalidKey):
            digest_of(bad)
    for ns in ("", "a\0b", "x" * 129, "é" * 65):
        with pytest.raises(InvalidKey):
            make_key(ns, 1)
    with pytest.raises(InvalidKey):
        check_key(("é" * 65, b"x"))
    assert check_key(("é", b"x")) == ("é", b"x")
