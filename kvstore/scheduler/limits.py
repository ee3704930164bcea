"""What one caller may make the conductor hold: sizes of the values it keeps, and caps per caller.

The conductor keeps some of what callers send for as long as an engine or a request lives (engine
ids, request ids) and echoes some in replies and error messages, so each caller-controlled field
has a size limit, checked before anything is kept: InvalidRequest (INVALID_ARGUMENT on gRPC,
INVALID on the conductor port) that names the field and the limit, never the value. What each
caller keeps is capped as well (:class:`ConductorLimits`): engines registered, namespaces it has
engines in, requests in flight; a tenant's token gets :data:`TENANT_LIMITS`, an admin token and
every caller of a pool without an access file :data:`TRUSTED_LIMITS`. The numbers are policy;
:mod:`kvstore.scheduler.ledger` counts against them. ``docs/security.md`` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstore.errors import InvalidRequest
from kvstore_client.errors import ConfigError, QuotaExceeded
from kvstore_client.keys import MAX_DIGEST_LEN

MAX_REQUEST_ID_BYTES = 256  # a request id is kept while the request is in flight (a UUID is 32)
MAX_ENGINE_ID_BYTES = 256  # an engine id is kept while the engine is registered
MAX_SCHEDULE_BLOCKS = 131_072  # block digests in one Schedule: a 2M-token prompt at 16 tokens a block
MAX_DIGEST_BYTES = MAX_DIGEST_LEN  # one block digest, as everywhere in the pool


@dataclass(frozen=True)
class ConductorLimits:
    """The most one caller (one token) may hold in the master's conductor at once."""

    engines: int  # engines registered, over every namespace
    namespaces: int  # namespaces it has engines in (each holds a conductor while it has one)
    requests: int  # requests scheduled and not yet finished, cancelled or expired, over every namespace

    def __post_init__(self) -> None:
        for name in ("engines", "namespaces", "requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"conductor limit {name} must be at least 1, got {getattr(self, name)}")


TENANT_LIMITS = ConductorLimits(engines=256, namespaces=64, requests=20_000)
TRUSTED_LIMITS = ConductorLimits(engines=4_096, namespaces=1_024, requests=200_000)


class ConductorLimitExceeded(QuotaExceeded):
    """A caller already holds as many engines or namespaces in the conductor as its limits allow
    (RESOURCE_EXHAUSTED; the SDK raises QuotaExceeded): deregister engines first."""


def check_request_id(request_id: str) -> str:
    """The request id, or InvalidRequest when longer than MAX_REQUEST_ID_BYTES ("" is allowed:
    the conductor picks one)."""
    return _check_size(request_id, "request_id", MAX_REQUEST_ID_BYTES)


def check_engine_id(engine_id: str) -> str:
    """The engine id: non-empty, printable, at most MAX_ENGINE_ID_BYTES; else InvalidRequest."""
    if not engine_id:
        raise InvalidRequest("an engine_id is required")
    _check_size(engine_id, "engine_id", MAX_ENGINE_ID_BYTES)
    if not engine_id.isprintable():
        raise InvalidRequest("engine_id must be printable")
    return engine_id


def check_block_digests(digests: Sequence[bytes]) -> Sequence[bytes]:
    """At most MAX_SCHEDULE_BLOCKS digests of 1..MAX_DIGEST_BYTES bytes each; else InvalidRequest."""
    if len(digests) > MAX_SCHEDULE_BLOCKS:
        raise InvalidRequest(f"a Schedule names at most {MAX_SCHEDULE_BLOCKS} blocks, got {len(digests)}")
    if digests and not (min(map(len, digests)) > 0 and max(map(len, digests)) <= MAX_DIGEST_BYTES):
        raise InvalidRequest(f"block digests are 1..{MAX_DIGEST_BYTES} bytes each")
    return digests


def _check_size(value: str, what: str, limit: int) -> str:
    size = len(value) if len(value) > limit else len(value.encode("utf-8", "surrogatepass"))  # chars <= bytes
    if size > limit:
        raise InvalidRequest(f"{what} is {size} bytes, more than the {limit} allowed")
    return value
