"""Chat-data files behind a URI (file, glob or folder, any fsspec filesystem) and their records, streamed.

Local paths, file://, memory:// work as is; s3:// and gs:// work once s3fs / gcsfs are installed (fsspec
picks them up, credentials come from their usual environment variables or config files). JSON arrays, JSON
lines (.jsonl/.ndjson/.json, optionally .gz/.bz2/.xz/.zst), parquet (by its .parquet name, or its magic bytes
when the name says neither), Arrow IPC (.arrow: a Hugging Face `save_to_disk` folder) and CSV/TSV with a header
row (cells as text) are read record by record: memory stays about one record (JSON) or one batch (parquet,
Arrow, CSV) whatever the file size. A file holding one JSON object (or several pretty-printed ones,
concatenated) is read whole: each object is one record.

A compressed file, JSON array or Arrow file that ends early yields the records before the cut and then one
`truncated_file` failure (the lost part cannot be counted); any other read error is one `unreadable` failure.

A folder that holds a held-out split beside another split of one dataset (a `save_to_disk` DatasetDict with train
and test, a hub snapshot's data/train-*.parquet beside data/test-*.parquet) is refused: read whole, its held-out
split would be trained on. Training splits only (a DatasetDict of train alone, train_en.jsonl beside
train_fr.jsonl) are read as they are.
"""

from __future__ import annotations

import io
import json
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
from fsspec.compression import compr
from fsspec.utils import infer_compression

from dflash_core.data.errors import DataError
from dflash_core.errors import TransientError

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
CSV_SUFFIXES = (".csv", ".tsv")
DATA_SUFFIXES = (*JSON_SUFFIXES, ".parquet", ".arrow", *CSV_SUFFIXES)
_GLOB_CHARS = re.compile(r"[*?\[]")
_READ_CHUNK = 1 << 20
_BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark some editors put in front of a file
_PARQUET_BATCH = 1024
_DOCUMENT_MAX = 256 << 20  # a file whose first line is not JSON is tried whole as JSON object(s) up to this size
# pyarrow's messages for an IPC stream that ends inside a message (it has no typed end-of-stream error)
_ARROW_CUT = re.compile(r"Expected to (be able to )?read \d+ .*(got|only read) \d+|only \d+ bytes available")
# A stage's own manifest (e.g. regenerate's, beside its JSONL shards) is never chat data, nor is the metadata
# beside the Arrow files of a Hugging Face `save_to_disk` folder.
_NOT_DATA = frozenset({"manifest.json", "dataset_info.json", "state.json", "dataset_dict.json"})
_ZSTD_SUFFIXES = (".zst", ".zstd")  # fsspec's name inference knows .zst only
_DATASET_DICT = "dataset_dict.json"  # what `datasets` save_to_disk writes at the root of a DatasetDict
# a split's name as a hub snapshot writes it in file names (data/train-00000-of-00004.parquet,
# data/test_sft-00000-of-00001-<hash>.parquet, test.jsonl) or a folder's name; UltraFeedback's and UltraChat's
# splits carry a suffix (train_sft, test_gen, train_prefs), which makes them splits of their own
_SPLIT = re.compile(r"^(?:train|test|validation|valid|val|dev)(?:_[a-z]+)?(?=$|[-.])", re.IGNORECASE)
_HELD_OUT = ("test", "validation", "valid", "val", "dev")  # what a held-out split's name starts with


@dataclass(frozen=True)
class SourceFile:
    """One input file: `uri` opens it, `name` (relative to the source root) is its provenance."""

    uri: str
    name: str
    size: int
    compression: str | None
    checksum: str | None = None  # the object store's own content checksum (ETag, md5Hash, ...): see stored_checksum


@dataclass(frozen=True)
class ReadFailure:
    """A file (or its tail) that could not be read; it counts as one dropped record with this reason."""

    message: str
    reason: str = "unreadable"


@dataclass(frozen=True)
class RawRecord:
    """A record as stored: JSON bytes, a parquet row (dict) or a ReadFailure; `record` is 0-based per file."""

    record: int
    line: int | None
    payload: bytes | dict[str, Any] | ReadFailure


def _is_data_file(path: str) -> bool:
    return _base_name(path).endswith(DATA_SUFFIXES)


