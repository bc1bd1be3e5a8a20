"""``kvtier bench vllm``: a real vLLM engine with a long shared prefix, alone vs with kvtier.

Two engines of one random-weight Llama run side by side, one plain (``vllm``), one with the
kvtier connector, both with the same CPU threads. Before every timed run each engine empties
its own prefix cache, so the shared prefix is either computed (``vllm``) or loaded from
kvtier: from L1 (``kvtier_l1``), or from L2 after the daemon was restarted, which leaves
every block on disk only (``kvtier_l2``). Measured, as medians of runs interleaved across the
three cases (so that a burst of load elsewhere on the machine slows all of them):

- TTFT: one prompt (the shared prefix plus a fresh suffix), one output token; wall time of
  ``LLM.generate``, which for one token is prefill plus the first sample;
- throughput: ``--batch`` such prompts generating ``--max-tokens`` tokens each; output
  tokens per second of wall time, prefill included.

``vllm_cached`` is the ceiling: the plain engine again, with the prefix still in its own
prefix cache (no transfer at all).

After each restart, one untimed request on an unrelated prompt lets the engine reconnect (a
new session and a new staging pool: a cost paid once per daemon restart, not per request);
the timed L2 run must then have promoted the whole prefix from disk. Every kvtier run's
outputs must be token-for-token those of the plain engine with the prefix in its own prefix
cache, computed there as the kvtier engine computed what it stored (from the warm-up prompt
alone), so both hold the same bytes (the bench fails otherwise): a loaded prefix must act
exactly like vLLM's own cached one. (Outputs of a full recompute, or of a prefix computed in
another batch, may differ in near-ties: prefills of other shapes round differently in bf16;
``recompute_matches_cached`` reports whether the recompute did.) Each kvtier run must have loaded the whole prefix, and each L2
run must start with nothing in L1. Needs vLLM: run it from the environment ``make test-vllm`` creates
(``.venv-vllm/bin/kvtier bench vllm``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO, Any

from kvtier.bench import BenchUnavailable
from kvtier.bench.common import arg_parser, scratch_folder
from kvtier.bench.jsonout import Emit
from kvtier.bench.launcher import bench_daemon
from kvtier.client import Client

BLOCK_TOKENS = 128  # vLLM's CPU block size
MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 8192,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.05,
}
# Both engines get the same CPU setup (vLLM reserves one more core when a connector is
# configured, which on a small machine would change the worker's threads).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
CASES = ("vllm", "kvtier_l1", "kvtier_l2", "vllm_cached")


class Engine:
    """A ``kvtier.bench.vllm_engine`` subprocess."""

    def __init__(self, name: str, spec: dict[str, Any], workdir: str) -> None:
        self.name = name
        self.log_path = os.path.join(workdir, f"{name}.log")
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.bench.vllm_engine", json.dumps(spec), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env={**os.environ, **ENGINE_ENV},
                cwd=workdir,
                text=True,
            )
        os.close(write_fd)
        self._answers: IO[str] = os.fdopen(read_fd)
        self._next()  # "ready"

    def run(self, prompts: list[list[int]], max_tokens: int, reset: bool = True) -> dict[str, Any]:
        assert self.proc.stdin is not None
        cmd = {"op": "run", "prompts": prompts, "max_tokens": max_tokens, "reset": reset}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next()

    def _next(self) -> dict[str, Any]:
        line = self._answers.readline()
        if not line:
            with open(self.log_path, errors="replace") as f:
                tail = f.read()[-8000:]
            raise RuntimeError(f"engine {self.name} exited ({self.proc.poll()}):\n{tail}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._answers.close()


def _checkpoint(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16).save_pretrained(
        path, safe_serialization=True
    )


@contextlib.contextmanager
def _daemon(socket_path: str, l2_dir: str, l1_bytes: int) -> Iterator[Any]:
    with bench_daemon(
        f"tiers.l1.capacity_bytes={l1_bytes}",
        "tiers.l2.enabled=true",
        f"tiers.l2.path={l2_dir}",
        f"tiers.l2.capacity_bytes={4 * l1_bytes}",
        socket_path=socket_path,
    ) as daemon:
        yield daemon


def _from_disk(address: str) -> int:
    """Blocks the daemon read from L2: promoted into L1, or straight into a pool's pages."""
    with Client(address) as client:
        stats = client.stats()
    return stats.counter("copies", direction="L2->L1") + stats.counter("loaded_from", tier="L2")


def _l1_blocks(address: str) -> int:
    with Client(address) as client:
        return sum(t.blocks for t in client.stats().tiers if t.tier.name == "L1_HOST")


