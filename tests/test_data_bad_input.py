"""Bad input never crashes the tokenize stage and never vanishes: every record is kept or dropped by reason."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pytest
from common.chat import conversations, data_config, to_sharegpt, tokenizer_dir, write_jsonl
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dflash_core.data.errors import BadInputError, DataError
from dflash_core.data.formats import record_id
from dflash_core.data.shards import read_index, read_manifest
from dflash_core.data.sources import JsonArrayElements
from dflash_core.data.tokenize import tokenize_dataset

GOOD = [to_sharegpt(c, i) for i, c in enumerate(conversations(4, seed=11))]
ALT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
       "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
       "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")

BAD_LINES: list[tuple[str, bytes]] = [
    ("unparsable", b'{"conversations": [ '),
    ("bad_utf8", b'{"messages": "\xff\xfe"}'),
    ("wrong_schema", b"[1, 2, 3]"),
    ("wrong_schema", b'{"text": "no turns here"}'),
    ("wrong_schema", b'{"conversations": ["a string turn", {"from": "gpt", "value": "then an object"}]}'),
    ("wrong_schema", b'{"conversations": {"from": "human"}}'),
    ("empty_conversation", b'{"conversations": []}'),
    ("non_string_content", b'{"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}]}'),
    ("unknown_role", b'{"conversations": [{"from": "narrator", "value": "a"}, {"from": "gpt", "value": "b"}]}'),
    ("no_assistant_turn", b'{"conversations": [{"from": "human", "value": "anyone?"}]}'),
    ("bad_utf8", b'{"conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "b"}]}'),
    ("non_text_content", b'{"conversations": [{"from": "human", "value": [{"type": "image", "url": "x"}]},'
                         b' {"from": "gpt", "value": "a"}]}'),
    ("wrong_schema", b'{"messages": [{"speaker": "user", "text": "a"}, {"speaker": "assistant", "text": "b"}]}'),
    # lone surrogates outside turn text: a tool definition, a tool call's arguments (they crashed the stage)
    ("bad_utf8", b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], '
                 b'"tools": [{"type": "function", "function": {"name": "w", "description": "\\ud83d"}}]}'),
    ("bad_utf8", b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", '
                 b'"tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"x": "\\ud83d"}}}]}]}'),
]


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _run(data: Path, out: Path, **cfg) -> dict:
    return tokenize_dataset(str(data), tokenizer_dir("chatml"), str(out), data_config(**cfg), block_size=2)


def test_each_bad_record_is_counted_with_its_reason_and_location(tmp_path: Path) -> None:
    good = [json.dumps(r).encode() for r in GOOD]
    data = _write(tmp_path / "mixed.jsonl", good[:2] + [line for _, line in BAD_LINES] + good[2:])
    summary = _run(data, tmp_path / "out", max_bad_fraction=1.0)
    expected: dict[str, int] = {}
    for reason, _ in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert summary["dropped"] == dict(sorted(expected.items()))
    assert summary["kept"] == 4 and summary["read"] == 4 + len(BAD_LINES)
    examples = read_manifest(str(tmp_path / "out"))["drop_examples"]
    assert examples["unparsable"][0]["file"] == "mixed.jsonl" and examples["unparsable"][0]["line"] == 3
    assert [e["line"] for e in examples["wrong_schema"]] == [5, 6, 7, 8, 15]
    assert "narrator" in examples["unknown_role"][0]["detail"]
    assert [e["detail"].split(" (")[0] for e in examples["bad_utf8"][-2:]] == [
        "a lone surrogate in the tool definitions", "a lone surrogate in turn 1"]


def test_a_lone_surrogate_in_a_record_id_is_written_as_its_escape(tmp_path: Path) -> None:
    """Ids land in reports and manifests, which are UTF-8: an id cut mid-emoji is kept as its escape."""
    line = json.dumps({**GOOD[0], "id": "r\ud83d"}).encode()
    assert record_id(json.loads(line)) == "r\\ud83d"
    summary = _run(_write(tmp_path / "d.jsonl", [line, b"not json"]), tmp_path / "out", max_bad_fraction=1.0)
    assert summary["kept"] == 1


def test_above_the_bad_fraction_the_stage_fails_showing_examples(tmp_path: Path) -> None:
    good = [json.dumps(r).encode() for r in GOOD] * 10
    empty = [b'{"conversations": []}', b'{"conversations": [{"from": "human", "value": "hi"}]}']
    data = _write(tmp_path / "d.jsonl", good + [b"oops", b'{"conversations": [{"from": "gpt"}]}'] + empty)
    out = tmp_path / "out"
    with pytest.raises(BadInputError) as err:
        _run(data, out)  # default max_bad_fraction 1%: 2 of 44 records is too many
    msg = str(err.value)
    assert "2 of 44 records" in msg and "d.jsonl line 41" in msg and "wrong_schema" in msg
    assert "max_bad_fraction" in msg and "empty_conversation" not in msg  # data quality, not broken input
    assert not (out / "manifest.json").exists() and not list(out.glob("part-*.parquet"))
    summary = _run(data, out, max_bad_fraction=0.05)
    assert summary["kept"] == 40 and summary["dropped"] == {
        "empty_conversation": 1, "no_assistant_turn": 1, "unparsable": 1, "wrong_schema": 1}
    assert read_manifest(str(out))["bad"] == 2


def test_records_the_template_rejects_are_dropped_with_its_message(tmp_path: Path) -> None:
    """A template that insists on user/assistant/user/...: by default (data.same_role_turns auto) two user turns
    in a row are merged and a reply before the first user turn is left out (noted); under keep both are dropped
    with the template's message. A conversation without a user turn cannot be made to alternate: dropped."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    tok.chat_template = ALT
    tok.save_pretrained(tmp_path / "tok")
    twice = [{"role": "user", "content": "a b c"}, {"role": "user", "content": "d e f"},
             {"role": "assistant", "content": "the model can sort the list"}]
    greeting = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "a b c"},
                {"role": "assistant", "content": "the model can sort the list"}]
    alone = [{"role": "assistant", "content": "the model talks to nobody at all"}]
    convs = [*conversations(4, seed=12, system=False), twice, greeting, alone]
    data = write_jsonl(tmp_path / "d.jsonl", [to_sharegpt(c, i) for i, c in enumerate(convs)])
    for same_role_turns, kept, notes in (("auto", 6, {"reply_before_user": 1}), ("keep", 4, {})):
        cfg = data_config(max_bad_fraction=0.5, same_role_turns=same_role_turns)
        out = tmp_path / same_role_turns
        summary = tokenize_dataset(str(data), str(tmp_path / "tok"), str(out), cfg, block_size=2)
        assert summary["dropped"] == {"template_error": 7 - kept} and summary["kept"] == kept
        assert summary["notes"] == notes
        details = [e["detail"] for e in read_manifest(str(out))["drop_examples"]["template_error"]]
        assert all("roles must alternate" in d for d in details)


