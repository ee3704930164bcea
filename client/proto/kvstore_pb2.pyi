from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    DRAM: _ClassVar[Tier]
    SSD: _ClassVar[Tier]

class EngineRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[EngineRole]
    PREFILL: _ClassVar[EngineRole]
    DECODE: _ClassVar[EngineRole]
TIER_UNSPECIFIED: Tier
DRAM: Tier
SSD: Tier
ROLE_UNSPECIFIED: EngineRole
PREFILL: EngineRole
DECODE: EngineRole

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "host", "machine_id", "data_address", "unix_socket", "shm_arena", "metrics_address", "arena_pages")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UNIX_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SHM_ARENA_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ARENA_PAGES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    machine_id: str
    data_address: str
    unix_socket: str
    shm_arena: str
    metrics_address: str
    arena_pages: str
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., machine_id: _Optional[str] = ..., data_address: _Optional[str] = ..., unix_socket: _Optional[str] = ..., shm_arena: _Optional[str] = ..., metrics_address: _Optional[str] = ..., arena_pages: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity", "used", "blocks", "hits", "misses", "evictions", "demotions", "promotions", "checksum_failures")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity: int
    used: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    demotions: int
    promotions: int
    checksum_failures: int
    def __init__(self, tier: _Optional[str] = ..., capacity: _Optional[int] = ..., used: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., checksum_failures: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("info", "tiers", "alive", "seconds_since_heartbeat", "indexed_blocks", "draining")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    info: NodeInfo
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    alive: bool
    seconds_since_heartbeat: float
    indexed_blocks: int
    draining: bool
    def __init__(self, info: _Optional[_Union[NodeInfo, _Mapping]] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., alive: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ..., indexed_blocks: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: NodeInfo
    def __init__(self, info: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class TenantBytes(_message.Message):
    __slots__ = ("tenant", "bytes")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    bytes: int
    def __init__(self, tenant: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("heartbeat_interval_s", "ttl_s", "allowances", "packed_reports")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ALLOWANCES_FIELD_NUMBER: _ClassVar[int]
    PACKED_REPORTS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    ttl_s: float
    allowances: _containers.RepeatedCompositeFieldContainer[TenantBytes]
    packed_reports: bool
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., ttl_s: _Optional[float] = ..., allowances: _Optional[_Iterable[_Union[TenantBytes, _Mapping]]] = ..., packed_reports: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "tiers", "held")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    held: _containers.RepeatedCompositeFieldContainer[TenantBytes]
    def __init__(self, node_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., held: _Optional[_Iterable[_Union[TenantBytes, _Mapping]]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "allowances")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    ALLOWANCES_FIELD_NUMBER: _ClassVar[int]
    known: bool
    allowances: _containers.RepeatedCompositeFieldContainer[TenantBytes]
    def __init__(self, known: _Optional[bool] = ..., allowances: _Optional[_Iterable[_Union[TenantBytes, _Mapping]]] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("kind", "tier", "digest")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BlockEvent.Kind]
        STORED: _ClassVar[BlockEvent.Kind]
        REMOVED: _ClassVar[BlockEvent.Kind]
    KIND_UNSPECIFIED: BlockEvent.Kind
    STORED: BlockEvent.Kind
    REMOVED: BlockEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    kind: BlockEvent.Kind
    tier: Tier
    digest: bytes
    def __init__(self, kind: _Optional[_Union[BlockEvent.Kind, str]] = ..., tier: _Optional[_Union[Tier, str]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("namespace", "events")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    def __init__(self, namespace: _Optional[str] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ...) -> None: ...

class PackedBlocks(_message.Message):
    __slots__ = ("namespace", "tier", "digest_len", "digests")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_LEN_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    tier: Tier
    digest_len: int
    digests: bytes
    def __init__(self, namespace: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., digest_len: _Optional[int] = ..., digests: _Optional[bytes] = ...) -> None: ...

class BlockReport(_message.Message):
    __slots__ = ("node_id", "full_inventory", "batches", "packed")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FULL_INVENTORY_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    full_inventory: bool
    batches: _containers.RepeatedCompositeFieldContainer[EventBatch]
    packed: _containers.RepeatedCompositeFieldContainer[PackedBlocks]
    def __init__(self, node_id: _Optional[str] = ..., full_inventory: _Optional[bool] = ..., batches: _Optional[_Iterable[_Union[EventBatch, _Mapping]]] = ..., packed: _Optional[_Iterable[_Union[PackedBlocks, _Mapping]]] = ...) -> None: ...

class ReportReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class KeyBatch(_message.Message):
    __slots__ = ("namespace", "digests")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("node_id", "tier")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tier: Tier
    def __init__(self, node_id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class KeyLocation(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class LocateReply(_message.Message):
    __slots__ = ("locations", "nodes")
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[KeyLocation]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, locations: _Optional[_Iterable[_Union[KeyLocation, _Mapping]]] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class MatchPrefixReply(_message.Message):
    __slots__ = ("node_prefix_blocks", "longest")
    class NodePrefixBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LONGEST_FIELD_NUMBER: _ClassVar[int]
    node_prefix_blocks: _containers.ScalarMap[str, int]
    longest: int
    def __init__(self, node_prefix_blocks: _Optional[_Mapping[str, int]] = ..., longest: _Optional[int] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("namespace", "bytes", "replicas", "machine_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    bytes: int
    replicas: int
    machine_id: str
    def __init__(self, namespace: _Optional[str] = ..., bytes: _Optional[int] = ..., replicas: _Optional[int] = ..., machine_id: _Optional[str] = ...) -> None: ...

class PlaceReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatusReply(_message.Message):
    __slots__ = ("nodes", "indexed_keys", "replication_factor", "conductor_address")
    NODES_FIELD_NUMBER: _ClassVar[int]
    INDEXED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    CONDUCTOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    indexed_keys: int
    replication_factor: int
    conductor_address: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., indexed_keys: _Optional[int] = ..., replication_factor: _Optional[int] = ..., conductor_address: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ProveRequest(_message.Message):
    __slots__ = ("key_id", "nonce")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    key_id: bytes
    nonce: bytes
    def __init__(self, key_id: _Optional[bytes] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ProveReply(_message.Message):
    __slots__ = ("proof",)
    PROOF_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    def __init__(self, proof: _Optional[bytes] = ...) -> None: ...

class PeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeersReply(_message.Message):
    __slots__ = ("data_addresses",)
    DATA_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    data_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, data_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id", "cancel")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    cancel: bool
    def __init__(self, node_id: _Optional[str] = ..., cancel: _Optional[bool] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("known", "indexed_blocks", "copying")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPYING_FIELD_NUMBER: _ClassVar[int]
    known: bool
    indexed_blocks: int
    copying: int
    def __init__(self, known: _Optional[bool] = ..., indexed_blocks: _Optional[int] = ..., copying: _Optional[int] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("namespace", "limit", "start_after")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    limit: int
    start_after: bytes
    def __init__(self, namespace: _Optional[str] = ..., limit: _Optional[int] = ..., start_after: _Optional[bytes] = ...) -> None: ...

class KeyEntry(_message.Message):
    __slots__ = ("namespace", "digest", "replicas")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    digest: bytes
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, namespace: _Optional[str] = ..., digest: _Optional[bytes] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

class ListKeysReply(_message.Message):
    __slots__ = ("keys", "namespaces")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyEntry]
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyEntry, _Mapping]]] = ..., namespaces: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineRegistration(_message.Message):
    __slots__ = ("namespace", "engine_id", "role", "node_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    engine_id: str
    role: EngineRole
    node_id: str
    def __init__(self, namespace: _Optional[str] = ..., engine_id: _Optional[str] = ..., role: _Optional[_Union[EngineRole, str]] = ..., node_id: _Optional[str] = ...) -> None: ...

class EngineRegistered(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("namespace", "engine_id", "queue_length", "busy_s", "running_batch", "context_tokens")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    RUNNING_BATCH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    engine_id: str
    queue_length: int
    busy_s: float
    running_batch: int
    context_tokens: int
    def __init__(self, namespace: _Optional[str] = ..., engine_id: _Optional[str] = ..., queue_length: _Optional[int] = ..., busy_s: _Optional[float] = ..., running_batch: _Optional[int] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class EngineDeregistration(_message.Message):
    __slots__ = ("namespace", "engine_id")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    engine_id: str
    def __init__(self, namespace: _Optional[str] = ..., engine_id: _Optional[str] = ...) -> None: ...

class EngineDeregistered(_message.Message):
    __slots__ = ("known", "ended_requests")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    ENDED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    known: bool
    ended_requests: int
    def __init__(self, known: _Optional[bool] = ..., ended_requests: _Optional[int] = ...) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("namespace", "request_id", "digests", "input_length", "output_length", "start_prefill")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    START_PREFILL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    request_id: str
    digests: _containers.RepeatedScalarFieldContainer[bytes]
    input_length: int
    output_length: int
    start_prefill: bool
    def __init__(self, namespace: _Optional[str] = ..., request_id: _Optional[str] = ..., digests: _Optional[_Iterable[bytes]] = ..., input_length: _Optional[int] = ..., output_length: _Optional[int] = ..., start_prefill: _Optional[bool] = ...) -> None: ...

class ScheduleReply(_message.Message):
    __slots__ = ("request_id", "prefill_engine", "prefill_node", "decode_engine", "prefix_blocks", "prefix_tokens", "fetch_from_node", "fetch_blocks", "estimated_ttft_s", "estimated_tbt_s", "reason", "detail", "decode_final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCH_FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    FETCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TBT_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_engine: str
    prefill_node: str
    decode_engine: str
    prefix_blocks: int
    prefix_tokens: int
    fetch_from_node: str
    fetch_blocks: int
    estimated_ttft_s: float
    estimated_tbt_s: float
    reason: str
    detail: str
    decode_final: bool
    def __init__(self, request_id: _Optional[str] = ..., prefill_engine: _Optional[str] = ..., prefill_node: _Optional[str] = ..., decode_engine: _Optional[str] = ..., prefix_blocks: _Optional[int] = ..., prefix_tokens: _Optional[int] = ..., fetch_from_node: _Optional[str] = ..., fetch_blocks: _Optional[int] = ..., estimated_ttft_s: _Optional[float] = ..., estimated_tbt_s: _Optional[float] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ..., decode_final: _Optional[bool] = ...) -> None: ...

class RequestEvent(_message.Message):
    __slots__ = ("namespace", "request_id", "stage")
    class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STAGE_UNSPECIFIED: _ClassVar[RequestEvent.Stage]
        PREFILL_STARTED: _ClassVar[RequestEvent.Stage]
        PREFILL_FINISHED: _ClassVar[RequestEvent.Stage]
        DECODE_FINISHED: _ClassVar[RequestEvent.Stage]
        CANCELLED: _ClassVar[RequestEvent.Stage]
    STAGE_UNSPECIFIED: RequestEvent.Stage
    PREFILL_STARTED: RequestEvent.Stage
    PREFILL_FINISHED: RequestEvent.Stage
    DECODE_FINISHED: RequestEvent.Stage
    CANCELLED: RequestEvent.Stage
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    request_id: str
    stage: RequestEvent.Stage
    def __init__(self, namespace: _Optional[str] = ..., request_id: _Optional[str] = ..., stage: _Optional[_Union[RequestEvent.Stage, str]] = ...) -> None: ...

class RequestEventReply(_message.Message):
    __slots__ = ("decode_engine", "rejected", "reason", "detail")
    DECODE_ENGINE_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    decode_engine: str
    rejected: bool
    reason: str
    detail: str
    def __init__(self, decode_engine: _Optional[str] = ..., rejected: _Optional[bool] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
