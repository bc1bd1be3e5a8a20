"""Another engine process: store a token sequence's pages through its own host pool and
backend, then exit. Prints one JSON line: tokens stored, the transfer mode and the pages'
bytes (hex). Run by test_hicache_storage.py with the suite's interpreter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torchvision_shim  # noqa: F401  (before SGLang)
from sglang_harness import (
    ControllerCalls,
    attach,
    fill,
    mha_host_pool,
    storage_config,
)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    seq = spec["tokens"]
    host = mha_host_pool(spec["layout"], "shm")
    backend = attach(host, storage_config(spec["address"]))
    src = host.alloc(len(seq))
    pages = fill(host, src, seed=spec["seed"])
    stored = ControllerCalls(backend, host).backup(seq, src)
    mode = backend.mode
    backend.close()
    print(json.dumps({"stored_tokens": stored, "mode": mode, "pages": [p.hex() for p in pages]}))


if __name__ == "__main__":
    main()