def _base_name(path: str) -> str:
    """The lower-case name without its compression suffix (data.jsonl.gz -> data.jsonl)."""
    return (path[: -len(ext)] if (ext := _compression_suffix(path)) else path).lower()


def _compression_suffix(path: str) -> str:
    return "." + path.rsplit(".", 1)[-1] if _compression(path) else ""


def _compression(path: str) -> str | None:
    """fsspec's name of the compression a file name says (.gz -> gzip, .zst/.zstd -> zstd, ...), else None."""
    return "zstd" if path.lower().endswith(_ZSTD_SUFFIXES) else infer_compression(path)


def list_files(source: str) -> list[SourceFile]:
    """The data files of a file, glob or folder URI, sorted by name (the input order of the samples)."""
    fs, path = fsspec.core.url_to_fs(source)
    glob = _GLOB_CHARS.search(path)
    if glob:
        root = path[: glob.start()].rsplit("/", 1)[0]
        paths = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        root = path.rstrip("/")
        paths = [p for p in fs.find(path) if _is_data_file(p) and not _hidden(_relative(p, root))]
        _refuse_splits(fs, source, root, paths)
    elif fs.isfile(path):
        root, paths = posixpath.dirname(path), [path]
    else:
        raise DataError(f"{source}: no such file, folder or glob match; check the data source URI")
    if not paths:
        raise DataError(f"{source}: no data files found (looked for {', '.join(DATA_SUFFIXES)}, optionally "
                        ".gz/.bz2/.xz/.zst)")
    files = []
    for p in sorted(paths):
        info = fs.info(p)
        files.append(SourceFile(uri=fs.unstrip_protocol(p), name=_relative(p, root), size=int(info.get("size") or 0),
                                compression=_compression(p), checksum=stored_checksum(info)))
    return files


def _refuse_splits(fs: Any, source: str, root: str, paths: list[str]) -> None:
    """Refuse a folder holding a held-out split beside data of another split (a `save_to_disk` DatasetDict, whose
    splits are its folders, or a hub snapshot's files): read whole, the held-out split would be trained on. Splits
    that are all for training (train alone, train_en beside train_fr) are read. The error names each split and
    the source that reads it alone."""
    saved = fs.isfile(f"{root}/{_DATASET_DICT}")
    splits: dict[str, list[tuple[list[str], int]]] = {}  # split name -> (path parts, index of the split's part)
    for p in paths:
        parts = _relative(p, root).split("/")
        if found := _split_of(parts, saved):
            splits.setdefault(found[0], []).append((parts, found[1]))
    held_out = sorted(name for name in splits if name.lower().startswith(_HELD_OUT))
    if not held_out or len(splits) < 2:
        return
    base = source.rstrip("/")
    given = "; ".join(f"{name}: {base}/{_split_source(name, found)}" for name, found in sorted(splits.items()))
    what = f"a save_to_disk DatasetDict ({_DATASET_DICT})" if saved else "files of several splits"
    raise DataError(f"{source}: the folder holds {what}: {', '.join(sorted(splits))}; read whole, every split "
                    f"would be trained on, held-out ones ({', '.join(held_out)}) included. Give one split as the "
                    f"data source (its folder, a glob or a file) instead: {given}")


def _split_of(parts: list[str], saved: bool) -> tuple[str, int] | None:
    """(split, index of the path part that names it) of a data file: a DatasetDict's top folder, else the first
    folder or file name that starts with a split name (data/train_sft-0000.parquet: train_sft); None when no part
    names one (part-00000.jsonl)."""
    if saved:
        return (parts[0], 0) if len(parts) > 1 else None
    for k, part in enumerate(parts):
        if match := _SPLIT.match(part):
            return match.group(0), k
    return None


def _split_source(name: str, found: list[tuple[list[str], int]]) -> str:
    """The path (relative to the root) that reads one split: its folder, its only file, or a glob of its files."""
    parts, k = found[0]
    if k < len(parts) - 1:
        return "/".join(parts[: k + 1])
    if len(found) == 1:
        return "/".join(parts)
    return "/".join([*parts[:-1], parts[-1][: len(name) + 1] + "*"])  # train_sft-* (the name, its separator)


