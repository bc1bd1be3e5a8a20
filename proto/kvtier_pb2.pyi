from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_ABSENT: _ClassVar[Tier]
    TIER_L0_GPU: _ClassVar[Tier]
    TIER_L1_HOST: _ClassVar[Tier]
    TIER_L2_DISK: _ClassVar[Tier]
    TIER_L3_REMOTE: _ClassVar[Tier]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]

class PutResult(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STORED: _ClassVar[PutResult]
    PUT_EXISTS: _ClassVar[PutResult]
    PUT_REJECTED_FULL: _ClassVar[PutResult]
TIER_ABSENT: Tier
TIER_L0_GPU: Tier
TIER_L1_HOST: Tier
TIER_L2_DISK: Tier
TIER_L3_REMOTE: Tier
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT8_E4M3: DType
DTYPE_FLOAT8_E5M2: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
PUT_STORED: PutResult
PUT_EXISTS: PutResult
PUT_REJECTED_FULL: PutResult

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "credential_ticket", "token", "given_up_sessions", "given_up_tickets")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_TICKET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    GIVEN_UP_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    GIVEN_UP_TICKETS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    credential_ticket: bytes
    token: bytes
    given_up_sessions: _containers.RepeatedScalarFieldContainer[str]
    given_up_tickets: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, client_name: _Optional[str] = ..., credential_ticket: _Optional[bytes] = ..., token: _Optional[bytes] = ..., given_up_sessions: _Optional[_Iterable[str]] = ..., given_up_tickets: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "ping_interval_s", "tenant", "admin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PING_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ping_interval_s: int
    tenant: str
    admin: bool
    def __init__(self, session_id: _Optional[str] = ..., ping_interval_s: _Optional[int] = ..., tenant: _Optional[str] = ..., admin: bool = ...) -> None: ...

