"""Trace files: parsing, errors naming the line, and which blocks a cache can store."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.sim.trace import TraceError, load_trace, next_uses, trace_from_requests, write_jsonl


def test_ids_are_dense_and_requests_are_flat() -> None:
    trace = trace_from_requests(
        [
            {"timestamp": 0, "hash_ids": [90, 7]},
            {"timestamp": 1500, "hash_ids": []},
            {"timestamp": 2000, "hash_ids": [7, 12, 90]},
        ]
    )
    assert trace.requests == 3 and trace.accesses == 5 and trace.unique_blocks == 3
    # Renumbered in the order of the original ids: 7 -> 0, 12 -> 1, 90 -> 2.
    assert trace.blocks.tolist() == [2, 0, 0, 1, 2]
    assert trace.offsets.tolist() == [0, 2, 2, 5]
    assert trace.timestamps_s.tolist() == [0.0, 1.5, 2.0]
    assert trace.request(2).tolist() == [0, 1, 2]
    assert trace.span_s == 2.0


def test_a_selection_keeps_the_ids_of_the_whole_trace() -> None:
    trace = trace_from_requests(
        [
            {"timestamp": 0, "input_length": 1030, "hash_ids": [90, 7, 8]},
            {"timestamp": 1500, "hash_ids": []},
            {"timestamp": 2000, "hash_ids": [7, 12, 90]},
            {"timestamp": 3000, "hash_ids": [12]},
        ]
    )
    part = trace.select(np.array([0, 1, 3]))
    assert part.requests == 3 and part.accesses == 4 and part.unique_blocks == 4
    assert part.blocks.tolist() == [3, 0, 1, 2]  # 7 -> 0, 8 -> 1, 12 -> 2, 90 -> 3
    assert part.offsets.tolist() == [0, 3, 3, 4]
    assert part.timestamps_s.tolist() == [0.0, 1.5, 3.0]
    assert part.partial.tolist() == [True, False, False]
    assert trace.select(np.array([], dtype=np.int64)).accesses == 0


def test_full_semantics_drops_only_partial_last_blocks() -> None:
    trace = trace_from_requests(
        [
            {"timestamp": 0, "input_length": 1030, "hash_ids": [1, 2, 3]},  # 3 is partial
            {"timestamp": 1, "input_length": 1024, "hash_ids": [1, 2]},  # all full
            {"timestamp": 2, "hash_ids": [1, 2, 4]},  # length unknown: all count
            {"timestamp": 3, "input_length": 100, "hash_ids": [5]},  # only a partial block
            {"timestamp": 4, "input_length": 0, "hash_ids": []},
        ]
    )
    assert trace.partial.tolist() == [True, False, False, True, False]
    full = trace.cacheable("full")
    assert full.offsets.tolist() == [0, 2, 4, 7, 7, 7]
    assert full.unique_blocks == 3  # 1, 2, 4
    assert full.accesses == 7 and not full.partial.any()
    assert trace.cacheable("all") is trace
    assert full.cacheable("full") is full
    with pytest.raises(ValueError, match="unknown semantics"):
        trace.cacheable("some")


def test_a_partial_id_stored_elsewhere_as_a_full_block_still_counts_there() -> None:
    trace = trace_from_requests(
        [
            {"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 1536, "hash_ids": [1, 2, 3]},
        ]
    )
    full = trace.cacheable()
    assert full.accesses == 4 and full.unique_blocks == 3


def test_an_input_length_written_as_a_whole_float_is_a_length() -> None:
    """Writers that hold a column with gaps as floats write 512.0: it was refused as not 'a
    whole number of tokens'. 2.5 still is (``test_bad_lines_are_named``)."""
    trace = trace_from_requests(
        [
            {"timestamp": 0, "input_length": 1030.0, "hash_ids": [1, 2, 3]},
            {"timestamp": 1, "input_length": 1024.0, "hash_ids": [1, 2]},
        ]
    )
    assert trace.partial.tolist() == [True, False]
    assert trace.cacheable().accesses == 4


def test_block_tokens_decides_what_is_partial() -> None:
    reqs = [{"timestamp": 0, "input_length": 48, "hash_ids": [1, 2, 3]}]
    assert trace_from_requests(reqs, block_tokens=16).cacheable().accesses == 3
    assert trace_from_requests(reqs, block_tokens=20).cacheable().accesses == 2
    with pytest.raises(TraceError, match="block size"):
        trace_from_requests(reqs)  # 512-token blocks: 48 tokens are one block, not three
    with pytest.raises(ValueError):
        trace_from_requests(reqs, block_tokens=0)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"timestamp": 0, "hash_ids": [1]}\nnot json\n', ":2: not valid JSON"),
        ('{"timestamp": 0, "hash_ids": [1, "a"]}\n', ":1: 'hash_ids'"),
        ('{"timestamp": 0, "hash_ids": [true]}\n', ":1: 'hash_ids'"),
        ('{"hash_ids": [1]}\n', ":1: 'timestamp'"),
        ('{"timestamp": "now", "hash_ids": [1]}\n', ":1: 'timestamp'"),
        ('{"timestamp": 0, "input_length": -3, "hash_ids": [1]}\n', ":1: 'input_length'"),
        ('{"timestamp": 0, "input_length": 2.5, "hash_ids": [1]}\n', ":1: 'input_length'"),
        ("[1, 2]\n", ":1: expected a JSON object"),
        (
            '{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1e999, "hash_ids": [1]}\n',
            ":2: 'timestamp'",
        ),
        # An integer no float can hold: float() raised OverflowError, a traceback.
        (
            '{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1'
            + "0" * 400
            + ', "hash_ids": [1]}\n',
            ":2: 'timestamp'",
        ),
        # Nesting deeper than the parser's recursion (in a field the replay ignores): a
        # RecursionError and a traceback.
        (
            '{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": [1], "x": '
            + "[" * 100_000
            + "]" * 100_000
            + "}\n",
            ":2: JSON nested too deeply",
        ),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceError, match="is a directory"):
        load_trace(tmp_path)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="UTF-8"):
        load_trace(binary)


