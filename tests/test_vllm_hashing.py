"""kvstore_client.vllm_hashing computes the block hashes a vLLM engine computes.

The vllm-marked tests compare with vLLM itself (its hash functions and the
block hasher of a real engine-core Request); the fixed vectors below were
produced by vLLM 0.32 and pin the hashes where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore_client.errors import ConfigError, InvalidKey, KVStoreError
from kvstore_client.vllm_hashing import ALGOS, VLLMBlockHasher, hash_block_tokens, prompt_tail, tail_hash

SQL = ("sql-adapter", "/adapters/sql")
MIXED = [7, 0, 3, 151_000, 2**31, 9, 9, 9, 1, 2, 3, 4, 5]  # 3 full blocks of 4 and a partial one
SHA_NONE = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
CBOR_NONE = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
XX_NONE, XXCBOR_NONE = "6fb31cc38bba6066183f7f2104b9c051", "1ebe36576dcb573f26b99533a20aaeca"  # seed "0"

# (algo, seed, block_size, tokens, (lora_name, lora_path) | None, cache_salt, NONE_HASH, block hashes)
VECTORS = {
    "sha256": (
        "sha256",
        None,
        16,
        list(range(40)),
        None,
        None,
        SHA_NONE,
        [
            "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798",
            "8be7aaa33831156d316f1f463ae57e643deb63f42e633e2d631df88815cc4629",
        ],
    ),
    "sha256-lora-salt": (
        "sha256",
        None,
        4,
        MIXED,
        SQL,
        "tenant-a",
        SHA_NONE,
        [
            "f3c31743667ad9c0deb536d316e46d65770017e759a9973faeb8513632dd8d35",
            "7b50cf6a70816bf4795cb1e4654f50a5a20e4883fb4de33847dd0fbac3a77f59",
            "6614796ee1e7f37edba00539c1b941048fb2a25a56eddd734b8a6c5cfb22cfb0",
        ],
    ),
    # lora_name == lora_path: pickle would back-reference one shared str object.
    "sha256-lora-name-is-path": (
        "sha256",
        None,
        4,
        [5] * 8,
        ("same", "same"),
        None,
        SHA_NONE,
        [
            "7a76a0135e2753f4fb83cc066167f52cfd5fdcd0529b013b72299145223a06d2",
            "4c7664a16bbc8ab3b4721b6fccb89fb244a6c391eb61c05437ca24f99d90fd41",
        ],
    ),
    "sha256_cbor": (
        "sha256_cbor",
        None,
        16,
        list(range(40)),
        None,
        None,
        CBOR_NONE,
        [
            "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
            "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
        ],
    ),
    "sha256_cbor-lora-salt": (
        "sha256_cbor",
        None,
        4,
        MIXED,
        SQL,
        "tenant-a",
        CBOR_NONE,
        [
            "9420d3312078b329b727a3a340fed5ffa1d4f77dbe849e9e0dbef1b6b528f183",
            "a853ab847ef04742028753a76c2939acdb1e1a8a0b7ea000bc7eb64687b083a1",
            "4050e1fa489733508ab010829f54c6e08a18de73dffe045be7adbb076a705181",
        ],
    ),
    "xxhash-seed0-lora-salt": (
        "xxhash",
        "0",
        4,
        MIXED,
        SQL,
        "tenant-a",
        XX_NONE,
        [
            "5feda31239939870d9978c36c2e2fdd5",
            "c6ceb665ff9a7e38ad0dbe5754c8af5c",
            "b43a8846a43ef919d5cc0256baea02d2",
        ],
    ),
    "xxhash_cbor-seed0-lora-salt": (
        "xxhash_cbor",
        "0",
        4,
        MIXED,
        SQL,
        "tenant-a",
        XXCBOR_NONE,
        [
            "8118e11e53d13e22a823eccfdf12308a",
            "0252e37583ebbc14dca227b2daccacc4",
            "d0234e95469ac6fbfcbfcbd9f5d5d3a3",
        ],
    ),
}


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    """Every test starts as a process without PYTHONHASHSEED, the default vLLM rule applies."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def hasher_for(algo, seed, block_size, lora, salt) -> VLLMBlockHasher:
    name, path = lora or (None, None)
    return VLLMBlockHasher(block_size, algo, seed=seed, lora_name=name, lora_path=path, cache_salt=salt)


# --- fixed vectors (no vLLM needed) ---------------------------------------------------------


