"""Build the pure-Python ``kvtier-client`` wheel from this repository.

The client's modules are copied, exactly and only them, into ``build/client-src/kvtier/``
beside a copy of ``packaging/client/pyproject.toml``, and a wheel is built there. Which
modules: ``CLIENT_FILES`` below; ``tests/packaging`` checks that importing every module of
the wheel needs nothing else of kvtier and no package beyond grpcio, protobuf and numpy.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CLIENT_FILES = (
    "__init__.py",
    "paths.py",
    "client/__init__.py",
    "client/aio.py",
    "client/errors.py",
    "client/flows.py",
    "client/health.py",
    "client/keys.py",
    "client/pool.py",
    "client/sync.py",
    "client/types.py",
    "client/integrations/__init__.py",
    "client/integrations/transformers.py",
    "kernels/layout.py",
    "proto/__init__.py",
    "proto/kvtier.proto",
    "proto/kvtier_pb2.py",
    "proto/kvtier_pb2.pyi",
    "proto/kvtier_pb2_grpc.py",
    "proto/wire.py",
)
# kernels/__init__.py of the full package may grow imports of the native kernel; the client
# needs only the layout arithmetic.
KERNELS_INIT = '"""Layout arithmetic (the native copy kernel ships with the daemon)."""\n'


def stage(dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    pkg = dest / "kvtier"
    for name in CLIENT_FILES:
        target = pkg / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    (pkg / "kernels" / "__init__.py").write_text(KERNELS_INIT)
    shutil.copy2(ROOT / "packaging" / "client" / "pyproject.toml", dest / "pyproject.toml")
    (dest / "README.md").write_text(
        "kvtier-client: the client library of kvtier. See the kvtier README.\n"
    )
    return dest


def build(out: Path) -> Path:
    src = stage(ROOT / "build" / "client-src")
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("kvtier_client-*.whl"))
    for old in before:
        old.unlink()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        check=True,
    )
    (wheel,) = out.glob("kvtier_client-*.whl")
    return wheel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "dist"), help="folder for the wheel")
    args = p.parse_args()
    print(build(Path(args.out).resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