def without_output(files: list[SourceFile], out: str) -> list[SourceFile]:
    """The input files minus a stage's own output, when `out` lies inside the source folder (a rerun or a resume
    would read it as input)."""
    fs, root = fsspec.core.url_to_fs(out)
    prefix = fs.unstrip_protocol(root.rstrip("/")) + "/"
    kept = [f for f in files if not f.uri.startswith(prefix)]
    if not kept:
        raise DataError(f"{out}: the source holds no data files besides this output folder")
    return kept


# What object stores report about a file's content, strongest first: S3 (ChecksumSHA256, ETag), GCS (md5Hash,
# crc32c), HTTP (ETag), Azure (content_settings.content_md5, else etag). An ETag changes whenever the object is
# written again, so a fingerprint built on it never misses new content (an identical re-upload may still count
# as new: a cache miss).
_CHECKSUM_KEYS = ("ChecksumSHA256", "md5Hash", "crc32c", "ETag")


def stored_checksum(info: dict[str, Any]) -> str | None:
    """`key:value` of the content checksum an object store keeps for a file (fsspec info), None elsewhere (a local
    disk keeps none: its files are hashed)."""
    settings = info.get("content_settings")
    md5 = settings.get("content_md5") if isinstance(settings, dict) else getattr(settings, "content_md5", None)
    if isinstance(md5, bytes | bytearray):
        md5 = bytes(md5).hex()
    found = [(key, info.get(key)) for key in _CHECKSUM_KEYS] + [("content_md5", md5), ("etag", info.get("etag"))]
    for key, value in found:
        if value:
            return f"{key}:{str(value).strip(chr(34))}"  # chr(34): the quotes around an ETag
    return None


def _hidden(relative: str) -> bool:
    # .cache/, .ipynb_checkpoints/ and the like are not data
    return any(part.startswith(".") for part in relative.split("/")) or posixpath.basename(relative) in _NOT_DATA


def _relative(path: str, root: str) -> str:
    rel = posixpath.relpath(path, root) if root else path
    return rel if not rel.startswith("..") else posixpath.basename(path)


