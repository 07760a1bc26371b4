"""Tables made by someone else (untrusted inputs: R-D3, R-D8, C-D6/D7 for table cells): a parquet cell that inflates
to hundreds of MB from a few KB, a CSV record that a quoted field stretches over 200,000 lines, a record of
thousands of fields, cells that are not valid text. Each is bounded before it is decoded, reported by file and
row (or line), and never an internal error.

The hostile files are small on disk; the runs that would exhaust memory without the bound run `vse` in a
subprocess under a 2 GiB address-space limit (RLIMIT_AS) and a timeout.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vsekit.cli import main
from vsekit.datasets import own_sources

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

PIXELS = ["--pixels", "--no-progress", "--dev", "0", "--test", "0"]
BIG = 300 << 20  # 300 MiB of one caption cell: past the 256 MiB row-group budget

CAPPED = """
import resource, sys
limit = 2 << 30  # 2 GiB of address space for the whole process, imports included
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
import vsekit.cli
sys.exit(vsekit.cli.main(sys.argv[1:]))
"""


def run_capped(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`vse ARGS` in a subprocess under a 2 GiB RLIMIT_AS, killed after `timeout` s."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    return subprocess.run(
        [sys.executable, "-c", CAPPED, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def png(px: int, colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (px, px), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def pictures(tmp_path: Path) -> Path:
    (tmp_path / "red.png").write_bytes(png(8, (200, 20, 20)))
    (tmp_path / "blue.png").write_bytes(png(9, (20, 20, 200)))
    return tmp_path


def text_array(values: list[bytes | int]):
    """An arrow string array over raw bytes (arrow does not check them: a parquet file can hold anything); an
    int stands for that many bytes b"a", made without a Python bytes object."""
    import numpy as np

    sizes = [v if isinstance(v, int) else len(v) for v in values]
    offsets = np.cumsum([0] + sizes).astype(np.int32)
    data = np.full(int(offsets[-1]), ord("a"), np.uint8)
    for v, start in zip(values, offsets):
        if not isinstance(v, int):
            data[start : start + len(v)] = np.frombuffer(v, np.uint8)
    buffers = [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data)]
    return pa.Array.from_buffers(pa.string(), len(values), buffers)


def captions_of(out: Path) -> list[str]:
    return sorted((out / "train_caps.txt").read_text(encoding="utf-8").splitlines())


def no_internal_error(r: subprocess.CompletedProcess) -> None:
    assert r.returncode in (0, 2), (r.returncode, r.stderr[-3000:])
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


# ------------------------------------------------------------------------------------------- R-D3: parquet


def test_r_d3_parquet_inflation_refused_before_decompress(pictures):
    """R-D3: a ~10 KB parquet whose caption cell decompresses to 300 MiB (zstd of one repeated byte): its row
    group is reported from the metadata (file, row group, column, size) and skipped, the other row group is
    read; under a 2 GiB address-space limit, in seconds."""
    table = pictures / "t.parquet"
    bomb = pa.table({"image": ["red.png", "blue.png"], "caption": text_array([BIG, b"a blue one"])})
    good = pa.table({"image": ["red.png", "blue.png"], "caption": ["a red square", "a blue square"]})
    with pq.ParquetWriter(
        table, bomb.schema, compression="zstd", use_dictionary=False, write_statistics=False
    ) as w:
        w.write_table(bomb)
        w.write_table(good)
    del bomb
    assert table.stat().st_size < 64 << 10  # the probe's shape: a few KB on disk
    inflated = pq.ParquetFile(table).metadata.row_group(0).column(1).total_uncompressed_size
    assert inflated > BIG  # the size pyarrow records for the column chunk, which the message must quote
    out = pictures / "out"
    r = run_capped(["data", "table", str(table), "--out", str(out), *PIXELS])
    no_internal_error(r)
    assert r.returncode == 0, r.stderr[-2000:]
    said = [line for line in r.stderr.splitlines() if "t.parquet row group 0 (rows 1-2)" in line]
    assert said, r.stderr[-2000:]
    assert f"column 'caption' decompresses to {inflated:,} bytes, more than the 268,435,456" in said[0]
    assert "its 2 row(s) are skipped" in said[0]
    assert captions_of(out) == ["a blue square", "a red square"]


def test_r_d3_a_repeated_dictionary_value_is_counted_per_row_and_never_expanded(pictures):
    """R-D3 (the same inflation through a dictionary page): one 100 KB caption stored once and named by 5,000
    rows would expand to 500 MB; each row is reported over-long from its size, never made a string."""
    table = pictures / "d.parquet"
    n = 5000
    caption = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["x" * 100_000]))
    pq.write_table(
        pa.table({"image": pa.array(["red.png"] * n), "caption": caption}), table, compression="zstd"
    )
    pq.write_table(
        pa.concat_tables(
            [
                pq.read_table(table),
                pa.table(
                    {
                        "image": ["blue.png"],
                        "caption": pa.array(["a blue square"]).dictionary_encode(),
                    }
                ),
            ]
        ),
        table,
        compression="zstd",
        row_group_size=n,
    )
    assert table.stat().st_size < 1 << 20
    out = pictures / "out"
    r = run_capped(["data", "table", str(table), "--out", str(out), *PIXELS])
    no_internal_error(r)
    assert r.returncode == 0, r.stderr[-2000:]
    over = [line for line in r.stderr.splitlines() if "over-long caption" in line]
    assert (
        len(over) == n and "d.parquet row 1: over-long caption: a 'caption' cell of 100,000 bytes" in over[0]
    )
    assert captions_of(out) == ["a blue square"]


def test_r_d3_row_groups_and_decoded_text_are_bounded(pictures, monkeypatch, capsys):
    """R-D3: the named bounds, lowered here: a row group past the budget is skipped by name and the next one
    read; a table whose text passes the whole-table budget is refused in one line, nothing written."""
    table = pictures / "g.parquet"
    with pq.ParquetWriter(table, pa.schema([("image", pa.string()), ("caption", pa.string())])) as w:
        w.write_table(pa.table({"image": ["red.png"], "caption": ["a red square " + "r" * 5000]}))
        w.write_table(pa.table({"image": ["blue.png"], "caption": ["a blue square"]}))
    meta = pq.ParquetFile(table).metadata
    sizes = [meta.row_group(g).column(1).total_uncompressed_size for g in range(2)]
    monkeypatch.setattr(own_sources, "MAX_PARQUET_GROUP_BYTES", 4096)
    assert sizes[0] > 4096 > sizes[1] + meta.row_group(1).column(0).total_uncompressed_size
    out = pictures / "o"
    assert main(["data", "table", str(table), "--out", str(out), *PIXELS]) == 0
    err = capsys.readouterr().err
    assert (
        f"g.parquet row group 0 (rows 1-1): unreadable picture: column 'caption' decompresses to {sizes[0]:,}"
        in err
    )
    assert captions_of(out) == ["a blue square"]

    monkeypatch.setattr(own_sources, "MAX_PARQUET_ROW_GROUPS", 1)
    assert main(["data", "table", str(table), "--out", str(pictures / "o2"), *PIXELS]) == 2
    assert "g.parquet: 2 row groups, more than the 1 vsekit reads" in capsys.readouterr().err
    monkeypatch.setattr(own_sources, "MAX_PARQUET_ROW_GROUPS", 2)  # exactly the bound: read

    n = 200  # 200 rows naming one 30,000-byte dictionary value: 6 MB decoded from a few KB stored
    caption = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int32()), pa.array(["y" * 30_000]))
    pq.write_table(pa.table({"image": ["red.png"] * n, "caption": caption}), pictures / "t.parquet")
    monkeypatch.setattr(own_sources, "MAX_PARQUET_GROUP_BYTES", 256 << 20)
    monkeypatch.setattr(own_sources, "MAX_TABLE_TEXT_BYTES", 1 << 20)
    monkeypatch.setattr(own_sources, "_PY_CHUNK_BYTES", 64 << 10)
    assert main(["data", "table", str(pictures / "t.parquet"), "--out", str(pictures / "o3"), *PIXELS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t.parquet: more than 1,048,576 bytes of text in its columns" in err[0], err
    assert not (pictures / "o3").exists()


def test_c_d7_parquet_cells_that_are_not_utf8_are_a_problem_naming_the_row(pictures, capsys):
    """C-D6/D7 for tables: a parquet string cell holding the UTF-8 form of a lone surrogate (\\ud800), or any
    byte that is not UTF-8, is a problem naming the table row (arrow stores it unchecked); NUL and ESC in a
    cell are reported as control characters and reach neither the captions nor the terminal raw."""
    table = pictures / "s.parquet"
    pq.write_table(
        pa.table(
            {
                "image": text_array([b"red.png", b"red.png", b"blue.png", b"blue\xff.png", b"blue.png"]),
                "caption": text_array(
                    [
                        b"lone \xed\xa0\x80 surrogate",
                        b"a red square",
                        b"nul \x00 here",
                        b"x",
                        b"\x1b]0;pwn\x07 b",
                    ]
                ),
            }
        ),
        table,
    )
    out = pictures / "out"
    assert main(["data", "table", str(table), "--out", str(out), *PIXELS]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert any("s.parquet row 1: unreadable captions: not UTF-8 text" in line for line in lines), err
    assert any("s.parquet row 4: unreadable captions: not UTF-8 text" in line for line in lines), err
    assert sum("control character" in line for line in lines) == 2, err
    assert "\x1b" not in err and "\x00" not in err
    assert captions_of(out) == ["a red square"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["pictures"] == 1


# ------------------------------------------------------------------------------------------------ R-D8: CSV


def test_r_d8_csv_record_spanning_200000_lines_refused(pictures):
    """R-D8: one record whose quoted fields run over 200,000 lines (2 M fields, 2.2 MB): refused at the record
    bound, naming the file and the line the record starts at, under a 2 GiB address-space limit; nothing is
    written."""
    table = pictures / "t.csv"
    with open(table, "w", encoding="utf-8") as f:
        f.write('image,caption\nred.png,a red square\nblue.png,"opens\n')
        f.write('",,,,,,,,,"\n' * 200_000)  # each line closes a quoted field, adds 9 fields, opens another
        f.write('"\nblue.png,a blue square\n')
    out = pictures / "out"
    r = run_capped(["data", "table", str(table), "--out", str(out), *PIXELS], timeout=60)
    no_internal_error(r)
    assert r.returncode == 2
    last = 3 + (2**20 - 16) // 12 + 1  # line 3 holds 16 bytes, each after it 12: the first line past 1 MiB
    assert r.stderr.strip().endswith(
        f"{table}:3: a record longer than 1,048,576 bytes (lines 3-{last} and on: a quoted field left open?), "
        "more than a table row vsekit reads"
    ), r.stderr[-2000:]
    assert not out.exists()


def test_r_d8_record_bytes_are_counted_per_record_across_lines(pictures, monkeypatch, capsys):
    """R-D8: the record bound counts the bytes of one logical record over its physical lines and starts again
    at each record: records of 90 bytes one after another pass a bound of 100, a quoted caption of three
    40-byte lines does not."""
    monkeypatch.setattr(own_sources, "MAX_TABLE_RECORD_BYTES", 100)
    table = pictures / "t.csv"
    heads = [f"{('red', 'blue')[i % 2]}.png,caption {i} " for i in range(6)]
    rows = [h + "c" * (89 - len(h)) + "\n" for h in heads]
    assert [len(r) for r in rows] == [90] * 6
    table.write_text("image,caption\n" + "".join(rows))
    assert main(["data", "table", str(table), "--out", str(pictures / "o"), *PIXELS]) == 0
    assert len(captions_of(pictures / "o")) == 6
    table.write_text('image,caption\nred.png,"' + "\n".join(["w" * 39] * 3) + '"\n')
    assert main(["data", "table", str(table), "--out", str(pictures / "o2"), *PIXELS]) == 2
    assert f"{table}:2: a record longer than 100 bytes (lines 2-4 and on" in capsys.readouterr().err
    table.write_text(
        'image,caption\nred.png,"a red\nsquare"\n'
    )  # a quoted newline within the bound: one caption
    assert main(["data", "table", str(table), "--out", str(pictures / "o3"), *PIXELS]) == 0
    assert captions_of(pictures / "o3") == ["a red square"]


def test_r_d8_a_record_of_too_many_fields_is_refused(pictures, capsys):
    """R-D8: a record of 2,000 fields on one short line (within the byte bound) is refused naming the file and
    line; 1,024 fields, the bound itself, is read."""
    table = pictures / "t.csv"
    table.write_text("image,caption\nred.png,a red square\nblue.png,a blue square" + "," * 1999 + "\n")
    assert main(["data", "table", str(table), "--out", str(pictures / "o"), *PIXELS]) == 2
    err = capsys.readouterr().err
    assert f"{table}:3: a record of 2,001 fields, more than the 1,024 vsekit reads" in err, err
    assert not (pictures / "o").exists()
    table.write_text("image,caption\nred.png,a red square\nblue.png,a blue square" + "," * 1022 + "\n")
    assert main(["data", "table", str(table), "--out", str(pictures / "o"), *PIXELS]) == 0
    assert captions_of(pictures / "o") == ["a blue square", "a red square"]