def main(argv: list[str], *, emit: Emit | None = None) -> int:
    p = arg_parser("vllm", __doc__)
    p.add_argument("--prefix-tokens", type=int, default=2048, help="shared prefix (whole blocks)")
    p.add_argument("--suffix-tokens", type=int, default=64, help="each prompt's own tail")
    p.add_argument("--reps", type=int, default=5, help="interleaved repetitions (medians)")
    p.add_argument("--batch", type=int, default=4, help="prompts of a throughput run")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens of a throughput run")
    p.add_argument(
        "--load-mode",
        choices=("auto", "layerwise", "async"),
        default="auto",
        help="the connector's load_mode (auto: layerwise here, one worker)",
    )
    p.add_argument(
        "--l2-dir",
        default=None,
        help="where the L2 slot files go (a temporary folder inside; default: the system temp "
        "folder). Use a disk filesystem, not tmpfs, for a cold read",
    )
    args = p.parse_args(argv)
    if args.prefix_tokens % BLOCK_TOKENS or not 0 < args.suffix_tokens < BLOCK_TOKENS:
        p.error(f"--prefix-tokens must be whole {BLOCK_TOKENS}-token blocks; --suffix-tokens 1-127")
    if importlib.util.find_spec("vllm") is None:
        raise BenchUnavailable(
            "kvtier bench vllm needs vLLM in this environment; `make test-vllm` creates one: "
            ".venv-vllm/bin/kvtier bench vllm"
        )

    rng = random.Random(0)
    prefix = [rng.randrange(3, MODEL["vocab_size"]) for _ in range(args.prefix_tokens)]

    def prompt() -> list[int]:
        return prefix + [rng.randrange(3, MODEL["vocab_size"]) for _ in range(args.suffix_tokens)]

    prefix_blocks = args.prefix_tokens // BLOCK_TOKENS
    kv_bytes_per_token = (
        2 * MODEL["num_hidden_layers"] * MODEL["num_key_value_heads"] * MODEL["head_dim"] * 2
    )
    l1_bytes = max(256 << 20, 4 * (args.prefix_tokens + args.batch * 256) * kv_bytes_per_token)
    max_model_len = args.prefix_tokens + args.suffix_tokens + args.max_tokens + 64
    work = tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir="/tmp")
    l2_dir = str(scratch_folder(args.l2_dir, "kvtier-bench-vllm-l2-"))
    socket_path = os.path.join(work, "kvtierd.sock")
    model = os.path.join(work, "model")
    ttft: dict[str, list[float]] = {c: [] for c in CASES}
    tput: dict[str, list[float]] = {c: [] for c in CASES}
    engines: list[Engine] = []
    stack = contextlib.ExitStack()
    try:
        _checkpoint(model)
        daemon = stack.enter_context(_daemon(socket_path, l2_dir, l1_bytes))
        connector = {
            "address": daemon.address,
            "retry_after_s": 0.5,
            "load_timeout_s": 30.0,
            "load_mode": args.load_mode,
        }
        spec = {"model": model, "max_model_len": max_model_len}
        t = time.perf_counter()
        plain = Engine("vllm", {**spec, "connector": None}, work)
        engines.append(plain)
        kv = Engine("kvtier", {**spec, "connector": connector}, work)
        engines.append(kv)
        print(
            f"model: Llama, {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
            f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']} heads, bf16; KV "
            f"{kv_bytes_per_token} B/token; engines up in {time.perf_counter() - t:.0f} s"
        )
        print(
            f"prompt: {args.prefix_tokens}-token shared prefix ({prefix_blocks} blocks) + "
            f"{args.suffix_tokens}; throughput {args.batch} x {args.max_tokens} tokens; "
            f"medians of {args.reps}"
        )
        # Warm-ups; the kvtier engine's first run computes the prefix and stores it.
        warm = prompt()
        plain.run([warm], 1)
        kv.run([warm], 1)
        kv.run([warm], 1)

        def cached(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
            """The plain engine with the prefix in its own cache, computed as the kvtier
            engine computed the blocks it stored (the warm-up prompt alone): the same bytes,
            so outputs must match token for token. A prefix computed in another batch (a
            cold run of these prompts) rounds differently in bf16, and a near-tie then
            flips a token."""
            plain.run([warm], 1)
            return plain.run(prompts, max_tokens, reset=False)

        def check(case: str, ref: dict[str, Any], got: dict[str, Any]) -> None:
            if got["outputs"] != ref["outputs"]:
                raise RuntimeError(f"{case}: outputs differ from plain vLLM's")
            if case != "vllm" and min(got["cached"]) < args.prefix_tokens:
                raise RuntimeError(f"{case}: only {got['cached']} tokens came from a cache")

        recompute_matches = True
        for _ in range(args.reps):
            one = [prompt()]
            batch = [prompt() for _ in range(args.batch)]
            cold_one = plain.run(one, 1)
            ref_one = cached(one, 1)
            cold_batch = plain.run(batch, args.max_tokens)
            ref_batch = cached(batch, args.max_tokens)
            recompute_matches &= cold_one["outputs"] == ref_one["outputs"]
            recompute_matches &= cold_batch["outputs"] == ref_batch["outputs"]
            ttft["vllm"].append(cold_one["elapsed_s"])
            tput["vllm"].append(args.batch * args.max_tokens / cold_batch["elapsed_s"])
            ttft["vllm_cached"].append(ref_one["elapsed_s"])
            tput["vllm_cached"].append(args.batch * args.max_tokens / ref_batch["elapsed_s"])
            got = kv.run(one, 1)
            check("kvtier_l1", ref_one, got)
            ttft["kvtier_l1"].append(got["elapsed_s"])
            got = kv.run(batch, args.max_tokens)
            check("kvtier_l1", ref_batch, got)
            tput["kvtier_l1"].append(args.batch * args.max_tokens / got["elapsed_s"])
            for what, prompts, ref, n in (
                ("ttft", one, ref_one, 1),
                ("tput", batch, ref_batch, args.max_tokens),
            ):
                # A restart leaves every block on disk only (SIGTERM flushes L1 to L2).
                stack.close()
                daemon = stack.enter_context(_daemon(socket_path, l2_dir, l1_bytes))
                if _l1_blocks(daemon.address):
                    raise RuntimeError("a restarted daemon holds blocks in L1")
                # Untimed: the engine reconnects (a new session and a new staging pool, once
                # per daemon restart) on a prompt that shares nothing with the prefix.
                kv.run([[rng.randrange(3, MODEL["vocab_size"]) for _ in range(200)]], 1)
                promoted = _from_disk(daemon.address)
                got = kv.run(prompts, n)
                check("kvtier_l2", ref, got)
                if _from_disk(daemon.address) - promoted < prefix_blocks:
                    raise RuntimeError("kvtier_l2: the prefix did not come from L2")
                if what == "ttft":
                    ttft["kvtier_l2"].append(got["elapsed_s"])
                else:
                    tput["kvtier_l2"].append(args.batch * args.max_tokens / got["elapsed_s"])
    finally:
        for engine in engines:
            engine.close()
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(l2_dir, ignore_errors=True)

    med_ttft = {c: statistics.median(v) for c, v in ttft.items()}
    med_tput = {c: statistics.median(v) for c, v in tput.items()}
    for c in CASES:
        print(
            f"{c:10s} TTFT {med_ttft[c]:7.3f} s {_fmt(ttft[c])}   "
            f"throughput {med_tput[c]:7.1f} tok/s {_fmt(tput[c], 1)}"
        )
    result = {
        "ttft_s": {c: round(v, 4) for c, v in med_ttft.items()},
        "throughput_tok_s": {c: round(v, 1) for c, v in med_tput.items()},
        "ttft_speedup": {c: round(med_ttft["vllm"] / med_ttft[c], 2) for c in CASES[1:]},
        "throughput_ratio": {c: round(med_tput[c] / med_tput["vllm"], 2) for c in CASES[1:]},
        "prefix_tokens": args.prefix_tokens,
        "suffix_tokens": args.suffix_tokens,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "load_mode": args.load_mode,
        "kv_bytes_per_token": kv_bytes_per_token,
        "outputs_identical": True,  # to plain vLLM with the prefix cached (checked)
        "recompute_matches_cached": recompute_matches,
        "runs": {"ttft_s": ttft, "throughput_tok_s": tput},
    }
    speedup, ratio = result["ttft_speedup"], result["throughput_ratio"]
    print(
        f"TTFT speedup over plain vLLM: L1 {speedup['kvtier_l1']}x, L2 {speedup['kvtier_l2']}x "
        f"(vLLM's own cache {speedup['vllm_cached']}x); throughput ratio: L1 "
        f"{ratio['kvtier_l1']}x, L2 {ratio['kvtier_l2']}x"
    )
    if emit is not None:
        emit(result)
    return 0


def _fmt(values: list[float], digits: int = 3) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"
