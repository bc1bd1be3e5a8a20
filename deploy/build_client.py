"""Build the pure-Python ``kvtier-client`` wheel from this repository.

The client's modules are copied, exactly and only them, into ``build/client-src/kvtier/``
beside a copy of ``deploy/client/pyproject.toml``, and a wheel is built there. Which
modules: ``client_files()`` below; ``tests/packaging`` checks that importing every module of
the wheel needs nothing else of kvtier and no package beyond grpcio, protobuf and numpy.
"""

from __future__ import annotations

import argparse
import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Files the wheel always carries besides the client package and what it imports.
_ALWAYS = ("__init__.py", "proto/__init__.py", "proto/kvtier.proto", "proto/kvtier_pb2.pyi")


def client_files() -> list[str]:
    """Every module of ``client/`` and, transitively, every kvtier module they import (read
    from their ``import`` statements, lazy ones included), as paths from the repo root."""
    todo = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "client").rglob("*.py"))]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.append(node.module)
                modules += [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                modules += [a.name for a in node.names]
            for mod in modules:
                if not mod.startswith("kvtier."):
                    continue
                rel = Path(*mod.split(".")[1:])
                for candidate in (rel.with_suffix(".py"), rel / "__init__.py"):
                    if (ROOT / candidate).is_file():
                        todo.append(str(candidate))
    return sorted(seen | set(_ALWAYS))


# kernels/__init__.py of the full package may grow imports of the native kernel; the client
# needs only the layout arithmetic.
KERNELS_INIT = '"""Layout arithmetic (the native copy kernel ships with the daemon)."""\n'


def stage(dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    pkg = dest / "kvtier"
    for name in client_files():
        target = pkg / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    (pkg / "kernels" / "__init__.py").write_text(KERNELS_INIT)
    shutil.copy2(ROOT / "deploy" / "client" / "pyproject.toml", dest / "pyproject.toml")
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
