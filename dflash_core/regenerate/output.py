"""The output folder: JSONL shards, their journals (the resume state) and manifest.json.

A record's outcome is appended to `.work/shard-NNNNN.journal.jsonl` (flushed) as soon as it is known, in
completion order. When every record of a shard has an outcome, `shard-NNNNN.jsonl` is written in input order
under a temporary name and renamed: a shard file exists only complete. A re-run skips finished shards and the
journaled records of the others; a line torn by kill -9 is cut off. Records dropped as `server_error` (the
server failed on them while it answered others: overload, a timeout) are sent again by a re-run: their new outcome
is appended and the last one counts, and a finished shard that holds such drops is marked by
`.work/shard-NNNNN.retry` (so a re-run finds them without reading every journal) and rewritten once they are
retried. One process at a time works on a shard: it holds `.work/shard-NNNNN.lock` (publish.output_lock) while it
appends to the journal and writes the file; another run on the same folder does the other shards and waits for
that one. The hidden `.work/` folder is not read by `dflash tokenize --data DIR`, and manifest.json (written last)
only when every shard is done."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import fsspec

from dflash_core.data.accounting import DropLog
from dflash_core.publish import OutputLockedError, lock_holder, output_lock, wait_while_written
from dflash_core.regenerate.errors import RegenerateError

FORMAT = "dflash-regenerated-v1"
WORK = ".work"
MANIFEST = "manifest.json"
# drops a re-run sends again: the server failed on the record while it answered others (the other reasons are the
# record's own, or the server's answer to it, and stay)
RETRIED = frozenset({"server_error"})
# a temporary file of `OutputDir.replace` this much older than now was left by a killed writer (a live one renames
# its file within seconds of writing it; parallel shard task runs may be writing theirs right now)
STALE_TMP_S = 3600.0
_CLAIM_POLL_S = 0.05  # how often a run whose claim met another's looks again
log = logging.getLogger(__name__)


def shard_name(shard: int) -> str:
    """The output file of a shard."""
    return f"shard-{shard:05d}.jsonl"


class OutputDir:
    """The output folder of one run (any fsspec URI whose filesystem can append, e.g. local or NFS)."""

    def __init__(self, out: str) -> None:
        self.out = out.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.out)
        self.fs.makedirs(f"{self.root}/{WORK}", exist_ok=True)
        self._sweep_stale_tmp()

    def _sweep_stale_tmp(self) -> None:
        """Delete the temporary files that killed runs left in .work/ (each has a unique name, so repeated kills
        would pile them up); a file whose age the filesystem cannot tell is left alone."""
        now, swept = time.time(), 0
        for path in self.fs.glob(self.path(f"{WORK}/*.tmp")):
            try:
                stale = now - self.fs.modified(path).timestamp() > STALE_TMP_S
                if stale:
                    self.fs.rm(path)
                    swept += 1
            except (NotImplementedError, OSError):  # no modification time here, or another run swept it first
                continue
        if swept:
            log.info("removed %d temporary file(s) left in %s/%s by killed runs", swept, self.out, WORK)

    def path(self, name: str) -> str:
        """A path inside the folder."""
        return f"{self.root}/{name}"

    def claim(self, state: dict[str, Any]) -> None:
        """Record the run's identity in .work/run.json, or refuse a folder that holds a different run: under
        `.work/run.lock`, so that of two runs that claim the folder at the same moment the second sees the first's
        identity (without it, two runs of other settings could both find no run.json and both go on)."""
        target = f"{self.out}/{WORK}/run"
        while True:
            try:
                with output_lock(target, "regenerate"):
                    return self._claim(state)
            except OutputLockedError:  # another run is claiming this moment (a few ms)
                wait_while_written(target, _CLAIM_POLL_S)

    def _claim(self, state: dict[str, Any]) -> None:
        path = self.path(f"{WORK}/run.json")
        if self.fs.exists(path):
            with self.fs.open(path, "r") as fh:
                old = json.load(fh)
            if old.get("fingerprint") != state["fingerprint"]:
                raise RegenerateError(
                    f"{self.out} holds the output of another regenerate run (other input, target or sampling "
                    f"settings); use a new --out folder or delete this one")
            return
        self.replace(path, [json.dumps(state, indent=2).encode()])  # parallel shard task runs may claim at once

    def replace(self, path: str, chunks: Iterable[bytes]) -> None:
        """Write `path` under a unique temporary name in .work/, then rename it over `path`: a reader (or a kill)
        meets the old file or the new one, never half of one."""
        name = path.rsplit("/", 1)[-1]
        tmp = self.path(f"{WORK}/{name}.{uuid.uuid4().hex}.tmp")
        with self.fs.open(tmp, "wb") as fh:
            for chunk in chunks:
                fh.write(chunk)
        self.fs.mv(tmp, path)

    def shard_done(self, shard: int) -> bool:
        """Whether the shard's file was written (it is written only complete)."""
        return self.fs.exists(self.path(shard_name(shard)))

    def settled(self, shard: int) -> bool:
        """Whether the shard is written and a re-run has nothing to retry in it."""
        return self.shard_done(shard) and not self.fs.exists(self.work_file(shard, ".retry"))

    def unsettled(self, shards: Iterable[int]) -> set[int]:
        """Those of `shards` not settled: what a run still has to do."""
        return {s for s in shards if not self.settled(s)}

    def work_file(self, shard: int, suffix: str) -> str:
        """A shard's file under .work/: `.journal.jsonl`, `.retry`."""
        return self.path(f"{WORK}/{shard_name(shard).removesuffix('.jsonl')}{suffix}")

    def journal(self, shard: int) -> ShardJournal:
        """The shard's journal, opened for appending after the outcomes already in it."""
        return ShardJournal(self, shard)

    def outcomes(self, shard: int) -> dict[int, dict[str, Any]]:
        """Each journaled record's outcome by its index in the shard: the last one where a re-run retried it (a
        torn last line is ignored)."""
        path = self.work_file(shard, ".journal.jsonl")
        if not self.fs.exists(path):
            return {}
        lines = {}
        with self.fs.open(path, "rb") as fh:
            for raw in fh.read().split(b"\n"):
                try:
                    line = json.loads(raw)
                except ValueError:  # the torn tail of a killed run (or the empty string after the last \n)
                    continue
                lines[line["i"]] = line
        return lines

    def lock_target(self, shard: int) -> str:
        """What a run locks to work on a shard (publish.output_lock makes it `.work/shard-NNNNN.lock`): one process
        at a time appends to a shard's journal and sends its records."""
        return f"{self.out}/{WORK}/{shard_name(shard).removesuffix('.jsonl')}"

    def holder(self, shard: int) -> str | None:
        """Who holds the shard's lock (publish.lock_holder), for a run that waits for it; None when let go."""
        return lock_holder(self.lock_target(shard))

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """manifest.json, written last (whole: replace): its presence says the output is complete."""
        self.replace(self.path(MANIFEST), [json.dumps(manifest, indent=2).encode()])

    def remove_manifest(self) -> None:
        """An output whose shard a run works on is not complete until that run ends."""
        try:
            self.fs.rm(self.path(MANIFEST))
        except FileNotFoundError:  # none, or another run working on another shard removed it first
            pass