@pytest.mark.parametrize("case", sorted(VECTORS))
def test_fixed_vectors(case):
    algo, seed, block_size, tokens, lora, salt, none_hex, expected = VECTORS[case]
    h = hasher_for(algo, seed, block_size, lora, salt)
    assert h.none_hash.hex() == none_hex
    assert [x.hex() for x in h.hashes(tokens)] == expected


def test_seed_from_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    for algo in ("xxhash", "xxhash_cbor"):
        _, _, block_size, tokens, lora, salt, none_hex, expected = VECTORS[f"{algo}-seed0-lora-salt"]
        h = hasher_for(algo, None, block_size, lora, salt)
        assert h.seed == "0" and h.none_hash.hex() == none_hex
        assert [x.hex() for x in h.hashes(tokens)] == expected
    # PYTHONHASHSEED wins over the fixed default for the cryptographic algorithms too.
    assert VLLMBlockHasher(16).none_hash.hex() != SHA_NONE
    assert VLLMBlockHasher(16).none_hash == VLLMBlockHasher(16, seed="0").none_hash
    monkeypatch.delenv("PYTHONHASHSEED")
    assert VLLMBlockHasher(16).seed == "vllm-none-hash"
    assert VLLMBlockHasher(16).none_hash.hex() == SHA_NONE


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_seed_is_a_config_error(algo):
    with pytest.raises(ConfigError, match="random") as err:
        VLLMBlockHasher(16, algo)
    assert "PYTHONHASHSEED" in str(err.value)
    assert len(VLLMBlockHasher(16, algo, seed="7").none_hash) == 16


def test_digest_sizes_and_keys():
    for algo in ALGOS:
        h = VLLMBlockHasher(4, algo, seed="1")
        hashes = h.hashes(range(10))
        assert len(hashes) == 2 and {len(x) for x in hashes} == {32 if algo.startswith("sha") else 16}
        assert h.keys("llama", range(10)) == [("llama", x) for x in hashes]
    with pytest.raises(InvalidKey):
        VLLMBlockHasher(4).keys("", range(8))


def test_only_full_blocks_and_parent_continues_the_chain():
    h = hasher_for("sha256", None, 4, SQL, "tenant-a")
    full = h.hashes(MIXED)
    assert len(full) == 3 and h.hashes(MIXED[:12]) == full and h.hashes(MIXED[:3]) == []
    # The salt is on the request's first block only, so a continuation needs no salt logic.
    assert h.hashes(MIXED[4:], parent=full[0]) == full[1:]
    assert h.hashes(MIXED[8:], parent=bytearray(full[1])) == full[2:]
    assert hasher_for("sha256", None, 4, SQL, None).hashes(MIXED)[0] != full[0]
    assert hasher_for("sha256", None, 4, SQL, None).hashes(MIXED)[1:] != full[1:]  # chained
    no_salt = hasher_for("sha256", None, 4, SQL, None).hashes(MIXED)
    assert hasher_for("sha256", None, 4, SQL, "").hashes(MIXED) == no_salt  # vLLM skips an empty salt


def test_tail_hash_is_deterministic_and_names_parent_and_tokens():
    import hashlib
    import struct

    parent = VLLMBlockHasher(4).hashes(MIXED)[-1]
    tail = [5, 6, 7]
    want = hashlib.sha256(b"kvstore-tail-v1" + struct.pack("<I", 32) + parent + struct.pack("<3q", *tail)).digest()
    assert tail_hash(parent, tail) == want  # the encoding is fixed: routers and engines must agree
    assert tail_hash(parent, tuple(tail)) == tail_hash(bytearray(parent), np.array(tail, dtype=np.int32)) == want
    assert tail_hash(parent, [5, 6, 8]) != want and tail_hash(parent, [5, 6]) != want
    assert tail_hash(VLLMBlockHasher(4).hashes(MIXED)[-2], tail) != want
    assert tail_hash(b"\x01" + parent, tail[1:]) != tail_hash(parent + b"\x05", tail[1:])  # lengths delimit


def test_a_tail_hash_is_never_a_full_blocks_hash():
    for algo in ALGOS:
        h = VLLMBlockHasher(4, algo, seed="1")
        parent = h.hashes(MIXED[:4])[0]
        assert tail_hash(parent, MIXED[4:8]) != h.hashes(MIXED[4:8], parent=parent)[0]
    with pytest.raises(InvalidKey):
        tail_hash(b"", [1, 2])
    with pytest.raises(InvalidKey):
        tail_hash(parent, [1 << 64])
    with pytest.raises(InvalidKey):
        tail_hash(parent, [True, 2])