def test_broken_files_count_as_bad_records(tmp_path: Path) -> None:
    """Files cut short keep the records before the cut and count one truncated_file each, named."""
    src = tmp_path / "src"
    src.mkdir()
    many = [to_sharegpt(c, i) for i, c in enumerate(conversations(40, seed=13))]
    blob = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in many), mtime=0)
    (src / "a.jsonl.gz").write_bytes(blob[: len(blob) // 2])
    (src / "b.json").write_text(json.dumps(GOOD)[:-40])  # a JSON array cut short inside its last element
    (src / "c.parquet").write_bytes(b"PAR1 definitely not parquet")
    summary = _run(src, tmp_path / "out", max_bad_fraction=1.0)
    assert summary["read"] == summary["kept"] + sum(summary["dropped"].values())
    assert summary["dropped"] == {"truncated_file": 2, "unreadable": 1}
    assert summary["truncated_files"] == ["a.jsonl.gz", "b.json"]
    readable = sum(1 for _ in _readable_lines(blob[: len(blob) // 2]))
    assert 10 < readable < 40 and summary["kept"] == readable + 3
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["truncated_files"] == ["a.jsonl.gz", "b.json"] and manifest["bad"] == 3
    cut = manifest["drop_examples"]["truncated_file"]
    assert [(e["file"], e["record"]) for e in cut] == [("a.jsonl.gz", readable), ("b.json", 3)]


@pytest.mark.parametrize("writer", ["stream", "file"])
def test_arrow_cut_short_keeps_the_batches_before_the_cut(tmp_path: Path, writer: str) -> None:
    """A `save_to_disk` shard (stream format) or an Arrow file cut in the middle: the whole batches before the cut
    are read, then one truncated_file; a stream missing only its end-of-stream marker is complete."""
    import pyarrow as pa

    table = pa.Table.from_pylist([to_sharegpt(c, i) for i, c in enumerate(conversations(40, seed=15))])
    sink = pa.BufferOutputStream()
    with (pa.ipc.new_stream if writer == "stream" else pa.ipc.new_file)(sink, table.schema) as out:
        out.write_table(table, max_chunksize=5)
    blob = sink.getvalue().to_pybytes()
    src = tmp_path / "src"
    src.mkdir()
    (src / "data-00000-of-00001.arrow").write_bytes(blob[: len(blob) // 2])
    summary = _run(src, tmp_path / "out", max_bad_fraction=1.0)
    assert summary["dropped"] == {"truncated_file": 1} and summary["truncated_files"] == ["data-00000-of-00001.arrow"]
    assert 10 <= summary["kept"] < 40 and summary["kept"] % 5 == 0
    if writer == "stream":
        (src / "data-00000-of-00001.arrow").write_bytes(blob[:-8])  # no end-of-stream marker: every batch is there
        assert _run(src, tmp_path / "out2")["kept"] == 40


def _readable_lines(cut_gzip: bytes) -> list[bytes]:
    """The complete lines a decompressor gets out of a gzip stream cut short."""
    import zlib

    data = zlib.decompressobj(31).decompress(cut_gzip)
    return data.split(b"\n")[:-1]


def test_gzip_cut_short_or_not_reads_the_same_records_before_the_cut(tmp_path: Path) -> None:
    records = [to_sharegpt(c, i) for i, c in enumerate(conversations(30, seed=14))]
    blob = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records), mtime=0)
    (tmp_path / "cut.jsonl.gz").write_bytes(blob[:-12])  # only the gzip trailer and a little data lost
    summary = _run(tmp_path / "cut.jsonl.gz", tmp_path / "out", max_bad_fraction=0.05)
    assert summary["dropped"] == {"truncated_file": 1} and summary["kept"] >= 28
    with pytest.raises(BadInputError, match="truncated_file"):  # one bad record in 2 is above 1%
        _run(tmp_path / "cut.jsonl.gz", tmp_path / "out2", max_bad_fraction=0.01)


def test_single_json_object_file_is_one_record_and_one_non_json_line_is_unparsable(tmp_path: Path) -> None:
    (tmp_path / "one.json").write_text(json.dumps(GOOD[0], indent=2))
    summary = _run(tmp_path / "one.json", tmp_path / "out")
    assert summary["read"] == summary["kept"] == 1
    (tmp_path / "two.json").write_text(json.dumps(GOOD[1], indent=2) + "\n" + json.dumps(GOOD[2], indent=1))
    summary = _run(tmp_path / "two.json", tmp_path / "out")
    assert summary["read"] == summary["kept"] == 2
    assert read_index(str(tmp_path / "out"))["sample_id"].to_list() == [0, 1]
    (tmp_path / "prose.jsonl").write_text("this is not JSON at all")
    with pytest.raises(BadInputError) as err:
        _run(tmp_path / "prose.jsonl", tmp_path / "out")
    assert "1 of 1 records" in str(err.value) and "prose.jsonl line 1" in str(err.value)
    assert "unparsable" in str(err.value) and "empty" not in str(err.value)
    (tmp_path / "broken.jsonl").write_text('{"conversations": [\n' + json.dumps(GOOD[0]) + "\n")
    summary = _run(tmp_path / "broken.jsonl", tmp_path / "out", max_bad_fraction=1.0)
    assert summary["dropped"] == {"unparsable": 1} and summary["kept"] == 1  # JSONL after all: line by line


def test_a_json_name_wins_over_parquet_magic_bytes_and_a_nameless_parquet_is_still_found(tmp_path: Path) -> None:
    """A .jsonl whose first line is b"PAR1" is JSON lines (one unparsable line); a parquet file with no data
    extension, named directly, is still read as parquet by its magic bytes."""
    for name in ("magic.jsonl", "magic.json", "magic.ndjson"):
        _write(tmp_path / name, [b"PAR1", json.dumps(GOOD[0]).encode()])
        summary = _run(tmp_path / name, tmp_path / f"out-{name}", max_bad_fraction=1.0)
        assert summary["read"] == 2 and summary["kept"] == 1 and summary["dropped"] == {"unparsable": 1}, name
    _write(tmp_path / "rows.jsonl", [json.dumps(r).encode() for r in GOOD])
    pl.read_ndjson(tmp_path / "rows.jsonl").write_parquet(tmp_path / "rows.bin")
    summary = _run(tmp_path / "rows.bin", tmp_path / "out-bin")
    assert summary["read"] == summary["kept"] == len(GOOD)


def test_missing_source_is_an_error_that_names_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nothing-here"):
        _run(tmp_path / "nothing-here", tmp_path / "out")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
_turn = st.builds(
    lambda rk, rv, ck, cv: {rk: rv, ck: cv},
    st.sampled_from(["from", "role", "speaker"]), st.sampled_from(["human", "gpt", "user", "assistant", "x"]),
    st.sampled_from(["value", "content"]), st.one_of(st.text(max_size=30), st.integers(), st.none()))
_records = st.builds(lambda k, turns: {k: turns},
                     st.sampled_from(["conversations", "messages", "conversation", "turns"]),
                     st.lists(_turn, max_size=4))
_lines = st.one_of(
    st.binary(max_size=40),
    _json_values.map(lambda v: json.dumps(v).encode()),
    _records.map(lambda r: json.dumps(r).encode()),
    st.sampled_from([json.dumps(r).encode() for r in GOOD]),
)


@pytest.mark.slow  # 25 hypothesis examples, each a whole tokenize run: ~15 s
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_lines, max_size=12))
@example(lines=[b"\xef", b"["])  # a lone 0xEF is not a byte order mark: two bad lines, not a JSON array
@example(lines=[b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode(), b"["])  # a real mark: a JSON lines file
def test_garbage_never_crashes_and_every_record_is_accounted_for(tmp_path: Path, lines: list[bytes]) -> None:
    data = tmp_path / "garbage.jsonl"
    data.write_bytes(b"\n".join(lines))
    records = sum(1 for line in data.read_bytes().split(b"\n") if line.strip())
    first = data.read_bytes().lstrip()[:1]
    if records and (first == b"[" or (first == b"{" and not _parses(data.read_bytes().lstrip().split(b"\n")[0]))):
        records = None  # sniffed as a JSON array / pretty-printed objects: the count differs, accounting holds
    if records == 0:  # nothing to read at all: refused by name, nothing published
        with pytest.raises(DataError, match="no records"):
            _run(data, tmp_path / "out", max_bad_fraction=1.0)
        return
    try:
        summary = _run(data, tmp_path / "out", max_bad_fraction=1.0)
    except DataError as exc:  # a JSON array or document that holds no record
        assert "no records" in str(exc) and records is None
        return
    assert summary["kept"] + sum(summary["dropped"].values()) == summary["read"]
    if records is not None:
        assert summary["read"] == records
    manifest = read_manifest(str(tmp_path / "out"))
    assert manifest["read"] == summary["read"] and manifest["kept"] == summary["kept"]


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


class _ShortReads:
    """A stream that returns at most `size` bytes a read: reads end inside strings and between a backslash and
    the character it escapes, as 1 MiB reads do in long records."""

    def __init__(self, raw: bytes, size: int) -> None:
        import io

        self.stream, self.size = io.BytesIO(raw), size

    def read(self, n: int) -> bytes:
        return self.stream.read(min(n, self.size))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(_json_values, max_size=6), indent=st.sampled_from([None, 0, 2]),
       read_size=st.sampled_from([1, 2, 3, 7, 1 << 20]))
def test_json_array_stream_yields_exactly_the_elements(values: list, indent: int | None, read_size: int) -> None:
    raw = json.dumps(values, indent=indent).encode()
    got = [json.loads(element) for _, element in JsonArrayElements(_ShortReads(raw, read_size))]
    assert got == values


def test_json_array_stream_of_escapes_split_at_every_byte() -> None:
    values = [{"content": 'a \\" quoted \\\\ "b" \\n' * 5, "k": ["]", "}", ","]}, "\\", ""]
    raw = json.dumps(values).encode()
    for size in (1, 2, 3, 5):
        assert [json.loads(e) for _, e in JsonArrayElements(_ShortReads(raw, size))] == values


@settings(max_examples=60, deadline=None)
@given(blob=st.binary(max_size=60))
def test_json_array_stream_never_raises_on_garbage(blob: bytes) -> None:
    import io

    for line, element in JsonArrayElements(io.BytesIO(blob)):
        assert line >= 1 and isinstance(element, bytes)


@pytest.mark.parametrize("shape", ["jsonl", "array"])
def test_a_byte_order_mark_in_front_of_a_file_is_skipped(tmp_path: Path, shape: str) -> None:
    """Editors on Windows write a UTF-8 byte order mark first: JSON lines and a JSON array read as without it."""
    body = (b"\n".join(json.dumps(r).encode() for r in GOOD) if shape == "jsonl"
            else json.dumps(GOOD, indent=1).encode())
    data = tmp_path / f"bom.{'jsonl' if shape == 'jsonl' else 'json'}"
    data.write_bytes(b"\xef\xbb\xbf" + body)
    summary = _run(data, tmp_path / "out")
    assert summary["read"] == summary["kept"] == len(GOOD)


def test_zstd_cut_short_keeps_the_records_before_the_cut(tmp_path: Path) -> None:
    """A .jsonl.zst that ends inside its frame is reported as cut short (truncated_file, named), as a .gz is."""
    import zstandard

    records = [to_sharegpt(c, i) for i, c in enumerate(conversations(40, seed=16))]
    first, second = (zstandard.ZstdCompressor().compress(b"".join(json.dumps(r).encode() + b"\n" for r in part))
                     for part in (records[:20], records[20:]))
    (tmp_path / "cut.jsonl.zst").write_bytes(first + second[: len(second) // 2])  # cut inside the second frame
    summary = _run(tmp_path / "cut.jsonl.zst", tmp_path / "out", max_bad_fraction=1.0)
    assert summary["truncated_files"] == ["cut.jsonl.zst"] and summary["dropped"] == {"truncated_file": 1}
    assert 20 <= summary["kept"] < 40, summary
    (tmp_path / "whole.jsonl.zst").write_bytes(first + second)
    assert _run(tmp_path / "whole.jsonl.zst", tmp_path / "out2")["kept"] == 40
