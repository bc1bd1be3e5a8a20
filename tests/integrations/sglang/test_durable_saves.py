"""``save_durable`` against a daemon whose disk tier does not write every page it is sent
(past the tenant's L2 quota): SGLang's real host pools and factory-built backend, its cache
controller's own backup code, a real kvtierd.

The daemon holds every page it is sent; its disk writes the first two. A page held but not
written is answered not stored (SGLang asked for it on disk), and is no gap in its chain:
the pages after it are sent and held, whichever way they travel (zero copy or staged).
"""

from __future__ import annotations

from pathlib import Path

import torch
from harness import DaemonFactory, l2_quota_args
from sglang_harness import ControllerCalls, attach, fill, mha_host_pool, storage_config

PAGE = 4
QUOTA_PAGES = 2


def page_bytes(host: object) -> int:
    page = host.get_dummy_flat_data_page()  # type: ignore[attr-defined]
    return int(page.numel() * page.element_size())


def tokens(n_pages: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 30_000, (n_pages * PAGE,), generator=g).tolist()


def test_regression_save_durable_answered_pages_its_disk_did_not_write_stored(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A zero-copy durable store of 4 pages past the L2 quota of 2: the backend answered all
    4 stored, reading only which pages the daemon held, so SGLang's backup counted them on
    disk; the 2 its disk did not write are answered not stored (SGLang's controller then
    counts none of that batch backed up), and the daemon still holds all 4."""
    host = mha_host_pool("page_first")
    daemon = daemon_factory(*l2_quota_args(tmp_path / "l2", QUOTA_PAGES * page_bytes(host)))
    backend = attach(host, storage_config(daemon.address, save_durable=True))
    try:
        assert backend.mode == "direct"
        keys = [f"durable-{i}" for i in range(4)]
        src = host.alloc(4 * PAGE)
        fill(host, src, seed=1)
        assert backend.batch_set_v1(keys, src) == [True, True, False, False]
        assert backend.batch_exists(keys) == 4
        # SGLang's backup of a batch the disk has no room for (the quota is used up).
        calls = ControllerCalls(backend, host)
        seq = tokens(2, seed=2)
        more = host.alloc(2 * PAGE)
        fill(host, more, seed=3)
        assert calls.backup(seq, more) == 0
        assert calls.hit_query(seq)[1] == 2 * PAGE  # held all the same
    finally:
        backend.close()
    plain = attach(host, storage_config(daemon.address))
    try:
        src = host.alloc(PAGE)
        fill(host, src, seed=4)
        assert plain.batch_set_v1(["not-durable"], src) == [True]
    finally:
        plain.close()


def test_regression_a_staged_durable_store_stopped_at_a_page_its_disk_did_not_write(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A staged durable store of 6 pages, 2 a Put (a staging pool of 4 pages), past the L2
    quota of 2: the third and fourth pages are held but not written, and the store stopped
    there as at a page the daemon refused, so the last 2 were not sent at all, where a
    zero-copy store of the same batch has the daemon hold all 6. Now all 6 are held; the 4
    not written are answered not stored."""
    host = mha_host_pool("layer_first", "default")
    size = page_bytes(host)
    daemon = daemon_factory(*l2_quota_args(tmp_path / "l2", QUOTA_PAGES * size))
    backend = attach(
        host, storage_config(daemon.address, save_durable=True, staging_bytes=4 * size)
    )
    try:
        assert backend.mode == "staged"
        keys = [f"staged-durable-{i}" for i in range(6)]
        src = host.alloc(6 * PAGE)
        fill(host, src, seed=5)
        assert backend.batch_set_v1(keys, src) == [True, True] + [False] * 4
        assert backend.batch_exists(keys) == 6
    finally:
        backend.close()
