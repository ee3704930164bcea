"""vLLM's prefix-cache block hashes, computed without importing vLLM.

A router, the master's conductor or a CLI names a prompt's blocks exactly as
a vLLM v1 engine does (checked against vLLM 0.32), so it can look them up in
the store before the engine runs::

    NONE_HASH = H(seed)
    h_i       = H((h_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))

``H`` is one of vLLM's ``--prefix-caching-hash-algo`` choices: ``sha256`` and
``xxhash`` serialise with pickle (highest protocol), ``sha256_cbor`` and
``xxhash_cbor`` with canonical CBOR; then SHA-256 (32 bytes) or XXH3-128
(16 bytes). ``extra_keys_i`` is ``("lora", name, path)`` on every block when a
LoRA adapter is set, then the caller's content keys for block i, then
``("cache_salt", salt)`` on the request's first block only; ``None`` when
there are none. Only full blocks have a hash.

Out of scope: multimodal (``("mm", identifier, offset)``) and prompt-embeds
(``("prompt_embeds", digest)``) keys are not derived here, as they need
vLLM's multimodal processing. A caller with such prompts passes its own keys
per block through ``extra_keys``; given the tuples vLLM derives, the hashes
are vLLM's.

The pickle-based algorithms hash object identity too (pickle back-references
a repeated object): hashes match an engine core that received the request
over msgpack, vLLM's default multi-process mode. An in-process engine given
one str object as both lora_name and lora_path hashes differently.

``block_size`` must be the engine's *hash* block size: the cache block size,
times the decode-context-parallel size where the cache is sharded, and for
hybrid models the GCD of the group block sizes (or ``prefix_match_unit``).

A prompt's partial last block has no vLLM hash. ``prompt_tail`` and ``tail_hash``
name it for the pool (kvstore's own key, not vLLM's): the KV connector stores it
under that key and a router waits for it, so a decode engine loads all but the
prompt's last token.
"""

from __future__ import annotations

import hashlib
import operator
import os
import pickle
import struct
import sys
from typing import Any, Callable, Sequence

import xxhash

from kvstore_client.errors import ConfigError, InvalidKey
from kvstore_client.keys import BlockKey, make_keys

ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
# Not collision resistant: vLLM keeps their seed secret (random per process).
_NON_CRYPTO = frozenset({"xxhash", "xxhash_cbor"})
# Keys the hasher adds itself; callers set them on the constructor.
_OWN_TAGS = frozenset({"lora", "cache_salt"})
#: domain tag of a partial last block's key (tail_hash): no full block's hash starts so
TAIL_TAG = b"kvstore-tail-v1"
#: a shorter tail is the one token vLLM computes anyway: not worth a key
MIN_TAIL_TOKENS = 2