def test_which_prompts_have_a_tail():
    assert prompt_tail(list(range(10)), 4) == (8, 9)  # two full blocks, then two tokens
    assert prompt_tail(np.arange(11), 4) == (8, 9, 10)
    assert prompt_tail(list(range(9)), 4) is None  # one token: vLLM computes it anyway
    assert prompt_tail(list(range(8)), 4) is None  # full blocks only
    assert prompt_tail(list(range(3)), 4) is None  # no full block: nothing to chain to


def test_token_containers_hash_alike():
    h = VLLMBlockHasher(4)
    want = h.hashes(MIXED)
    assert h.hashes(tuple(MIXED)) == want
    assert h.hashes(iter(MIXED)) == want
    assert h.hashes(np.array(MIXED, dtype=np.int64)) == want
    assert h.hashes([np.int64(t) for t in MIXED]) == want
    small = list(range(150_000, 150_012))
    assert h.hashes(np.array(small, dtype=np.int32)) == h.hashes(small)
    torch = pytest.importorskip("torch")
    assert h.hashes(torch.tensor(MIXED, dtype=torch.int64)) == want


def test_module_hash_block_tokens_is_one_link():
    h = hasher_for("sha256_cbor", None, 4, SQL, "tenant-a")
    lora = ("lora",) + SQL
    first = hash_block_tokens("sha256_cbor", None, MIXED[:4], (lora, ("cache_salt", "tenant-a")), h.none_hash)
    second = hash_block_tokens("sha256_cbor", first, np.array(MIXED[4:8]), (lora,), h.none_hash)
    assert h.hashes(MIXED)[:2] == [first, second]
    assert hash_block_tokens(lambda obj: repr(obj).encode(), b"", [1], None, b"N") == b"(b'N', (1,), None)"


def test_content_keys_take_vllms_order():
    """LoRA first, then multimodal keys, the salt on block 0, prompt-embeds keys last."""
    h = hasher_for("sha256", None, 4, SQL, "s")
    mm, embeds = ("mm", "img-1", 2), ("prompt_embeds", b"\x01" * 32)
    got = h.hashes(MIXED, extra_keys=[[embeds, list(mm)], None, (mm,), None])
    lora = ("lora",) + SQL
    first = hash_block_tokens("sha256", None, MIXED[:4], (lora, mm, ("cache_salt", "s"), embeds), h.none_hash)
    second = hash_block_tokens("sha256", first, MIXED[4:8], (lora,), h.none_hash)
    third = hash_block_tokens("sha256", second, MIXED[8:12], (lora, mm), h.none_hash)
    assert got == [first, second, third]
    plain = VLLMBlockHasher(4)
    assert plain.hashes(MIXED, extra_keys=[None] * 3) == plain.hashes(MIXED)


@pytest.mark.parametrize(
    "make",
    [
        lambda: VLLMBlockHasher(16, "md5"),
        lambda: VLLMBlockHasher(16, None),
        lambda: VLLMBlockHasher(0),
        lambda: VLLMBlockHasher(-4),
        lambda: VLLMBlockHasher(1.5),
        lambda: VLLMBlockHasher(True),
        lambda: VLLMBlockHasher(16, seed=0),
        lambda: VLLMBlockHasher(16, lora_name="a"),
        lambda: VLLMBlockHasher(16, lora_name="a", lora_path=""),
        lambda: VLLMBlockHasher(16, cache_salt=b"salt"),
        lambda: hash_block_tokens("blake3", None, [1], None, b"N"),
        lambda: hash_block_tokens(42, None, [1], None, b"N"),
    ],
)
def test_bad_settings_are_config_errors(make):
    with pytest.raises(ConfigError):
        make()


