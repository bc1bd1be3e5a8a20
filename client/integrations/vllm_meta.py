"""What the vLLM connector's scheduler side tells its workers each step, and back.

Plain dataclasses of lists, ints and bytes: vLLM pickles them from the scheduler process to
the worker processes. Keys and leases are per rank: ``rank = pp_rank * tp_size + tp_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """Load blocks of one request: ``keys[rank][i]`` into engine block ``block_ids[i]``."""

    req_id: str
    block_ids: list[int]
    keys: dict[int, list[bytes]]
    leases: dict[int, int] = field(default_factory=dict)


RECENT_STEPS = 4
"""Steps after a layer-wise load during which a block it filled counts as read by a save
(``SaveSpec.reads``), and a failure of it taints saves that read it: vLLM's async
scheduling plans up to two steps before it learns a step's outcome, and the failing
request is recomputed in the step after it does."""


@dataclass
class SaveSpec:
    """Store engine blocks ``block_ids`` of one request as ``keys[rank]``, continuing the
    chain after ``parents[rank]`` (empty for a chain's first block).

    ``at_finish``: the request has finished and vLLM keeps its blocks until the worker
    reports it in ``finished_sending``; otherwise the blocks are copied during this step's
    forward pass (``save_kv_layer``), right after each layer's attention wrote them.

    ``reads``: the engine blocks of the request's block table, up to the last one stored,
    that a layer-wise load filled in this step or in the ``RECENT_STEPS`` before it (for
    another request, vLLM's prefix cache shares them: with async scheduling a step is
    planned before vLLM has seen whether an earlier step's load failed). These blocks are
    computed over them, so a load of one that fails taints them too."""

    req_id: str
    block_ids: list[int]
    keys: dict[int, list[bytes]]
    parents: dict[int, bytes]
    at_finish: bool = False
    reads: list[int] = field(default_factory=list)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """``rewound``: the requests that workers named in ``failed_loads`` and the scheduler side
    has seen since its previous step: from this step on their saves are planned again from
    where vLLM rewound them. Until then a worker withholds their saves (a step scheduled
    before vLLM saw the failure, as its async scheduling does, computes them over it)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    rewound: set[str] = field(default_factory=set)


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers tell the scheduler side after a step: leases whose loads they have
    finished with (the scheduler releases them), and requests whose load failed in part on
    some worker (after an async load, the scheduler offers those no hit until vLLM has
    scheduled them again).

    ``staging_refused``: True from a worker whose staging pool the daemon refused (a limit,
    a layout it will not take), in every step while it is: that worker cannot load, so the
    scheduler offers no hit (and plans no save) until told False, which a worker says once,
    in the step after its pool was accepted; None says nothing. Workers' metadata
    aggregate to True if any says True, else False if any says False."""

    done_leases: set[int] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    staging_refused: bool | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        states = {self.staging_refused, other.staging_refused}
        refused = True if True in states else False if False in states else None
        return KVTierWorkerMetadata(
            self.done_leases | other.done_leases, self.failed_loads | other.failed_loads, refused
        )