class FileRecords:
    """Streams the records of one file; `done` is the fraction of the file read so far (for the ETA)."""

    def __init__(self, file: SourceFile) -> None:
        self.file = file
        self.done = 0.0

    def __iter__(self) -> Iterator[RawRecord]:
        count = 0
        try:
            with fsspec.open(self.file.uri, "rb") as raw:
                for rec in self._records(raw):
                    count = rec.record + 1
                    yield rec
        except EOFError as exc:  # gzip/bz2/xz: the compressed stream ends before its end marker
            yield RawRecord(count, None, _truncated(count, f"{type(exc).__name__}: {exc}"))
        except (ConnectionError, TimeoutError) as exc:  # the network, not the file: no bad record, a rerun reads it
            raise TransientError(f"{self.file.uri}: reading it failed after {count} records ({type(exc).__name__}: "
                                 f"{exc}); a storage or network failure, run again") from exc
        except Exception as exc:  # a broken file counts as one bad record, never a crash
            yield RawRecord(count, None, ReadFailure(f"{type(exc).__name__}: {exc}"))
        self.done = 1.0

    def _records(self, raw: Any) -> Iterator[RawRecord]:
        base = _base_name(self.file.name)
        if base.endswith(".arrow"):  # a `datasets` save_to_disk shard (Arrow IPC)
            yield from self._arrow(raw)
            return
        if base.endswith(CSV_SUFFIXES):
            yield from self._csv(raw)
            return
        stream = self._decompressed(raw)
        head = stream.read(4)
        if _is_parquet(self.file, head):
            raw.seek(0)
            yield from self._parquet(raw)
            return
        stream = _Prepend(head, stream)
        first = stream.peek_nonspace()
        if first == b"[":
            yield from self._json_array(stream, raw)
        elif first == b"{" and not _is_json(stream.peek_line()):
            yield from self._documents(stream, raw)
        else:
            yield from self._jsonl(stream, raw)

    def _documents(self, stream: _Prepend, raw: Any) -> Iterator[RawRecord]:
        """A first line that is not JSON: the file may be one pretty-printed object (or several); else JSONL."""
        blob = stream.read_upto(_DOCUMENT_MAX)
        documents = _json_documents(blob) if len(blob) < _DOCUMENT_MAX else None
        if documents is None:
            yield from self._jsonl(_Prepend(blob, stream), raw)
            return
        for record, (line_no, text) in enumerate(documents):
            yield RawRecord(record, line_no, text)

    def _jsonl(self, stream: _Prepend, raw: Any) -> Iterator[RawRecord]:
        record = 0
        for line_no, line in enumerate(stream.lines(), 1):
            if line.strip():
                yield RawRecord(record, line_no, line)
                record += 1
                if record % 1024 == 0:
                    self._update(raw)

    def _json_array(self, stream: _Prepend, raw: Any) -> Iterator[RawRecord]:
        for record, (line_no, element) in enumerate(JsonArrayElements(stream)):
            if element is _CUT:
                yield RawRecord(record, line_no, _truncated(record, "end of file inside the JSON array"))
                return
            yield RawRecord(record, line_no, element)
            if record % 1024 == 0:
                self._update(raw)

    def _parquet(self, raw: Any) -> Iterator[RawRecord]:
        pf = pq.ParquetFile(raw)
        total = max(pf.metadata.num_rows, 1)
        record = 0
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH):
            for row in batch.to_pylist():
                yield RawRecord(record, None, row)
                record += 1
            self.done = record / total

    def _arrow(self, raw: Any) -> Iterator[RawRecord]:
        """Arrow IPC: the streaming format `datasets` writes, or the random-access file format. Cut short: the
        batches before the cut, then EOFError (a truncated_file); a file-format file without its footer (cut
        anywhere) is read as the stream it holds after its magic bytes."""
        magic = b"" if self.file.compression else raw.read(6)
        raw.seek(0)
        batches: Iterator[pa.RecordBatch]
        footerless = False
        if magic == b"ARROW1":
            try:
                reader = pa.ipc.open_file(raw)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # no footer: the end of the file is missing
                raw.seek(8)  # magic and padding; the stream format follows
                batches, footerless = iter(pa.ipc.open_stream(raw)), True
        else:
            batches = iter(pa.ipc.open_stream(self._decompressed(raw)))
        record = 0
        try:
            for batch in batches:
                for row in batch.to_pylist():
                    yield RawRecord(record, None, row)
                    record += 1
                self._update(raw)
        except (pa.ArrowInvalid, OSError) as exc:
            if not _ARROW_CUT.search(str(exc)):
                raise
            raise EOFError(f"the Arrow stream ends inside a message: {exc}") from exc
        if footerless:
            raise EOFError("the Arrow file has no footer")

    def _csv(self, raw: Any) -> Iterator[RawRecord]:
        """CSV/TSV with a header row, every cell read as text (quoted cells may span lines); a row with the wrong
        number of cells is one unparsable record (quoting the row), and the rest of the file is still read."""
        bad: list[Any] = []

        def skip(row: Any) -> str:
            bad.append(row)
            return "skip"

        parse = pcsv.ParseOptions(delimiter="\t" if _base_name(self.file.name).endswith(".tsv") else ",",
                                  newlines_in_values=True, invalid_row_handler=skip)
        names = self._open_csv(raw, parse).schema.names
        bad.clear()  # the header pass's findings come again in the real pass
        reader = self._open_csv(raw, parse, pcsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string())))
        record = 0
        for batch in reader:
            for row in batch.to_pylist():
                yield RawRecord(record, None, row)
                record += 1
            for row in bad:
                message = f"{row.actual_columns} cells where the header has {row.expected_columns}: {row.text[:80]!r}"
                yield RawRecord(record, row.number, ReadFailure(message, "unparsable"))
                record += 1
            bad.clear()
            self._update(raw)

    def _open_csv(self, raw: Any, parse: pcsv.ParseOptions, convert: pcsv.ConvertOptions | None = None) -> Any:
        raw.seek(0)
        return pcsv.open_csv(self._decompressed(raw), read_options=pcsv.ReadOptions(block_size=_READ_CHUNK),
                             parse_options=parse, convert_options=convert)

    def _decompressed(self, raw: Any) -> Any:
        """The file's bytes as stored, decompressed when its name says .gz/.bz2/.xz/.zst/..."""
        if self.file.compression == "zstd":
            return io.BufferedReader(_ZstdStream(raw), _READ_CHUNK)
        return compr[self.file.compression](raw, mode="rb") if self.file.compression else raw

    def _update(self, raw: Any) -> None:
        try:
            self.done = min(raw.tell() / max(self.file.size, 1), 1.0)
        except (OSError, ValueError):
            pass


