"""Edges of the tokenize stage's data plumbing that the other data tests leave open: what check_shards and
ShardReader refuse, what the writer puts in each part, the length and supervision boundaries, drop accounting,
and which files of a source are read (and which are not)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from common.chat import conversations, data_config, to_sharegpt, tokenizer_dir, write_jsonl
from test_data_shards import _write
from transformers import AutoTokenizer

from dflash_core.data.accounting import DropLog, describe
from dflash_core.data.errors import BadInputError, DataError
from dflash_core.data.samples import Sample
from dflash_core.data.shards import ShardError, ShardReader, check_shards, read_index, read_manifest
from dflash_core.data.sources import FileRecords, ReadFailure, list_files, without_output
from dflash_core.data.tokenize import finished_summary, preview_samples, tokenize_dataset
from dflash_core.data.writer import ShardWriter
from dflash_core.errors import TransientError


def _run(data: Path, out: Path, block_size: int = 2, **cfg) -> dict:
    return tokenize_dataset(str(data), tokenizer_dir("chatml"), str(out), data_config(**cfg), block_size=block_size)


def _records(n: int, seed: int = 21) -> list[dict]:
    return [to_sharegpt(c, i) for i, c in enumerate(conversations(n, seed=seed))]


def _payloads(path: Path) -> list:
    [file] = list_files(str(path))
    return [r.payload for r in FileRecords(file)]


# --- check_shards: what a finished output must hold before it is reused ---------------------------------------


def test_check_shards_refuses_a_part_holding_more_or_fewer_rows_than_the_index_lists(tmp_path: Path) -> None:
    """check_shards: every part holds exactly the rows index.parquet gives it; the message names the part."""
    _write(tmp_path, 25)  # parts of 10, 10 and 5 rows
    check_shards(str(tmp_path))
    shutil.copy(tmp_path / "part-00000.parquet", tmp_path / "part-00002.parquet")
    with pytest.raises(ShardError, match="part-00002.parquet: 10 rows where index.parquet lists 5"):
        check_shards(str(tmp_path))
    _write(tmp_path, 25)
    shutil.copy(tmp_path / "part-00002.parquet", tmp_path / "part-00001.parquet")
    with pytest.raises(ShardError, match="part-00001.parquet: 5 rows where index.parquet lists 10"):
        check_shards(str(tmp_path))


def test_check_shards_refuses_a_missing_or_unreadable_part_naming_it(tmp_path: Path) -> None:
    """check_shards: a part deleted by hand or cut short is an error naming that part, never a pass."""
    _write(tmp_path, 25)
    (tmp_path / "part-00001.parquet").unlink()
    with pytest.raises(ShardError, match="part-00001.parquet: missing, but index.parquet lists 10 samples"):
        check_shards(str(tmp_path))
    _write(tmp_path, 25)
    blob = (tmp_path / "part-00002.parquet").read_bytes()
    (tmp_path / "part-00002.parquet").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ShardError, match="part-00002.parquet: unreadable"):
        check_shards(str(tmp_path))


def test_check_shards_refuses_a_folder_without_its_manifest(tmp_path: Path) -> None:
    """manifest.json is written last: without it the folder is unfinished, however whole its parts look."""
    _write(tmp_path, 5)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(ShardError, match="manifest.json: missing; the tokenize run did not finish"):
        check_shards(str(tmp_path))


def test_a_finished_output_is_reused_only_while_it_reads_back_whole(tmp_path: Path) -> None:
    """finished_summary: the summary of a finished output of this fingerprint; None when it is unfinished or a
    part was lost since (then it is tokenized again)."""
    assert finished_summary(str(tmp_path / "nothing-yet"), "abc") is None
    _write(tmp_path, 25)
    summary = finished_summary(str(tmp_path), "abc")
    assert summary is not None and summary["reused"] and summary["kept"] == 25
    (tmp_path / "part-00001.parquet").unlink()
    assert finished_summary(str(tmp_path), "abc") is None


# --- ShardReader: what it refuses --------------------------------------------------------------------------


def test_a_negative_sample_id_is_refused_not_read_from_the_end(tmp_path: Path) -> None:
    """rows(): ids outside 0..N-1 are errors; -1 must never quietly return the last sample."""
    _write(tmp_path, 25)
    with pytest.raises(ShardError, match="sample_id -1 out of range 0..24"):
        ShardReader(str(tmp_path)).rows([-1])


def test_a_part_one_row_short_is_refused_at_its_first_missing_row(tmp_path: Path) -> None:
    """A part with fewer rows than the index says: asking for the row just past its end names the part."""
    _write(tmp_path, 25)
    _write(tmp_path / "short", 3)
    shutil.copy(tmp_path / "short" / "part-00000.parquet", tmp_path / "part-00002.parquet")
    with pytest.raises(ShardError, match="part-00002.parquet: has 3 rows, the index asks for row 3"):
        ShardReader(str(tmp_path)).rows([23])


def test_a_part_whose_ids_and_mask_differ_in_length_is_refused(tmp_path: Path) -> None:
    """A loss mask that does not cover its input ids is a corrupt part, never a misaligned training sample."""
    _write(tmp_path, 5)
    path = tmp_path / "part-00000.parquet"
    table = pq.read_table(path)
    masks = [m[:-1] for m in table.column("loss_mask").to_pylist()]
    table = table.set_column(2, "loss_mask", pa.array(masks, pa.list_(pa.uint8())))
    pq.write_table(table, path, row_group_size=3)
    with pytest.raises(ShardError, match="part-00000.parquet: input_ids and loss_mask lengths differ"):
        ShardReader(str(tmp_path)).rows([0])


def test_a_damaged_manifest_or_index_is_a_shard_error_naming_the_file(tmp_path: Path) -> None:
    """A manifest.json or index.parquet cut short is a ShardError naming it (the CLI's clear one-line error)."""
    _write(tmp_path, 5)
    (tmp_path / "manifest.json").write_text('{"fingerprint": "ab')
    with pytest.raises(ShardError, match="manifest.json: not valid JSON"):
        read_manifest(str(tmp_path))
    blob = (tmp_path / "index.parquet").read_bytes()
    (tmp_path / "index.parquet").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ShardError, match="index.parquet: unreadable"):
        read_index(str(tmp_path))


