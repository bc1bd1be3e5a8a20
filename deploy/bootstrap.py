"""Create or update the development virtual environment for one purpose, under a lock.

``make run``, ``make test`` and the other make targets call this first; it needs only the
standard library of Python >= 3.10. Profiles (what each target needs):

- ``run``: kvtier and its runtime dependencies only (no torch, no test tools);
- ``example``: plus torch and transformers (``examples/prefix_reuse.py``);
- ``dev``: plus the test, lint and plot tools (``make test``, ``make lint``).

Without CUDA (no ``nvidia-smi``), torch is installed first from PyTorch's CPU index by its
pinned version, so no resolver ever picks the multi-GB CUDA build. What is installed is
recorded in the venv with a hash of the files that define it, so a second call returns at once,
and a change to ``pyproject.toml``, ``setup.py`` or the C kernel reinstalls. Two calls at once
(``make run`` and ``make test`` in two shells) take turns on a lock file beside the venv: the
second waits, then finds the work done.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH_VERSION = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROFILES: dict[str, tuple[str, ...]] = {
    "run": (),
    "example": ("transformers",),
    "dev": ("dev", "transformers", "plot", "redis"),
}
NEEDS_TORCH = {"example", "dev"}
# Every pip install below is held to this set of versions (checked together by .ci/run).
CONSTRAINTS = "deploy/constraints.txt"
INPUTS = ("pyproject.toml", "setup.py", "kernels/_copy.c", CONSTRAINTS)


def say(text: str) -> None:
    print(f"[kvtier] {text}", flush=True)


def inputs_hash() -> str:
    h = hashlib.sha256()
    for name in INPUTS:
        h.update(name.encode() + b"\0" + (ROOT / name).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def read_stamp(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


def pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", *args]
    started = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    say(f"  done in {time.monotonic() - started:.0f}s")


def installed_extras(stamp: dict[str, object], digest: str) -> set[str] | None:
    """The extras the venv's stamp says are installed from these inputs for this checkout
    (None: install again). The editable install names one checkout: a venv that another
    checkout (a git worktree) installed itself into imports that checkout's code."""
    recorded = stamp.get("extras")
    if stamp.get("hash") != digest or stamp.get("root") != str(ROOT):
        return None
    return {str(x) for x in recorded} if isinstance(recorded, list) else None


def ensure(venv_dir: Path, profile: str) -> None:
    python = venv_dir / "bin" / "python"
    stamp_path = venv_dir / ".kvtier-installed"
    want = set(PROFILES[profile])
    digest = inputs_hash()
    stamp = read_stamp(stamp_path)
    have = installed_extras(stamp, digest)
    if have is not None and want <= have and python.exists():
        return
    if not python.exists():
        say(f"creating {venv_dir} (Python {sys.version.split()[0]})")
        venv.EnvBuilder(with_pip=True, clear=venv_dir.exists()).create(venv_dir)
        pip(python, "install", "--upgrade", "--disable-pip-version-check", "-q", "pip")
    extras = sorted(want | (have or set()))
    if profile in NEEDS_TORCH or "transformers" in extras:
        if has_cuda():
            say("CUDA found: torch comes from the default index with the CUDA build")
        elif not _installed(python, "torch", TORCH_VERSION):
            index = os.environ.get("TORCH_INDEX", TORCH_CPU_INDEX)
            say(f"no CUDA: installing torch {TORCH_VERSION}, CPU build, from {index}")
            pip(
                python,
                "install",
                "--progress-bar",
                "on",
                "--retries",
                "2",
                "--index-url",
                index,
                f"torch=={TORCH_VERSION}",
            )
    spec = f".[{','.join(extras)}]" if extras else "."
    what = "runtime dependencies only" if not extras else f"extras {', '.join(extras)}"
    say(f"installing kvtier (editable) with {what}")
    pip(python, "install", "--progress-bar", "on", "-c", str(ROOT / CONSTRAINTS), "-e", spec)
    stamp_path.write_text(json.dumps({"hash": digest, "root": str(ROOT), "extras": extras}))
    say(f"{venv_dir} is ready for `make {profile if profile != 'dev' else 'test'}`")


def _installed(python: Path, name: str, version: str) -> bool:
    code = (
        "import importlib.metadata as m, sys\n"
        f"try: v = m.version({name!r})\n"
        "except m.PackageNotFoundError: sys.exit(1)\n"
        f"sys.exit(0 if v.split('+')[0] == {version!r} else 1)\n"
    )
    return subprocess.run([str(python), "-c", code], check=False).returncode == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=".venv")
    p.add_argument("--profile", choices=sorted(PROFILES), default="dev")
    args = p.parse_args()
    venv_dir = (ROOT / args.venv).resolve()
    lock_path = venv_dir.parent / f".{venv_dir.name}.lock"
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another make is installing into {venv_dir}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            ensure(venv_dir, args.profile)
        except subprocess.CalledProcessError as e:
            say(f"failed: {' '.join(e.cmd)} exited with {e.returncode}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
