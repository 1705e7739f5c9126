"""The read side of the tokenized folder: index, manifest, ShardReader (random access, threads, broken files)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from dflash_core.data.samples import Sample
from dflash_core.data.shards import ShardError, ShardReader, read_index, read_manifest
from dflash_core.data.writer import ShardWriter
from dflash_core.publish import staged_output


def _sample(sid: int) -> Sample:
    rng = np.random.default_rng(sid)
    n = int(rng.integers(1, 50))
    return Sample(record=sid, line=sid + 1, record_id=None, ids=rng.integers(0, 30_000, n).astype(np.int32),
                  mask=rng.integers(0, 2, n).astype(np.uint8))


def _write(out: Path, n: int, rows_per_part: int = 10, rows_per_group: int = 3) -> list[Sample]:
    writer = ShardWriter(str(out), rows_per_part, rows_per_group)
    samples = [_sample(i) for i in range(n)]
    for sid, s in enumerate(samples):
        writer.add(sid, s, "src.jsonl")
    writer.finish({"fingerprint": "abc", "kept": n})
    return samples


def test_rows_come_back_in_the_order_asked_across_parts_and_row_groups(tmp_path: Path) -> None:
    samples = _write(tmp_path, 25)
    assert sorted(p.name for p in tmp_path.glob("part-*")) == [f"part-0000{i}.parquet" for i in range(3)]
    reader = ShardReader(str(tmp_path))
    assert len(reader) == 25 and reader.fingerprint == "abc"
    ask = [24, 0, 13, 13, 7, 20, 1]
    for sid, (ids, mask) in zip(ask, reader.rows(ask), strict=True):
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        np.testing.assert_array_equal(ids, samples[sid].ids)
        np.testing.assert_array_equal(mask, samples[sid].mask)
    index = read_index(str(tmp_path))
    assert index.columns == ["sample_id", "part", "row", "length", "n_loss_tokens"]
    assert index["part"].to_list() == [0] * 10 + [1] * 10 + [2] * 5
    assert index["length"].to_list() == [len(s.ids) for s in samples]
    assert index["n_loss_tokens"].to_list() == [int(s.mask.sum()) for s in samples]
    assert read_manifest(str(tmp_path))["parts"][2] == {"file": "part-00002.parquet", "rows": 5}


def test_concurrent_readers_get_the_right_rows(tmp_path: Path) -> None:
    samples = _write(tmp_path, 60, rows_per_part=20, rows_per_group=4)
    reader = ShardReader(str(tmp_path))
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(30):
            ask = rng.integers(0, 60, 5).tolist()
            for sid, (ids, _) in zip(ask, reader.rows(ask), strict=True):
                if not np.array_equal(ids, samples[sid].ids):
                    errors.append(f"sample {sid}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_missing_part_is_an_error_naming_the_file(tmp_path: Path) -> None:
    _write(tmp_path, 25)
    (tmp_path / "part-00001.parquet").unlink()
    reader = ShardReader(str(tmp_path))
    assert len(reader.rows([0, 24])) == 2  # other parts still read
    with pytest.raises(ShardError, match="part-00001.parquet: missing"):
        reader.rows([12])


def test_corrupt_part_is_an_error_naming_the_file(tmp_path: Path) -> None:
    _write(tmp_path, 25)
    (tmp_path / "part-00002.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    with pytest.raises(ShardError, match="part-00002.parquet: corrupt"):
        ShardReader(str(tmp_path)).rows([21])
    _write(tmp_path, 25)
    blob = (tmp_path / "part-00000.parquet").read_bytes()
    (tmp_path / "part-00000.parquet").write_bytes(blob[:4] + bytes(len(blob) - 8) + blob[-4:])
    with pytest.raises(ShardError, match="part-00000.parquet"):
        ShardReader(str(tmp_path)).rows([5])


def test_truncated_part_and_bad_ids_are_errors(tmp_path: Path) -> None:
    _write(tmp_path, 25)
    reader = ShardReader(str(tmp_path))
    with pytest.raises(ShardError, match="out of range"):
        reader.rows([25])
    _write(tmp_path / "short", 3)  # a part with fewer rows than the index says
    (tmp_path / "part-00002.parquet").write_bytes((tmp_path / "short" / "part-00000.parquet").read_bytes())
    with pytest.raises(ShardError, match="part-00002.parquet: has 3 rows"):
        ShardReader(str(tmp_path)).rows([24])
    with pytest.raises(ShardError, match="part-00002.parquet: row 1 holds sample 1, index says 21"):
        ShardReader(str(tmp_path)).rows([21])


def test_incomplete_folder_is_an_error(tmp_path: Path) -> None:
    _write(tmp_path, 5)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(ShardError, match="manifest.json: missing"):
        ShardReader(str(tmp_path))
    with pytest.raises(ShardError, match="index.parquet: missing"):
        read_index(str(tmp_path / "nowhere"))


def test_a_rerun_with_fewer_samples_leaves_no_stale_parts(tmp_path: Path) -> None:
    # The stage writes into a fresh staging folder that replaces the old output whole (dflash_core/publish.py).
    out = tmp_path / "tok"
    for n in (25, 4):
        with staged_output(str(out), "tokenize") as staging:
            _write(Path(staging), n)
    assert [p.name for p in out.glob("part-*")] == ["part-00000.parquet"]
    assert len(ShardReader(str(out))) == 4


def test_an_empty_run_writes_a_readable_empty_folder(tmp_path: Path) -> None:
    _write(tmp_path, 0)
    assert read_index(str(tmp_path)).height == 0
    assert len(ShardReader(str(tmp_path))) == 0 and ShardReader(str(tmp_path)).rows([]) == []