def test_an_index_whose_sample_ids_are_not_0_to_n_minus_1_is_refused(tmp_path: Path) -> None:
    """ShardReader: sample ids must be exactly 0..N-1 (a gap or a duplicate would feed the wrong sample)."""
    _write(tmp_path, 5)
    index = pq.read_table(tmp_path / "index.parquet")
    shifted = index.set_column(0, "sample_id", pa.array([1, 2, 3, 4, 5], pa.int64()))
    pq.write_table(shifted, tmp_path / "index.parquet")
    with pytest.raises(ShardError, match="index.parquet: sample ids are not 0..N-1"):
        ShardReader(str(tmp_path))


def test_a_finished_output_whose_manifest_was_damaged_since_is_tokenized_again(tmp_path: Path) -> None:
    """finished_summary returns None when `out` holds no finished output of this content, and a damaged one is
    tokenized again (as for a part cut short). Before, a manifest.json cut short raised ShardError: the flow's
    tokenize task failed the same way on every run until someone deleted the folder."""
    _write(tmp_path, 25)
    text = (tmp_path / "manifest.json").read_text()
    (tmp_path / "manifest.json").write_text(text[: len(text) // 2])
    assert finished_summary(str(tmp_path), "abc") is None
    (tmp_path / "manifest.json").write_text("[]")  # JSON, but no manifest
    assert finished_summary(str(tmp_path), "abc") is None
    with pytest.raises(ShardError, match="manifest.json: not a JSON object; re-run `dflash tokenize`"):
        ShardReader(str(tmp_path))


# --- ShardWriter: what each part holds ----------------------------------------------------------------------


def test_parts_are_cut_into_row_groups_of_rows_per_group(tmp_path: Path) -> None:
    """A row group is data.rows_per_group samples (the reader decodes one at a time), cut again at a part end."""
    _write(tmp_path, 25, rows_per_part=10, rows_per_group=3)
    sizes = [[pq.ParquetFile(tmp_path / f"part-0000{p}.parquet").metadata.row_group(g).num_rows
              for g in range(pq.ParquetFile(tmp_path / f"part-0000{p}.parquet").metadata.num_row_groups)]
             for p in range(3)]
    assert sizes == [[3, 3, 3, 1], [3, 3, 3, 1], [3, 2]]


def test_abort_closes_the_open_part_and_the_index(tmp_path: Path) -> None:
    """abort(): a failed run closes every file it opened (an unclosed upload or handle outlives the run)."""
    writer = ShardWriter(str(tmp_path), 10, 2)
    for sid in range(3):
        writer.add(sid, Sample(sid, None, None, np.arange(3, dtype=np.int32), np.ones(3, np.uint8)), "a.jsonl")
    assert writer.part is not None
    part_fh, index_fh = writer.part.fh, writer.index.fh
    writer.abort()
    assert part_fh.closed and index_fh.closed


# --- the length and supervision policy at its boundaries --------------------------------------------------


def _chatml_ids(conv: list[dict]) -> list[int]:
    return AutoTokenizer.from_pretrained(tokenizer_dir("chatml")).apply_chat_template(conv, tokenize=True,
                                                                                      return_dict=False)


def test_a_conversation_of_exactly_max_length_tokens_is_kept_whole_and_not_counted_as_cut(tmp_path: Path) -> None:
    """Only samples over data.max_length are cut: one of exactly max_length tokens stays as it is."""
    conv = conversations(1, seed=6, system=False)[0]
    n = len(_chatml_ids(conv))
    write_jsonl(tmp_path / "d.jsonl", [{"messages": conv}])
    summary = _run(tmp_path / "d.jsonl", tmp_path / "out", max_length=n)
    assert summary["kept"] == 1 and summary["tokens"] == n
    assert read_manifest(str(tmp_path / "out"))["truncated"] == {"turn_boundary": 0, "mid_turn": 0}


def test_a_cut_keeps_every_whole_turn_that_fits_up_to_exactly_max_length(tmp_path: Path) -> None:
    """An over-long sample is cut at the last turn end that fits, a turn ending exactly at data.max_length
    included: two tokens short of the whole (its last reply's end-of-turn token), the last reply is lost."""
    conv = [m for m in conversations(1, seed=6)[0] if m["role"] != "system"]
    long = conv + conv + conv
    write_jsonl(tmp_path / "d.jsonl", [{"messages": long}])
    _run(tmp_path / "d.jsonl", tmp_path / "o1", max_length=len(_chatml_ids(long)) - 2)
    boundary = int(read_index(str(tmp_path / "o1"))["length"][0])
    assert boundary == len(_chatml_ids(long[:-2])) - 1  # up to the <|im_end|> of the reply before the last
    _run(tmp_path / "d.jsonl", tmp_path / "o2", max_length=boundary)
    assert int(read_index(str(tmp_path / "o2"))["length"][0]) == boundary
    assert read_manifest(str(tmp_path / "o2"))["truncated"] == {"turn_boundary": 1, "mid_turn": 0}


def test_a_turn_end_that_keeps_exactly_two_blocks_of_supervision_is_where_the_cut_goes(tmp_path: Path) -> None:
    """A cut goes to a turn end when that keeps enough supervision (2 x block_size, exactly that included), and
    mid-turn only when it would not."""
    for seed in range(40):
        conv = [m for m in conversations(1, seed=seed, system=False)[0]][:2]
        two = conv + [{"role": "user", "content": "Again."}, conv[1]]
        write_jsonl(tmp_path / f"d{seed}.jsonl", [{"messages": two}])
        limit = len(_chatml_ids(two)) - 2  # short of the last reply's end-of-turn token: the last turn end is out
        _run(tmp_path / f"d{seed}.jsonl", tmp_path / f"probe{seed}", block_size=1, max_length=limit)
        supervised = int(read_index(str(tmp_path / f"probe{seed}"))["n_loss_tokens"][0])
        if supervised % 2 == 0:
            break
    _run(tmp_path / f"d{seed}.jsonl", tmp_path / "out", block_size=supervised // 2, max_length=limit)
    assert read_manifest(str(tmp_path / "out"))["truncated"] == {"turn_boundary": 1, "mid_turn": 0}
    assert int(read_index(str(tmp_path / "out"))["n_loss_tokens"][0]) == supervised
    _run(tmp_path / f"d{seed}.jsonl", tmp_path / "mid", block_size=supervised // 2 + 1, max_length=limit)
    assert read_manifest(str(tmp_path / "mid"))["truncated"] == {"turn_boundary": 0, "mid_turn": 1}
    assert int(read_index(str(tmp_path / "mid"))["length"][0]) == limit


def test_exactly_two_blocks_of_supervision_is_enough(tmp_path: Path) -> None:
    """too_few_supervised means fewer than 2 x block_size supervised tokens: exactly 2 x block_size is kept."""
    records = [{"messages": c} for c in conversations(8, seed=3, system=False)]
    write_jsonl(tmp_path / "d.jsonl", records)
    _run(tmp_path / "d.jsonl", tmp_path / "probe", block_size=1)
    supervised = read_index(str(tmp_path / "probe"))["n_loss_tokens"].to_list()
    k = next(i for i, s in enumerate(supervised) if s % 2 == 0)
    write_jsonl(tmp_path / "one.jsonl", [records[k]])
    summary = _run(tmp_path / "one.jsonl", tmp_path / "out", block_size=supervised[k] // 2)
    assert summary["kept"] == 1 and summary["supervised_tokens"] == supervised[k]


def test_a_cut_that_leaves_too_little_supervision_drops_the_sample(tmp_path: Path) -> None:
    """Supervision is counted on what is kept after the cut: a reply cut two tokens in is too_few_supervised,
    however long the whole reply was."""
    conv = [{"role": "user", "content": "Sort the list please."},
            {"role": "assistant", "content": "The model can sort the list of numbers and count them fast."}]
    prompt = len(_chatml_ids(conv[:1])) + len(AutoTokenizer.from_pretrained(tokenizer_dir("chatml")).encode(
        "<|im_start|>assistant\n"))
    write_jsonl(tmp_path / "d.jsonl", [{"messages": conv}])
    summary = _run(tmp_path / "d.jsonl", tmp_path / "out", block_size=4, max_length=prompt + 2,
                   max_bad_fraction=1.0)
    assert summary["kept"] == 0 and summary["dropped"] == {"too_few_supervised": 1}


# --- drop accounting ----------------------------------------------------------------------------------------


def test_bad_records_exactly_at_max_bad_fraction_pass_and_one_more_fails() -> None:
    """The stage fails only *above* data.max_bad_fraction."""
    log = DropLog(max_examples=5)
    log.add("unparsable", "a.jsonl", 0, 1, None, "not JSON")
    log.check(100, 0.01)
    with pytest.raises(BadInputError, match="1 of 99 records"):
        log.check(99, 0.01)


def test_bad_records_exactly_at_a_threshold_float_rounding_puts_below_still_pass() -> None:
    """`above data.max_bad_fraction` fails: 29 bad of 100 is exactly 0.29, not above it. Before, the check was
    bad <= fraction * read, and 0.29 * 100 is 28.999999999999996 in floats."""
    log = DropLog(max_examples=5)
    for i in range(29):
        log.add("unparsable", "a.jsonl", i, i + 1, None, "not JSON")
    log.check(100, 0.29)


README_POLICY_DROPS = ("empty_conversation", "no_assistant_turn", "no_assistant_content", "no_trained_turn",
                       "non_text_content", "too_long", "too_few_supervised", "template_has_no_tools",
                       "template_single_tool_call", "template_drops_text_with_calls", "template_rewrites_reply",
                       "excluded_by_source")


def test_the_policy_drops_the_readme_lists_never_count_as_bad_input() -> None:
    """README: records with nothing to learn, image parts, the length policy and templates that cannot write tool
    records are dropped and counted but never trip data.max_bad_fraction; every other reason does."""
    log = DropLog(max_examples=5)
    for reason in README_POLICY_DROPS:
        log.add(reason, "a.jsonl", 0, 1, None, "x")
    assert log.bad == 0
    log.check(len(README_POLICY_DROPS), 0.0)
    log.add("unparsable", "a.jsonl", 1, 2, None, "x")
    assert log.bad == 1


def test_only_the_first_examples_of_a_reason_are_kept_but_every_drop_is_counted() -> None:
    """data.max_examples examples per reason; the count stays exact."""
    log = DropLog(max_examples=3)
    for i in range(7):
        log.add("unparsable", "a.jsonl", i, i + 1, None, "x")
    assert log.counts["unparsable"] == 7 and [e["record"] for e in log.examples["unparsable"]] == [0, 1, 2]


def test_an_example_without_a_line_is_described_by_its_record_and_id() -> None:
    """Parquet/Arrow/CSV records have no line: the example leaves it out, never printing 'line None'."""
    log = DropLog(max_examples=2)
    log.add("wrong_schema", "d.parquet", 3, None, "r7", "no turns")
    log.add("wrong_schema", "d.parquet", 4, None, None, "no turns")
    first, second = log.examples["wrong_schema"]
    assert describe(first) == "d.parquet record 3, id r7: no turns"
    assert describe(second) == "d.parquet record 4: no turns"


def test_drop_counts_come_sorted_by_reason_whatever_order_they_happened_in() -> None:
    """dropped() is sorted by reason name (the manifest and summary read the same for the same input)."""
    log = DropLog(max_examples=1)
    for reason in ("wrong_schema", "too_long", "bad_utf8", "too_long"):
        log.add(reason, "a.jsonl", 0, 1, None, "x")
    assert list(log.dropped().items()) == [("bad_utf8", 1), ("too_long", 2), ("wrong_schema", 1)]


def test_the_bad_input_error_lists_only_the_bad_reasons() -> None:
    """Above the threshold the error shows the bad records; policy drops are not what needs fixing."""
    log = DropLog(max_examples=2)
    for i in range(30):
        log.add("too_long", "a.jsonl", i, i + 1, None, "long")
    log.add("unparsable", "a.jsonl", 30, 31, None, "not JSON")
    with pytest.raises(BadInputError) as err:
        log.check(31, 0.01)
    assert "unparsable: 1" in str(err.value) and "too_long" not in str(err.value)


# --- which files of a source are read ------------------------------------------------------------------------


def test_a_folder_skips_hidden_folders_and_a_stage_manifest(tmp_path: Path) -> None:
    """.cache/, .ipynb_checkpoints/ and a stage's manifest.json beside its shards are never chat data."""
    write_jsonl(tmp_path / "a.jsonl", _records(2))
    write_jsonl(tmp_path / ".ipynb_checkpoints" / "a-checkpoint.jsonl", _records(2))
    (tmp_path / "manifest.json").write_text(json.dumps({"records": 2}))
    assert [f.name for f in list_files(str(tmp_path))] == ["a.jsonl"]


def test_an_output_folder_inside_the_source_hides_only_itself_not_files_sharing_its_prefix(tmp_path: Path) -> None:
    """without_output drops the output folder's own files; tok2/ and tokens.jsonl beside --out tok/ are data."""
    for name in ("tok/part.jsonl", "tok2/x.jsonl", "tokens.jsonl"):
        write_jsonl(tmp_path / name, _records(1))
    kept = without_output(list_files(str(tmp_path)), str(tmp_path / "tok"))
    assert sorted(f.name for f in kept) == ["tok2/x.jsonl", "tokens.jsonl"]
    with pytest.raises(DataError, match="holds no data files besides this output folder"):
        without_output(list_files(str(tmp_path / "tok")), str(tmp_path / "tok"))


def test_a_glob_reads_the_files_it_matches_named_from_its_folder(tmp_path: Path) -> None:
    """A glob matching a folder reads no folder; provenance names are relative to the glob's folder."""
    write_jsonl(tmp_path / "data-a.jsonl", _records(1))
    write_jsonl(tmp_path / "data-dir" / "inner.jsonl", _records(1))
    assert [f.name for f in list_files(str(tmp_path / "data-*"))] == ["data-a.jsonl"]


def test_blank_and_whitespace_only_lines_are_not_records(tmp_path: Path) -> None:
    """JSONL: lines of spaces, tabs or a CR are skipped, never counted as unparsable records."""
    lines = [json.dumps(r) for r in _records(2)]
    (tmp_path / "d.jsonl").write_bytes(f"{lines[0]}\n   \n\t\r\n\n{lines[1]}\n".encode())
    assert [json.loads(p)["id"] for p in _payloads(tmp_path / "d.jsonl")] == ["c0", "c1"]


def test_a_network_failure_while_reading_is_transient_not_a_bad_record(tmp_path: Path, monkeypatch) -> None:
    """A ConnectionError or timeout mid-file raises TransientError (a rerun reads it); it is no dropped record."""
    write_jsonl(tmp_path / "d.jsonl", _records(3))
    [file] = list_files(str(tmp_path / "d.jsonl"))

    def broken(self, raw):
        raise TimeoutError("read timed out")
        yield  # a generator, as the real one

    monkeypatch.setattr(FileRecords, "_records", broken)
    with pytest.raises(TransientError, match="d.jsonl: reading it failed after 0 records"):
        list(FileRecords(file))


def test_an_arrow_file_missing_only_its_footer_is_cut_short(tmp_path: Path) -> None:
    """An Arrow file (file format) whose footer is lost reads every batch before it, then one truncated_file:
    its end is missing, so more data may have been lost with it."""
    table = pa.Table.from_pylist(_records(6))
    stream = pa.BufferOutputStream()
    with pa.ipc.new_stream(stream, table.schema) as out:
        out.write_table(table, max_chunksize=2)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table, max_chunksize=2)
    blob = sink.getvalue().to_pybytes()
    (tmp_path / "data.arrow").write_bytes(blob[: 8 + len(stream.getvalue().to_pybytes())])  # magic, stream, no footer
    payloads = _payloads(tmp_path / "data.arrow")
    assert [p["id"] for p in payloads[:-1]] == [f"c{i}" for i in range(6)]
    assert isinstance(payloads[-1], ReadFailure) and payloads[-1].reason == "truncated_file"


def test_an_arrow_stream_damaged_inside_is_unreadable_not_cut_short(tmp_path: Path) -> None:
    """Only an Arrow stream that ends inside a message is `truncated_file`; a damaged message in a whole file is
    any other read error: one `unreadable` failure after the batches before it."""
    import struct

    table = pa.Table.from_pylist(_records(6))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table.slice(0, 2))
        at = sink.tell()
        out.write_table(table.slice(2))
    blob = sink.getvalue().to_pybytes()
    junk = b"\xff\xff\xff\xff" + struct.pack("<i", 16) + b"\x07" * 16  # a message header that is no flatbuffer
    (tmp_path / "data.arrow").write_bytes(blob[:at] + junk + blob[at + len(junk):])
    payloads = _payloads(tmp_path / "data.arrow")
    assert [p["id"] for p in payloads[:-1]] == ["c0", "c1"]
    assert isinstance(payloads[-1], ReadFailure) and payloads[-1].reason == "unreadable"


def test_pretty_printed_objects_carry_the_line_each_starts_on(tmp_path: Path) -> None:
    """A file of concatenated pretty-printed objects: each record's line is the one its object starts on."""
    a, b = _records(2)
    text = json.dumps(a, indent=1)
    (tmp_path / "d.json").write_text(text + "\n" + json.dumps(b, indent=1) + "\n")
    [file] = list_files(str(tmp_path / "d.json"))
    assert [r.line for r in FileRecords(file)] == [1, text.count("\n") + 2]


# --- the stage ------------------------------------------------------------------------------------------------


def test_an_input_without_records_is_refused_but_one_whose_records_were_all_dropped_is_not(tmp_path: Path) -> None:
    """_check_read: no record at all is a mistake said at once; every record dropped by policy is a finished run
    whose manifest says why."""
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no records in its 1 file"):
        _run(tmp_path / "empty.jsonl", tmp_path / "o1")
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    write_jsonl(tmp_path / "short.jsonl", [short, short])
    summary = _run(tmp_path / "short.jsonl", tmp_path / "o2", block_size=64)
    assert summary["kept"] == 0 and summary["dropped"] == {"too_few_supervised": 2}
    assert read_manifest(str(tmp_path / "o2"))["num_samples"] == 0 and len(ShardReader(str(tmp_path / "o2"))) == 0


def test_the_manifest_counts_kept_samples_not_records_read(tmp_path: Path) -> None:
    """manifest.json's num_samples is the number of samples in the folder (plan and train read it)."""
    write_jsonl(tmp_path / "d.jsonl", [*_records(3), "junk"])
    summary = _run(tmp_path / "d.jsonl", tmp_path / "out", max_bad_fraction=0.5)
    manifest = read_manifest(str(tmp_path / "out"))
    assert summary["read"] == 4 and manifest["num_samples"] == summary["kept"] == 3 == read_index(
        str(tmp_path / "out")).height


def test_preview_stops_at_its_limit_across_files(tmp_path: Path) -> None:
    """--preview N shows the first N records, also when they span several files."""
    write_jsonl(tmp_path / "src" / "a.jsonl", _records(2))
    write_jsonl(tmp_path / "src" / "b.jsonl", _records(4, seed=22))
    out = preview_samples(str(tmp_path / "src"), tokenizer_dir("chatml"), data_config(), block_size=2, limit=3)
    assert [(r["file"], r["record"]) for r in out["records"]] == [("a.jsonl", 0), ("a.jsonl", 1), ("b.jsonl", 0)]
    assert out["summary"]["previewed"] == 3