class _ZstdStream(io.RawIOBase):
    """The decompressed bytes of a zstd file, frame after frame (pzstd writes several). A file that ends inside a
    frame raises EOFError, as gzip's reader does, so it is reported as cut short (fsspec's zstd reader returns
    what it decoded before the cut without a word)."""

    def __init__(self, raw: Any) -> None:
        import zstandard  # a dependency; imported here so that only zstd files need it

        self.raw, self.frame = raw, zstandard.ZstdDecompressor().decompressobj
        self.decoder, self.rest, self.out, self.open = self.frame(), b"", memoryview(b""), False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.out:
            data, self.rest = self.rest or self.raw.read(_READ_CHUNK), b""
            if not data:
                if self.open:
                    raise EOFError("the zstd stream ends inside a frame")
                return 0
            self.out = memoryview(self.decoder.decompress(data))
            self.open = not self.decoder.eof
            if self.decoder.eof:  # the next frame starts in what this one left over
                self.rest, self.decoder = self.decoder.unused_data, self.frame()
        n = min(len(buffer), len(self.out))
        buffer[:n], self.out = self.out[:n], self.out[n:]
        return n


def _is_parquet(file: SourceFile, head: bytes) -> bool:
    """By name first (a .jsonl whose first line happens to be b"PAR1" is JSON lines); magic bytes otherwise."""
    if file.name.lower().endswith(".parquet"):
        return True
    return head == b"PAR1" and not file.compression and not _base_name(file.name).endswith(JSON_SUFFIXES)


def _truncated(records: int, what: str) -> ReadFailure:
    return ReadFailure(f"the file is cut short ({what}); records read before the cut: {records}", "truncated_file")


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


def _json_documents(blob: bytes) -> list[tuple[int, bytes]] | None:
    """(first line, bytes) of each JSON value in a blob of concatenated values; None if it is not one."""
    try:
        text = blob.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        return None
    decoder, out, pos = json.JSONDecoder(), [], 0
    while (pos := _skip_ws(text, pos)) < len(text):
        try:
            _, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        out.append((text.count("\n", 0, pos) + 1, text[pos:end].encode()))
        pos = end
    return out or None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


class _Prepend:
    """A binary stream with a few bytes pushed back in front (we sniff the first bytes of every file)."""

    def __init__(self, head: bytes, stream: Any) -> None:
        self.buf, self.stream = head, stream
        # read1 returns what one decompression step gives: a stream cut short then loses only its last
        # partial chunk, where read(n) would drop up to n decoded bytes along with the EOFError
        self._read = getattr(stream, "read1", stream.read)

    def read(self, n: int) -> bytes:
        if self.buf:
            out, self.buf = self.buf, b""
            return out
        return self._read(n)

    def peek_line(self) -> bytes:
        """The first line (without b"\\n"), kept in the stream."""
        while b"\n" not in self.buf and (more := self._read(_READ_CHUNK)):
            self.buf += more
        return self.buf.split(b"\n", 1)[0]

    def read_upto(self, limit: int) -> bytes:
        """Everything up to `limit` bytes (fewer at EOF)."""
        parts, size = [], 0
        while size < limit and (chunk := self.read(_READ_CHUNK)):
            parts.append(chunk)
            size += len(chunk)
        return b"".join(parts)

    def peek_nonspace(self) -> bytes:
        """The first byte after leading whitespace and a UTF-8 byte order mark (b'' at EOF), kept in the stream.
        Only the whole mark is skipped: a lone 0xEF is content."""
        while True:
            rest = self.buf.lstrip(b" \t\r\n")
            if rest.startswith(_BOM):
                rest = rest[len(_BOM):].lstrip(b" \t\r\n")
            if rest and not (len(rest) < len(_BOM) and _BOM.startswith(rest)):  # not a mark read in part
                return rest[:1]
            more = self._read(4096)
            if not more:
                return rest[:1]
            self.buf += more

    def lines(self) -> Iterator[bytes]:
        """The stream split on b"\\n" (without it); memory ~ the longest line."""
        pending = b""
        while chunk := self.read(_READ_CHUNK):
            *done, pending = (pending + chunk).split(b"\n")
            yield from done
        if pending:
            yield pending