def test_an_undecodable_byte_is_named_by_its_line(tmp_path: Path) -> None:
    """The error named the file only; in a trace of thousands of lines it now names the line
    (past the reader's first chunk, which is where the decoder used to stop)."""
    path = tmp_path / "t.jsonl"
    good = json.dumps({"timestamp": 0, "hash_ids": list(range(100))}) + "\n"
    path.write_bytes(good.encode() * 300 + b'{"timestamp": 1, "hash_ids": [1], "n": "\xe9"}\n')
    with pytest.raises(TraceError, match=r"t\.jsonl:301: not UTF-8 text"):
        load_trace(path)


LINES = [
    {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
    {"timestamp": 250, "input_length": 1030, "output_length": 5, "hash_ids": [1, 2, 3]},
]


def test_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path: Path) -> None:
    """Editors on Windows save UTF-8 with a byte order mark: it was 'not valid JSON
    (Unexpected UTF-8 BOM (decode using utf-8-sig))' on line 1."""
    path = tmp_path / "t.jsonl"
    text = "".join(json.dumps(r) + "\r\n" for r in LINES)
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    trace = load_trace(path)
    assert (trace.requests, trace.accesses, trace.unique_blocks) == (2, 5, 3)
    assert trace.timestamps_s.tolist() == [0.0, 0.25]
    # Two such files concatenated (`cat a.jsonl b.jsonl`): the second mark starts a line,
    # where it was 'not valid JSON (Unexpected UTF-8 BOM (decode using utf-8-sig))'.
    path.write_bytes((b"\xef\xbb\xbf" + text.encode()) * 2)
    assert load_trace(path).requests == 4
    # A lone carriage return ends a line too, and lines are counted so.
    path.write_bytes(text.replace("\r\n", "\r").encode() + b"{oops}\r")
    with pytest.raises(TraceError, match=r"t\.jsonl:3: not valid JSON"):
        load_trace(path)


@pytest.mark.parametrize(
    ("kind", "opener"), [("gzip", gzip.open), ("bzip2", bz2.open), ("xz", lzma.open)]
)
def test_a_compressed_trace_is_read_as_it_is(tmp_path: Path, kind: str, opener: Any) -> None:
    """A trace downloaded compressed was 'not UTF-8 text (invalid start byte)', which did not
    say why. It is known by its first bytes, whatever its name."""
    path = tmp_path / "t.jsonl"  # no .gz: the content decides
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in LINES)
    trace = load_trace(path)
    assert (trace.requests, trace.accesses, trace.cacheable().accesses) == (2, 5, 4)
    # Cut short: an error naming the kind and the last line read, not a traceback.
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=f"{kind} data is cut short or corrupt"):
        load_trace(path)


@pytest.mark.parametrize("compress", [False, True])
def test_a_trace_from_a_pipe_is_read(tmp_path: Path, compress: bool) -> None:
    """``kvtier replay <(zcat trace.gz)``: a pipe is read once, from its first byte (the first
    bytes, read to tell a compressed trace, were lost to the parse)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = "".join(json.dumps(r) + "\n" for r in LINES).encode()
    data = gzip.compress(text) if compress else text

    def write() -> None:
        with fifo.open("wb") as f:
            f.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        trace = load_trace(fifo)
    finally:
        writer.join()
    assert (trace.requests, trace.accesses, trace.cacheable().accesses) == (2, 5, 4)


@pytest.mark.parametrize(("magic", "kind"), [(b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip")])
def test_a_compressed_trace_it_cannot_read_says_so(tmp_path: Path, magic: bytes, kind: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(magic + b"\x00" * 64)
    with pytest.raises(TraceError, match=f"{kind}-compressed; decompress it first"):
        load_trace(path)


def test_hash_ids_beyond_int64_are_ids_like_any_other() -> None:
    """Unsigned 64-bit hashes (and longer ones) were refused, the message saying that 2**63 'does
    not fit in 64 bits' and naming no line; equal ids are all the replay needs of them."""
    big = 2**64 + 5
    trace = trace_from_requests(
        [
            {"timestamp": 0, "hash_ids": [2**63, big, -(2**63) - 1, 7]},
            {"timestamp": 1, "hash_ids": [2**63, big, 7, 2**63 - 1]},
        ]
    )
    assert trace.unique_blocks == 5
    # Numbered in the order of the original ids, as smaller ones are.
    assert trace.blocks.tolist() == [3, 4, 0, 1, 3, 4, 1, 2]


def test_write_and_read_back(tmp_path: Path) -> None:
    reqs = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [3, 4]},
        {"timestamp": 250, "input_length": 512, "output_length": 1, "hash_ids": [3]},
    ]
    path = tmp_path / "t.jsonl"
    assert write_jsonl(path, reqs) == 2
    assert [json.loads(line) for line in path.read_text().splitlines()] == reqs
    trace = load_trace(path)
    assert trace.name == str(path)
    assert trace.cacheable().accesses == 2  # block 4 is partial


def test_next_uses() -> None:
    blocks = np.array([5, 6, 5, 7, 6, 5])
    assert next_uses(blocks).tolist() == [2, 4, 5, np.inf, np.inf, np.inf]
    assert next_uses(np.array([], dtype=np.int64)).tolist() == []
