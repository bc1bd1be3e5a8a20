"""The kvtier-client wheel: pure Python, grpcio + protobuf + numpy only, and working against a
real daemon with the oldest and the newest versions of those three it declares; and the
committed generated modules are exactly what the pinned grpcio-tools makes.

Each case builds a fresh venv and downloads packages: run with ``make test-packaging``.
"""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy"))
from build_client import build  # noqa: E402

OLDEST = ["grpcio==1.49.1", "protobuf==3.20.3", "numpy==1.24.4"]
DIRECT = {"grpcio", "protobuf", "numpy"}
# What those three require themselves (six for old grpcio, typing-extensions for new), read
# from the venv's own metadata.
THEIR_REQUIREMENTS = textwrap.dedent(
    """
    import importlib.metadata as m, json, re
    names = set()
    for dist in ("grpcio", "protobuf", "numpy"):
        for req in m.requires(dist) or []:
            if "extra ==" not in req:
                names.add(re.split(r"[ ;<>=!~\\[]", req, 1)[0].lower().replace("_", "-"))
    print(json.dumps(sorted(names)))
    """
)

ROUND_TRIP = textwrap.dedent(
    """
    import asyncio, importlib, json, sys
    import google.protobuf, grpc, numpy
    from kvtier.client import AsyncClient, Client, Namespace, PoolLayout, SharedMemoryPool
    for name in ("kvtier.client", "kvtier.client.aio", "kvtier.client.sync",
                 "kvtier.client.keys", "kvtier.kernels.layout", "kvtier.proto.kvtier_pb2_grpc",
                 "kvtier.paths"):
        importlib.import_module(name)
    layout = PoolLayout.staging(num_layers=2, num_pages=8, block_tokens=4, chunk_bytes=4096)
    with Client(sys.argv[1]) as client, SharedMemoryPool.for_layout(layout) as shm:
        ns = Namespace(model="compat", kv_dtype="uint8", block_tokens=4)
        pool = client.register_pool(shm, layout, ns)
        data = shm.array()
        data[:] = numpy.arange(len(data), dtype=numpy.uint64).astype(numpy.uint8)
        want = data.copy()
        stored = pool.store(list(range(16)), range(4))
        data[:] = 0
        loaded = pool.load(list(range(16)), range(4))
        span = 4 * layout.block_bytes  # staging pages are contiguous blocks
        same = bool((data[:span] == want[:span]).all()) and not data[span:].any()
        stats = client.stats()
        healthy = client.health()

    async def main():
        async with AsyncClient(sys.argv[1]) as c:
            return await c.health(), (await c.lookup([b"x" * 32])).prefix_len

    print(json.dumps({
        "versions": [grpc.__version__, google.protobuf.__version__, numpy.__version__],
        "stored": stored, "loaded": loaded, "same": same, "healthy": healthy,
        "blocks": stats.tiers[0].blocks, "aio": list(asyncio.run(main())),
        "modules": sorted(m.split(".")[0] for m in sys.modules if m.startswith("kvtier")),
    }))
    """
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("wheel"))


def _venv(path: Path, *packages: str) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *packages],
        check=True,
        timeout=600,
    )
    return python


def test_the_wheel_is_pure_python_and_holds_only_the_client(wheel):
    assert wheel.name.endswith("-py3-none-any.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".so", ".c", ".pyd"))]
    packages = {n.split("/")[1] for n in names if n.startswith("kvtier/") and n.count("/") > 1}
    assert packages == {"client", "kernels", "proto"}
    assert "kvtier/kernels/copy.py" not in names  # the native kernel's wrapper stays out


@pytest.mark.parametrize("pins", [OLDEST, []], ids=["oldest", "newest"])
def test_the_client_works_with_its_oldest_and_newest_dependencies(wheel, tmp_path, pins, daemon):
    python = _venv(tmp_path / "venv", str(wheel), *pins)
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"],
        check=True,
        capture_output=True,
        text=True,
    )
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    theirs = subprocess.run(
        [str(python), "-c", THEIR_REQUIREMENTS], check=True, capture_output=True, text=True
    )
    allowed = {"kvtier-client", "pip", "setuptools", *DIRECT, *json.loads(theirs.stdout)}
    assert installed >= DIRECT and installed <= allowed, installed - allowed
    out = subprocess.run(
        [str(python), "-c", ROUND_TRIP, daemon.address],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the checkout: kvtier must come from the wheel
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if pins:
        assert result["versions"] == [p.split("==")[1] for p in pins]
    assert result["stored"] == result["loaded"] == 16 and result["same"]
    assert result["healthy"] and result["blocks"] == 4
    assert result["aio"] == [True, 0]


def test_the_generated_modules_are_what_the_pinned_grpcio_tools_makes(tmp_path):
    makefile = (ROOT / "Makefile").read_text()
    version = next(
        line.split("?=")[1].strip()
        for line in makefile.splitlines()
        if line.startswith("GRPC_TOOLS")
    )
    python = _venv(tmp_path / "venv", f"grpcio-tools=={version}")
    out = tmp_path / "gen"
    out.mkdir()
    subprocess.run(
        [
            str(python),
            "-m",
            "grpc_tools.protoc",
            f"-Ikvtier/proto={ROOT / 'proto'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(ROOT / "proto" / "kvtier.proto"),
        ],
        check=True,
    )
    for name in ("kvtier_pb2.py", "kvtier_pb2.pyi", "kvtier_pb2_grpc.py"):
        assert filecmp.cmp(out / "kvtier" / "proto" / name, ROOT / "proto" / name, shallow=False), (
            f"proto/{name} is stale: run `make proto`"
        )