class ShardJournal:
    """Append-only outcomes of one shard; `finish()` writes the shard file in input order."""

    def __init__(self, out: OutputDir, shard: int) -> None:
        self.out, self.shard = out, shard
        self.lines = out.outcomes(shard)
        self.path = out.work_file(shard, ".journal.jsonl")
        # rewrite the last outcomes (an append after a torn line breaks; retried records keep one line), whole: a
        # kill while rewriting leaves the old journal
        out.replace(self.path, [b"".join(_line(v) for v in self.lines.values())])
        self.fh = out.fs.open(self.path, "ab")

    def add(self, line: dict[str, Any]) -> None:
        """Journal one outcome and flush it (it survives a kill -9 of this process)."""
        self.lines[line["i"]] = line
        self.fh.write(_line(line))
        self.fh.flush()

    def retryable(self) -> set[int]:
        """The records a re-run sends again (dropped as server_error)."""
        return {i for i, line in self.lines.items() if line.get("drop") in RETRIED}

    def finish(self) -> None:
        """Write shard-NNNNN.jsonl (kept records, input order) under a temporary name, then rename it (over the
        file of an earlier run whose server_error drops were retried); mark it while it holds such drops."""
        self.fh.close()
        fs, marker, retry = self.out.fs, self.out.work_file(self.shard, ".retry"), sorted(self.retryable())
        if retry:  # before the shard file: a shard is never seen settled with drops left to retry
            with fs.open(marker, "w") as fh:
                json.dump(retry, fh)
        self.out.replace(self.out.path(shard_name(self.shard)), self._kept_lines())
        if not retry and fs.exists(marker):
            fs.rm(marker)

    def _kept_lines(self) -> Iterator[bytes]:
        """The shard file's lines: the kept records in input order."""
        for i in sorted(self.lines):
            kept = self.lines[i]
            if "messages" in kept:
                tools = {"tools": kept["tools"]} if kept.get("tools") else {}
                yield _line({"messages": kept["messages"], **tools, "source": kept["source"]})

    def close(self) -> None:
        """Close the journal (an unfinished shard resumes from it)."""
        self.fh.close()


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")


def counting(sources: Iterable[str]) -> str:
    """How a sum of token counts was made, from how its parts were (Reply.counted_by): `server` (every one from the
    server's `usage`, and a sum of none), `tokenizer` (every one counted with the target's tokenizer), `mixed`, or
    `unknown` (some counted by nobody: the sum leaves them out)."""
    kinds = set(sources)
    if "unknown" in kinds:
        return "unknown"
    if len(kinds) > 1:
        return "mixed"
    return kinds.pop() if kinds else "server"


def tally(out: OutputDir, shards: Iterable[int], max_examples: int) -> dict[str, Any]:
    """Counts over these shards' journals: read, kept (and of those, cut: ending after the last turn the server
    answered; tools_unsent: with tool definitions the requests did not carry), drops by reason (with examples),
    finish reasons, tokens (and how they were counted: a journal line without `tokens_counted_by` has the
    server's counts)."""
    drops, finish = DropLog(max_examples), Counter[str]()
    read = kept = cut = tokens = tools_unsent = 0
    counted_by: set[str] = set()
    per_shard = []
    for shard in shards:
        lines = list(out.outcomes(shard).values())
        shard_kept = sum("messages" in line for line in lines)
        per_shard.append({"file": shard_name(shard), "records": len(lines), "kept": shard_kept})
        for line in lines:
            read += 1
            kept += "messages" in line
            cut += "cut" in line
            tools_unsent += "tools_unsent" in line
            tokens += line.get("tokens", 0)
            if line.get("finish"):  # the server answered it at least once
                counted_by.add(line.get("tokens_counted_by", "server"))
            finish.update(line.get("finish", []))
            if "drop" in line:
                src = line["source"]
                drops.add(line["drop"], src["file"], src["record"], line.get("line"), line.get("id"), line["detail"])
    return {"read": read, "kept": kept, "cut": cut, "tools_unsent": tools_unsent, "dropped": drops.dropped(),
            "finish_reasons": dict(sorted(finish.items())), "tokens_generated": tokens,
            "tokens_counted_by": counting(counted_by), "shards": per_shard,
            "drop_examples": {r: drops.examples[r] for r in sorted(drops.examples)}}