HashFn = Callable[[Any], bytes]


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _xxhash(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _cbor_dumps() -> Callable[[Any], bytes]:
    """cbor2's canonical encoder; cbor2 is only needed for the *_cbor algorithms."""
    try:
        import cbor2
    except ImportError:
        raise ConfigError(
            "the sha256_cbor and xxhash_cbor algorithms need the cbor2 package (pip install cbor2)"
        ) from None

    def dumps(obj: Any) -> bytes:
        return cbor2.dumps(obj, canonical=True)

    return dumps


def hash_fn(algo: str) -> HashFn:
    """The object-to-digest function vLLM uses for ``algo``."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        return _xxhash
    if algo == "sha256_cbor":
        dumps = _cbor_dumps()
        return lambda obj: hashlib.sha256(dumps(obj)).digest()
    if algo == "xxhash_cbor":
        dumps = _cbor_dumps()
        return lambda obj: xxhash.xxh3_128_digest(dumps(obj))
    raise ConfigError(f"unknown vLLM prefix-caching hash algorithm {algo!r}; use one of {', '.join(ALGOS)}")


def _token_tuple(tokens: Any) -> tuple[int, ...]:
    """Tokens (list, tuple, numpy array, torch tensor...) as a tuple of Python ints.

    vLLM hashes a tuple of Python ints; a numpy int or a bool pickles differently.
    """
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidKey(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    if not isinstance(tokens, (list, tuple)) and hasattr(tokens, "tolist"):
        tokens = tokens.tolist()  # numpy arrays and tensors: Python scalars in one C call
    try:
        out = tuple(tokens)
    except TypeError:
        raise InvalidKey(f"tokens must be a sequence of ints, not {type(tokens).__name__}") from None
    if all(type(t) is int for t in out):
        return out
    return tuple(_token(t) for t in out)


def _token(t: Any) -> int:
    if isinstance(t, bool):
        raise InvalidKey("a token id cannot be a bool")
    try:
        return int(operator.index(t))
    except TypeError:
        raise InvalidKey(f"token ids must be ints, got {type(t).__name__}") from None


def _as_received(s: str) -> str:
    """An equal str with the identity vLLM's engine core gives it.

    Pickle writes an object met twice in one call as a back-reference, so
    ``("lora", p, p)`` hashes differently from ``("lora", p, copy_of_p)``. The
    engine core decodes every string of a request from msgpack separately:
    equal strings are distinct objects, except CPython's shared one-character
    latin-1 strings (and ``""``). Copies made here behave the same.
    """
    if len(s) == 1:
        return chr(ord(s))
    if not s:
        return ""
    return s[:1] + s[1:]


def _content_key(key: Any) -> tuple:
    """One caller-supplied extra key, normalised as vLLM would have built it."""
    if isinstance(key, list):
        key = tuple(key)
    if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
        raise InvalidKey(f"an extra key is a tuple starting with a str tag, not {key!r:.80}")
    if key[0] in _OWN_TAGS:
        raise InvalidKey(f"{key[0]!r} keys come from the hasher: pass lora_name/lora_path/cache_salt to it")
    # vLLM's tags are string literals (interned); values arrive decoded from msgpack.
    tag = sys.intern(str(key[0]))
    return (tag, *(_as_received(v) if isinstance(v, str) else v for v in key[1:]))


def hash_block_tokens(
    algo_fn_or_name: str | HashFn,
    parent: bytes | None,
    tokens: Any,
    extra_keys: tuple | None,
    none_hash: bytes,
) -> bytes:
    """Hash of one full block, as vLLM's ``hash_block_tokens`` with ``NONE_HASH = none_hash``.

    ``extra_keys`` is hashed as given (a tuple of key tuples, or None); a
    falsy ``parent`` means the first block of a chain.
    """
    fn = hash_fn(algo_fn_or_name) if isinstance(algo_fn_or_name, str) else algo_fn_or_name
    if not callable(fn):
        raise ConfigError(f"algo must be a hash function or one of {', '.join(ALGOS)}")
    if not isinstance(none_hash, bytes) or not none_hash:
        raise InvalidKey("none_hash must be non-empty bytes")
    if parent is not None and not isinstance(parent, bytes):
        raise InvalidKey(f"parent must be bytes or None, not {type(parent).__name__}")
    if extra_keys is not None and not isinstance(extra_keys, tuple):
        raise InvalidKey(f"extra_keys must be a tuple or None, not {type(extra_keys).__name__}")
    return fn((parent or none_hash, _token_tuple(tokens), extra_keys))


class VLLMBlockHasher:
    """vLLM's block hash chain for one engine configuration and request kind.

    ``seed`` is the ``PYTHONHASHSEED`` of the vLLM engine's environment; with
    ``None`` the rule is vLLM's, read from this process: ``PYTHONHASHSEED`` if
    set, else ``"vllm-none-hash"`` for sha256/sha256_cbor. xxhash/xxhash_cbor
    without either raise ConfigError, since vLLM then seeds them randomly per
    process. Stateless after construction, so threads may share one.
    """

    def __init__(
        self,
        block_size: int,
        algo: str = "sha256",
        *,
        seed: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        cache_salt: str | None = None,
    ):
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(algo, str):
            raise ConfigError(f"algo must be one of {', '.join(ALGOS)}, not {algo!r}")
        self._fn = hash_fn(algo)
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            if algo in _NON_CRYPTO:
                raise ConfigError(
                    f"{algo} needs a seed: with PYTHONHASHSEED unset, vLLM seeds {algo} with random "
                    "bytes per process, so no other process can reproduce its block hashes. Run vLLM "
                    "with PYTHONHASHSEED set and pass the same value as seed= (or set it here too)"
                )
            seed = DEFAULT_NONE_HASH_SEED
        if not isinstance(seed, str):
            raise ConfigError(f"seed must be a str (PYTHONHASHSEED's value), not {type(seed).__name__}")
        if (lora_name is None) != (lora_path is None):
            raise ConfigError("lora_name and lora_path go together: vLLM hashes both")
        for name, value in (("lora_name", lora_name), ("lora_path", lora_path), ("cache_salt", cache_salt)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a str, not {type(value).__name__}")
        if lora_path == "":
            raise ConfigError("lora_path cannot be empty (vLLM rejects such a LoRA request)")

        self.block_size = block_size
        self.algo = algo
        self.seed = seed
        self.lora_name, self.lora_path, self.cache_salt = lora_name, lora_path, cache_salt
        self.none_hash: bytes = self._fn(seed)
        self._lora_keys: tuple = (
            (("lora", _as_received(lora_name), _as_received(lora_path)),)
            if lora_name is not None and lora_path is not None
            else ()  # both or neither (checked above)
        )
        # vLLM skips an empty salt, as it skips None.
        self._salt_keys: tuple = (("cache_salt", _as_received(cache_salt)),) if cache_salt else ()

    def _extra_keys(self, first: bool, content: Any) -> tuple | None:
        """A block's extra keys in vLLM's order: LoRA, content (mm), salt, prompt embeds."""
        keys: tuple = self._lora_keys
        embeds: tuple = ()
        if content is not None:
            if not isinstance(content, (tuple, list)):
                raise InvalidKey(f"each block's extra keys are a tuple of keys or None, not {content!r:.80}")
            normalised = [_content_key(k) for k in content]
            keys += tuple(k for k in normalised if k[0] != "prompt_embeds")
            embeds = tuple(k for k in normalised if k[0] == "prompt_embeds")
        if first:
            keys += self._salt_keys
        keys += embeds
        return keys or None

    def hashes(
        self,
        tokens: Any,
        *,
        parent: bytes | None = None,
        extra_keys: Sequence[tuple | None] | None = None,
    ) -> list[bytes]:
        """The hash of every full block of ``tokens``, in chain order.

        ``parent`` continues a chain (the hash of the block before ``tokens``;
        the cache salt then applies to no block, being on the request's first
        only). ``extra_keys[i]`` holds block i's content keys (multimodal,
        prompt embeds), one entry per full block, optionally one more for a
        trailing partial block, which is ignored.
        """
        toks = _token_tuple(tokens)
        bs = self.block_size
        n = len(toks) // bs
        if parent is None:
            prev = self.none_hash
        elif isinstance(parent, (bytes, bytearray, memoryview)) and len(parent):
            prev = bytes(parent)
        else:
            raise InvalidKey(f"parent must be a non-empty block hash (bytes), not {parent!r:.80}")
        if extra_keys is not None:
            if isinstance(extra_keys, (str, bytes)) or not hasattr(extra_keys, "__len__"):
                raise InvalidKey("extra_keys must be a sequence with one entry per block")
            if len(extra_keys) not in (n, -(-len(toks) // bs)):
                raise InvalidKey(f"{n} full blocks but {len(extra_keys)} entries in extra_keys")
        fn = self._fn
        out: list[bytes] = []
        for i in range(n):
            content = None if extra_keys is None else extra_keys[i]
            extra = self._extra_keys(i == 0 and parent is None, content)
            prev = fn((prev, toks[i * bs : (i + 1) * bs], extra))
            out.append(prev)
        return out

    def keys(
        self,
        namespace: str,
        tokens: Any,
        *,
        parent: bytes | None = None,
        extra_keys: Sequence[tuple | None] | None = None,
    ) -> list[BlockKey]:
        """Store keys (``namespace``, vLLM block hash) of every full block of ``tokens``."""
        return make_keys(namespace, self.hashes(tokens, parent=parent, extra_keys=extra_keys))


def prompt_tail(tokens: Any, block_size: int) -> tuple[int, ...] | None:
    """The tokens of a prompt's partial last block, when the pool keeps that block; else None.

    Only a prompt with at least one full block has one (the last full block's hash, the
    tail's parent, carries the cache salt, the LoRA adapter and the seed), and only a tail of
    at least ``MIN_TAIL_TOKENS`` (vLLM computes the prompt's last token whatever the pool holds).
    """
    full = len(tokens) // block_size
    if full == 0 or len(tokens) - full * block_size < MIN_TAIL_TOKENS:
        return None
    return _token_tuple(tokens[full * block_size :])


def tail_hash(parent: bytes, tokens: Any) -> bytes:
    """The pool's key digest for a prompt's partial last block: SHA-256 over ``TAIL_TAG``, the
    length and bytes of ``parent`` (the hash of the prompt's last full block) and ``tokens``
    (the tail's token ids, little-endian int64).

    vLLM hashes full blocks only, so the tail needs a name of kvstore's own, computed alike by
    the connector that stores it and by anyone who looks it up. The tag keeps it apart from
    every full block's hash (those hash a pickle or CBOR encoding, or are 16 bytes), the
    parent chains it to the whole prefix as vLLM's hashes do, and the length-prefixed,
    fixed-width encoding makes distinct (parent, tokens) pairs distinct inputs.
    """
    if not isinstance(parent, (bytes, bytearray, memoryview)) or not len(parent):
        raise InvalidKey(f"parent must be a non-empty block hash (bytes), not {parent!r:.80}")
    toks = _token_tuple(tokens)
    try:
        packed = struct.pack(f"<{len(toks)}q", *toks)
    except struct.error:
        raise InvalidKey("tail token ids must fit in 64 bits") from None
    parent = bytes(parent)
    return hashlib.sha256(TAIL_TAG + struct.pack("<I", len(parent)) + parent + packed).digest()