class LayerLayout(_message.Message):
    __slots__ = ("offset", "kv_count", "kv_stride", "page_stride", "chunk_bytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    KV_COUNT_FIELD_NUMBER: _ClassVar[int]
    KV_STRIDE_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    kv_count: int
    kv_stride: int
    page_stride: int
    chunk_bytes: int
    def __init__(self, offset: _Optional[int] = ..., kv_count: _Optional[int] = ..., kv_stride: _Optional[int] = ..., page_stride: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("layers", "num_pages", "block_tokens", "dtype")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerLayout]
    num_pages: int
    block_tokens: int
    dtype: DType
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerLayout, _Mapping]]] = ..., num_pages: _Optional[int] = ..., block_tokens: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ShmRegion(_message.Message):
    __slots__ = ("name", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class FdRegion(_message.Message):
    __slots__ = ("ticket", "size_bytes")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    size_bytes: int
    def __init__(self, ticket: _Optional[bytes] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcRegion(_message.Message):
    __slots__ = ("handle", "device", "size_bytes", "buffers", "device_uuid")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    device: int
    size_bytes: int
    buffers: _containers.RepeatedCompositeFieldContainer[CudaIpcBuffer]
    device_uuid: bytes
    def __init__(self, handle: _Optional[bytes] = ..., device: _Optional[int] = ..., size_bytes: _Optional[int] = ..., buffers: _Optional[_Iterable[_Union[CudaIpcBuffer, _Mapping]]] = ..., device_uuid: _Optional[bytes] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("handle", "alloc_offset", "size_bytes", "pool_offset")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ALLOC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    alloc_offset: int
    size_bytes: int
    pool_offset: int
    def __init__(self, handle: _Optional[bytes] = ..., alloc_offset: _Optional[int] = ..., size_bytes: _Optional[int] = ..., pool_offset: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("session_id", "shm", "cuda_ipc", "fd", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    FD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    shm: ShmRegion
    cuda_ipc: CudaIpcRegion
    fd: FdRegion
    layout: PoolLayout
    def __init__(self, session_id: _Optional[str] = ..., shm: _Optional[_Union[ShmRegion, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcRegion, _Mapping]] = ..., fd: _Optional[_Union[FdRegion, _Mapping]] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "block_bytes", "sealed")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    block_bytes: int
    sealed: bool
    def __init__(self, pool_id: _Optional[int] = ..., block_bytes: _Optional[int] = ..., sealed: bool = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("session_id", "pool_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: int
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[int] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "keys", "pin", "lease_ms", "namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pin: bool
    lease_ms: int
    namespace: str
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., pin: bool = ..., lease_ms: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_len", "tiers", "lease_id")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    lease_id: int
    def __init__(self, prefix_len: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., lease_id: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "keys", "pages", "parent_key", "durable", "namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pages: _containers.RepeatedScalarFieldContainer[int]
    parent_key: bytes
    durable: bool
    namespace: str
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., pages: _Optional[_Iterable[int]] = ..., parent_key: _Optional[bytes] = ..., durable: bool = ..., namespace: _Optional[str] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("results", "stored", "persisted")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    PERSISTED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedScalarFieldContainer[PutResult]
    stored: int
    persisted: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, results: _Optional[_Iterable[_Union[PutResult, str]]] = ..., stored: _Optional[int] = ..., persisted: _Optional[_Iterable[bool]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "keys", "pages", "lease_id", "layer_begin", "layer_end", "namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pages: _containers.RepeatedScalarFieldContainer[int]
    lease_id: int
    layer_begin: int
    layer_end: int
    namespace: str
    def __init__(self, session_id: _Optional[str] = ..., pool_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., pages: _Optional[_Iterable[int]] = ..., lease_id: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("loaded", "prefix_len")
    LOADED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    loaded: _containers.RepeatedScalarFieldContainer[bool]
    prefix_len: int
    def __init__(self, loaded: _Optional[_Iterable[bool]] = ..., prefix_len: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: int
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "keys", "deadline_ms", "priority", "namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    deadline_ms: int
    priority: int
    namespace: str
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., deadline_ms: _Optional[int] = ..., priority: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("resident", "scheduled", "missing")
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    resident: int
    scheduled: int
    missing: int
    def __init__(self, resident: _Optional[int] = ..., scheduled: _Optional[int] = ..., missing: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("session_id", "keys", "namespace", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    namespace: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., namespace: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "missing", "busy")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    missing: int
    busy: int
    def __init__(self, deleted: _Optional[int] = ..., missing: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("session_id", "keys", "tier", "namespace", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: Tier
    namespace: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[Tier, str]] = ..., namespace: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("evicted", "missing", "busy")
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    evicted: int
    missing: int
    busy: int
    def __init__(self, evicted: _Optional[int] = ..., missing: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class CheckRequest(_message.Message):
    __slots__ = ("session_id", "settle_ms", "list_limit")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SETTLE_MS_FIELD_NUMBER: _ClassVar[int]
    LIST_LIMIT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    settle_ms: int
    list_limit: int
    def __init__(self, session_id: _Optional[str] = ..., settle_ms: _Optional[int] = ..., list_limit: _Optional[int] = ...) -> None: ...

class CheckDetail(_message.Message):
    __slots__ = ("problem", "keys", "slots", "keys_total", "slots_total")
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    problem: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedScalarFieldContainer[int]
    keys_total: int
    slots_total: int
    def __init__(self, problem: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[int]] = ..., keys_total: _Optional[int] = ..., slots_total: _Optional[int] = ...) -> None: ...

class CheckResponse(_message.Message):
    __slots__ = ("problems", "strict", "blocks", "sessions", "leases", "pools", "details")
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    problems: _containers.RepeatedScalarFieldContainer[str]
    strict: bool
    blocks: int
    sessions: int
    leases: int
    pools: int
    details: _containers.RepeatedCompositeFieldContainer[CheckDetail]
    def __init__(self, problems: _Optional[_Iterable[str]] = ..., strict: bool = ..., blocks: _Optional[int] = ..., sessions: _Optional[int] = ..., leases: _Optional[int] = ..., pools: _Optional[int] = ..., details: _Optional[_Iterable[_Union[CheckDetail, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("session_id", "resume")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    resume: bool
    def __init__(self, session_id: _Optional[str] = ..., resume: bool = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "sessions")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    sessions: int
    def __init__(self, draining: bool = ..., sessions: _Optional[int] = ...) -> None: ...

class QuarantineRequest(_message.Message):
    __slots__ = ("session_id", "release", "slots")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    release: bool
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., release: bool = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class QuarantinedSlot(_message.Message):
    __slots__ = ("slot", "slot_bytes", "file", "offset", "reason", "at", "tried")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    TRIED_FIELD_NUMBER: _ClassVar[int]
    slot: int
    slot_bytes: int
    file: str
    offset: int
    reason: str
    at: float
    tried: bool
    def __init__(self, slot: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., file: _Optional[str] = ..., offset: _Optional[int] = ..., reason: _Optional[str] = ..., at: _Optional[float] = ..., tried: bool = ...) -> None: ...

class QuarantineResponse(_message.Message):
    __slots__ = ("held", "released", "held_count", "held_bytes", "untried_count", "deferred")
    HELD_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    HELD_COUNT_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNTRIED_COUNT_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedCompositeFieldContainer[QuarantinedSlot]
    released: _containers.RepeatedScalarFieldContainer[int]
    held_count: int
    held_bytes: int
    untried_count: int
    deferred: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, held: _Optional[_Iterable[_Union[QuarantinedSlot, _Mapping]]] = ..., released: _Optional[_Iterable[int]] = ..., held_count: _Optional[int] = ..., held_bytes: _Optional[int] = ..., untried_count: _Optional[int] = ..., deferred: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks", "state")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    state: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "counters", "gauges", "uptime_s", "version", "addresses", "metrics_url", "tenants")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class GaugesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    GAUGES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, int]
    gauges: _containers.ScalarMap[str, float]
    uptime_s: float
    version: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    metrics_url: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., gauges: _Optional[_Mapping[str, float]] = ..., uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., metrics_url: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "sessions", "tiers")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    sessions: int
    tiers: _containers.RepeatedCompositeFieldContainer[TenantTierStats]
    def __init__(self, tenant: _Optional[str] = ..., sessions: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TenantTierStats, _Mapping]]] = ...) -> None: ...

class TenantTierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "quota_bytes", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    used_bytes: int
    quota_bytes: int
    blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., used_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...