@pytest.mark.parametrize(
    "call",
    [
        lambda h: h.hashes([1, 2, 3, 4.0]),
        lambda h: h.hashes([1, 2, 3, "4"]),
        lambda h: h.hashes([1, 2, 3, True]),
        lambda h: h.hashes(np.array([1.0, 2.0, 3.0, 4.0])),
        lambda h: h.hashes(np.ones((2, 4), dtype=np.int64)),
        lambda h: h.hashes(np.array([True] * 4)),
        lambda h: h.hashes("abcd"),
        lambda h: h.hashes(b"abcd"),
        lambda h: h.hashes(None),
        lambda h: h.hashes(7),
        lambda h: h.hashes([1] * 4, parent=b""),
        lambda h: h.hashes([1] * 4, parent="ab"),
        lambda h: h.hashes([1] * 8, extra_keys=[None]),
        lambda h: h.hashes([1] * 8, extra_keys=[None] * 4),
        lambda h: h.hashes([1] * 4, extra_keys=[(("lora", "x", "y"),)]),
        lambda h: h.hashes([1] * 4, extra_keys=[(("cache_salt", "x"),)]),
        lambda h: h.hashes([1] * 4, extra_keys=[("mm", "x", 0)]),  # a key, not a tuple of keys
        lambda h: h.hashes([1] * 4, extra_keys=["mm"]),
        lambda h: h.hashes([1] * 4, extra_keys=7),
        lambda h: hash_block_tokens("sha256", None, [1], [("mm", "x", 0)], b"N"),
        lambda h: hash_block_tokens("sha256", "parent", [1], None, b"N"),
        lambda h: hash_block_tokens("sha256", None, [1], None, b""),
    ],
)
def test_bad_input_is_invalid_key(call):
    with pytest.raises(InvalidKey) as err:
        call(VLLMBlockHasher(4))
    assert isinstance(err.value, KVStoreError)


def test_import_needs_no_vllm_torch_numpy_or_cbor2():
    case = VECTORS["sha256-lora-salt"]
    code = f"""
import json, sys
for name in ("vllm", "torch", "numpy", "cbor2"):
    sys.modules[name] = None  # importing any of them now raises ImportError
import kvstore_client, kvstore_client.vllm_hashing as vh
h = vh.VLLMBlockHasher(4, lora_name={SQL[0]!r}, lora_path={SQL[1]!r}, cache_salt="tenant-a")
hashes = [x.hex() for x in h.hashes({case[3]!r})]
try:
    vh.VLLMBlockHasher(4, "sha256_cbor")
    cbor = "no error"
except kvstore_client.ConfigError as exc:
    cbor = str(exc)
print(json.dumps({{"hashes": hashes, "cbor": cbor}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["hashes"] == case[7]
    assert "cbor2" in result["cbor"]


# --- against vLLM itself ---------------------------------------------------------------------

COMBOS = {"plain": (None, None), "lora": (SQL, None), "salt": (None, "tenant-a"), "lora+salt": (SQL, "tenant-a")}


@pytest.fixture
def kcu(monkeypatch):
    """vLLM's kv_cache_utils, with its NONE_HASH globals restored after the test."""
    pytest.importorskip("vllm")
    import vllm.v1.core.kv_cache_utils as kcu

    monkeypatch.setattr(kcu, "NONE_HASH", getattr(kcu, "NONE_HASH", None), raising=False)
    monkeypatch.setattr(kcu, "_NONE_HASH_SEED", kcu._NONE_HASH_SEED)
    return kcu


def vllm_setup(kcu, monkeypatch, algo: str, seed: str | None):
    """Initialise vLLM's NONE_HASH as an engine core would; return (hash fn, NONE_HASH)."""
    from vllm.utils.hashing import get_hash_fn_by_name

    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    return fn, kcu.NONE_HASH


def vllm_request(kcu, tokens, block_size, fn, lora=None, salt=None, mm_features=None, wire=True):
    """A vLLM Request as the engine core builds it, with vLLM's own block hasher.

    ``wire`` sends the EngineCoreRequest through vLLM's msgpack codec first,
    as the default multi-process engine does.
    """
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    core = EngineCoreRequest(
        request_id="req-0",
        prompt_token_ids=list(tokens),
        mm_features=mm_features,
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        cache_salt=salt,
        data_parallel_rank=None,
    )
    if wire:
        core = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(core))
    return Request.from_engine_core_request(core, kcu.get_request_block_hasher(block_size, fn))


def seed_for(algo: str) -> str | None:
    return "1234" if algo.startswith("xxhash") else None


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(VECTORS))
def test_vectors_are_vllms(case, kcu, monkeypatch):
    algo, seed, block_size, tokens, lora, salt, none_hex, expected = VECTORS[case]
    fn, none_hash = vllm_setup(kcu, monkeypatch, algo, seed)
    assert none_hash.hex() == none_hex
    assert [x.hex() for x in vllm_request(kcu, tokens, block_size, fn, lora, salt).block_hashes] == expected