_STRUCT = re.compile(rb'[\[\]{}",]')
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # a string's bytes up to its quote, escapes whole


_CUT = b"<end of file inside the JSON array: the file is truncated>"


class JsonArrayElements:
    """The top-level elements of a JSON array as raw bytes with their first line; memory ~ one element.

    Structural errors never raise: the damaged stretch comes out as one element that fails to parse later.
    An array cut short ends with the `_CUT` element (the partial element before the end is not yielded)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.buf, self.eof = stream, b"", False
        self.line, self.line_pos = 1, 0

    def _fill(self) -> bool:
        data = b"" if self.eof else self.stream.read(_READ_CHUNK)
        self.eof = not data
        self.buf += data
        return bool(data)

    def _skip_space(self, pos: int) -> int:
        while True:
            while pos < len(self.buf) and self.buf[pos] in b" \t\r\n":
                pos += 1
            if pos < len(self.buf) or not self._fill():
                return pos

    def _line_at(self, pos: int) -> int:
        self.line += self.buf.count(b"\n", self.line_pos, pos)
        self.line_pos = pos
        return self.line

    def _drop_before(self, pos: int) -> int:
        """Forget the consumed bytes (memory stays ~ one element); returns the new position, 0."""
        self._line_at(pos)
        self.buf, self.line_pos = self.buf[pos:], 0
        return 0

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        self._fill()
        pos = self._skip_space(0)
        if self.buf[pos:pos + len(_BOM)] == _BOM:
            pos = self._skip_space(pos + len(_BOM))
        pos += 1  # the caller checked that this is '['
        while True:
            pos = self._drop_before(self._skip_space(pos))
            if pos >= len(self.buf):
                yield self._line_at(pos), _CUT
                return
            if self.buf[pos:pos + 1] == b"]":
                yield from self._trailing(pos + 1)
                return
            end, closed = self._element_end(pos)
            if end >= len(self.buf):  # no ',' or ']' before the end: the element may be cut, so it is lost
                yield self._line_at(pos), _CUT
                return
            yield self._line_at(pos), self.buf[pos:end].strip()
            if closed:
                yield from self._trailing(end + 1)
                return
            pos = end + 1

    def _trailing(self, pos: int) -> Iterator[tuple[int, bytes]]:
        pos = self._skip_space(pos)
        if pos < len(self.buf):
            yield self._line_at(pos), b"<data after the closing ] of the JSON array>"

    def _element_end(self, pos: int) -> tuple[int, bool]:
        """Index of the ',' or ']' that ends the element starting at pos, and whether it closed the array."""
        depth = 0
        while True:
            m = _STRUCT.search(self.buf, pos)
            if m is None:
                pos = len(self.buf)  # nothing structural before the end: the next search starts at the new bytes
                if not self._fill():
                    return len(self.buf), True
                continue
            c, pos = m.group(), m.end()
            if c == b'"':
                pos = self._string_end(pos)
            elif c in b"[{":
                depth += 1
            elif depth == 0 and c in b",]":
                return m.start(), c == b"]"
            elif c in b"]}":
                depth = max(depth - 1, 0)

    def _string_end(self, pos: int) -> int:
        """Index after the closing quote of the string whose bytes start at pos. Each read goes on from where the
        last stopped (a long string read chunk by chunk is scanned once); a backslash that ends the buffer is
        scanned again with the byte it escapes."""
        while True:
            body = _STRING_BODY.match(self.buf, pos)
            pos = body.end() if body else pos  # the pattern matches '' too: never None
            if pos < len(self.buf) and self.buf[pos] == 0x22:  # the closing quote
                return pos + 1
            if not self._fill():
                return len(self.buf)
