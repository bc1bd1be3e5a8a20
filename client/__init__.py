"""kvtier's client library: what an engine installs to talk to kvtierd.

It never imports the daemon; everything here is the wire API, keys, and shared memory.
"""

from kvtier.client.aio import AsyncClient, AsyncRegisteredPool
from kvtier.client.cuda import CudaIpcExport, CudaPool
from kvtier.client.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KvtierError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UntrustedSocketError,
)
from kvtier.client.jobs import (
    AsyncTransferJob,
    JobKind,
    JobState,
    JobStatus,
    LoadSegment,
    SaveSegment,
    TransferJob,
)
from kvtier.client.keys import Namespace, block_key, block_keys
from kvtier.client.pool import SharedMemoryPool
from kvtier.client.sync import Client, RegisteredPool, wait_until_serving
from kvtier.client.types import (
    CheckDetail,
    CheckResult,
    DeleteResult,
    DrainResult,
    EvictResult,
    GetResult,
    LookupResult,
    PrefetchResult,
    PutResult,
    PutStatus,
    QuarantinedSlot,
    QuarantineResult,
    Stats,
    TenantStats,
    TenantTierStats,
    Tier,
    TierStats,
)
from kvtier.kernels.layout import LayerLayout, PoolLayout

__all__ = [
    "AsyncClient",
    "AsyncRegisteredPool",
    "AsyncTransferJob",
    "CheckDetail",
    "CheckResult",
    "Client",
    "CudaIpcExport",
    "CudaPool",
    "DeadlineExceededError",
    "DeleteResult",
    "DrainResult",
    "EvictResult",
    "FailedPreconditionError",
    "GetResult",
    "InternalError",
    "InvalidArgumentError",
    "JobKind",
    "JobState",
    "JobStatus",
    "KvtierError",
    "LayerLayout",
    "LoadSegment",
    "LookupResult",
    "Namespace",
    "NotFoundError",
    "PermissionDeniedError",
    "PoolLayout",
    "PrefetchResult",
    "PutResult",
    "PutStatus",
    "QuarantineResult",
    "QuarantinedSlot",
    "RegisteredPool",
    "ResourceExhaustedError",
    "SaveSegment",
    "SharedMemoryPool",
    "Stats",
    "TenantStats",
    "TenantTierStats",
    "Tier",
    "TierStats",
    "TransferJob",
    "UnauthenticatedError",
    "UnavailableError",
    "UntrustedSocketError",
    "block_key",
    "block_keys",
    "wait_until_serving",
]