@pytest.mark.vllm
@pytest.mark.parametrize("combo", sorted(COMBOS))
@pytest.mark.parametrize("algo", ALGOS)
def test_matches_vllm_hash_block_tokens(algo, combo, kcu, monkeypatch):
    lora, salt = COMBOS[combo]
    fn, none_hash = vllm_setup(kcu, monkeypatch, algo, seed_for(algo))
    tokens = list(np.random.default_rng(7).integers(0, 152_000, size=70).tolist())
    for block_size in (1, 5, 16):
        h = hasher_for(algo, None, block_size, lora, salt)
        assert h.none_hash == none_hash
        chain, parent = [], None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            keys = [("lora",) + lora] if lora else []
            keys += [("cache_salt", salt)] if salt and start == 0 else []
            extra = tuple(keys) or None
            block = tokens[start : start + block_size]
            parent = kcu.hash_block_tokens(fn, parent, block, extra)
            assert hash_block_tokens(algo, chain[-1] if chain else None, block, extra, none_hash) == parent
            chain.append(parent)
        assert h.hashes(tokens) == chain


@pytest.mark.vllm
@pytest.mark.parametrize("combo", sorted(COMBOS))
@pytest.mark.parametrize("algo", ALGOS)
def test_matches_vllm_request_block_hasher(algo, combo, kcu, monkeypatch):
    """The check that matters: a real engine-core Request, its prompt and then decoded tokens."""
    lora, salt = COMBOS[combo]
    fn, _ = vllm_setup(kcu, monkeypatch, algo, seed_for(algo))
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 152_000, size=101).tolist()
    output = rng.integers(0, 152_000, size=40).tolist()
    for block_size in (1, 7, 16, 64):
        h = hasher_for(algo, None, block_size, lora, salt)
        for wire in (True, False):
            req = vllm_request(kcu, prompt, block_size, fn, lora, salt, wire=wire)
            assert h.hashes(prompt) == list(req.block_hashes)
            for tok in output[:3]:
                req.append_output_token_ids(tok)
            req.append_output_token_ids(output[3:])
            assert h.hashes(prompt + output) == list(req.block_hashes)
            assert len(req.block_hashes) == len(prompt + output) // block_size


@pytest.mark.vllm
@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_lora_name_equal_to_path_matches_the_engine_core(algo, kcu, monkeypatch):
    """Pickle-based hashes depend on str identity; the engine core sees decoded, distinct strs."""
    fn, _ = vllm_setup(kcu, monkeypatch, algo, seed_for(algo))
    tokens = list(range(100, 132))
    for name in ("adapter", "x", "lora"):
        req = vllm_request(kcu, tokens, 8, fn, (name, name), name)
        assert hasher_for(algo, None, 8, (name, name), name).hashes(tokens) == list(req.block_hashes)


@pytest.mark.vllm
@pytest.mark.parametrize("algo", ALGOS)
def test_multimodal_extra_keys_reproduce_vllm(algo, kcu, monkeypatch):
    """Given vLLM's own per-block mm keys, LoRA and salt on top come out as vLLM's."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    fn, _ = vllm_setup(kcu, monkeypatch, algo, seed_for(algo))
    placements = [("img-aaaa", 3, 10), ("img-bbbb", 13, 4), ("img-aaaa", 30, 20)]
    features = [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=o, length=n)
        )
        for ident, o, n in placements
    ]
    tokens = list(range(1000, 1060))
    block_size = 8
    plain = vllm_request(kcu, tokens, block_size, fn, mm_features=features)
    mm_keys, mm_idx = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        keys, mm_idx = kcu.generate_block_hash_extra_keys(plain, start, start + block_size, mm_idx)
        mm_keys.append(keys)
    assert mm_keys[0] == (("mm", "img-aaaa", 3),)
    assert mm_keys[1] == (("mm", "img-aaaa", -5), ("mm", "img-bbbb", 5))
    assert VLLMBlockHasher(block_size, algo).hashes(tokens, extra_keys=mm_keys) == list(plain.block_hashes)
    # Keys that came over JSON (lists, fresh strs, a tag that is not the interned literal) too.
    decoded = json.loads(json.dumps(mm_keys))
    assert VLLMBlockHasher(block_size, algo).hashes(tokens, extra_keys=decoded) == list(plain.block_hashes)

    full = vllm_request(kcu, tokens, block_size, fn, SQL, "tenant-a", mm_features=features)
    h = hasher_for(algo, None, block_size, SQL, "tenant-a")
    assert h.hashes(tokens, extra_keys=mm_keys + [None]) == list(full.block_hashes)  # + the partial block
