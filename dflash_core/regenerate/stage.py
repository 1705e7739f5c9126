"""The regenerate stage: every assistant turn of the chat data re-answered by the target (see DESIGN.md).

Records are read in input order and numbered; record g belongs to shard g // records_per_shard. Requests go
to every endpoint at once (data parallel), `concurrency` conversations in flight per endpoint. A record whose
endpoint dies goes back in the queue for the others; when none is left the stage fails, naming them. A shard is
worked on by the one process that holds its lock (`.work/shard-NNNNN.lock`): two runs on the same folder at once
share the shards instead of sending every record twice, and each waits for the other's before it counts."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import socket
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from itertools import chain, islice
from pathlib import Path
from typing import Any, cast

from dflash_core.data.config import DataConfig
from dflash_core.data.errors import TemplateError
from dflash_core.data.fingerprint import files_digest, model_digest
from dflash_core.data.formats import Drop, detect_schema, parse_payload, record_id, role_table
from dflash_core.data.sources import FileRecords, SourceFile, list_files, without_output
from dflash_core.data.template import load_tokenizer, template_text, turn_shaping
from dflash_core.io import is_local
from dflash_core.publish import OutputLockedError, being_written, lock_holder, output_lock, wait_while_written
from dflash_core.regenerate.client import Endpoint, Rejected, Reply, Unavailable, api_key, sampling_body
from dflash_core.regenerate.config import RegenerateConfig
from dflash_core.regenerate.errors import EndpointError, RegenerateError
from dflash_core.regenerate.output import FORMAT, WORK, OutputDir, ShardJournal, counting, shard_name, tally
from dflash_core.regenerate.records import (
    FINISHED,
    Chat,
    Messages,
    Regenerated,
    empty_reply,
    record_messages,
    regenerate,
    rejection,
)
from dflash_core.regenerate.server import local_servers, servable_model

log = logging.getLogger(__name__)
Progress = Callable[[dict[str, Any]], None]
Say = Callable[[str], None]
_DETECT_HEAD = 32
_PROGRESS_EVERY_S = 2.0
# refusals and empty replies before any kept reply that make the run ask the server a one-line question with the
# same settings: refused or answered empty too, a setting fails every request (max_tokens beyond the server's
# context length, tools without a tool parser, a reasoning parser that files the answer as reasoning) and the run
# stops; answered, they were the records' own (prompts too long for the context) and are journaled as drops
_SYSTEMIC_REFUSALS = 8
_PROBE = [{"role": "user", "content": "Say hello."}]
# an endpoint that fails this many requests in a row (every retry of each) while it still lists its models is
# taken out of the run, its records sent to the others (a gateway whose backend is gone, an engine that errs on
# every request); at least 2 x concurrency, so a burst of timeouts under load does not count
_FAILING_IN_A_ROW = 8
_RESTART_POLL_S = 5.0  # how often a restarting endpoint is asked GET /models
_LOCK_POLL_S = 5.0  # how often a run waiting for a shard another process works on checks that process's lock


@dataclass(frozen=True)
class Item:
    """One input record: its shard, position in the shard, provenance and its chat (or why not)."""

    shard: int
    index: int
    source: dict[str, Any]
    extra: dict[str, Any]
    chat: Chat | Drop


def check_kept(summary: dict[str, Any]) -> None:
    """RegenerateError when the stage kept no record of those it read: tokenize would only find an empty output.
    Names the drops and, for replies cut at max_tokens (a target that never stops), the settings to change."""
    if summary.get("kept") or not summary.get("read"):
        return
    dropped = summary.get("dropped") or {}
    hint = (" (replies cut at max_tokens: raise data.regenerate.max_tokens, or set data.regenerate.keep_truncated: "
            "true to train on them)" if "truncated" in dropped else "")
    raise RegenerateError(f"regenerate kept none of the {summary['read']} records it read, dropped {dropped}{hint}; "
                          f"examples in {summary.get('out')}/manifest.json")


def thinking_enabled(data: DataConfig) -> bool:
    """The reasoning switch, shared with tokenize and eval: `data.thinking: keep` turns it on."""
    return data.thinking == "keep"


def request_sampling(data: DataConfig) -> dict[str, Any]:
    """The sampling fields of every request: data.regenerate's, with the reasoning switch also under the name the
    chat template of data.tokenizer (the target's, which its server renders with) reads, where it can be loaded."""
    tok, _ = _target_tokenizer(data.tokenizer)
    return sampling_body(data.regenerate, thinking_enabled(data), data.max_length, template_text(tok))


def sent_turns(data: DataConfig) -> tuple[bool, bool]:
    """(fold, merge) for the conversations sent, as tokenize shapes them (template.turn_shaping), `auto` probing
    the chat template of data.tokenizer: the target's, whose server renders the requests (Gemma's and
    Mistral's servers answer HTTP 400 to a system turn or to two user turns in a row)."""
    auto = "auto" in (data.system_turn, data.same_role_turns)
    return turn_shaping(_probe_tokenizer(data.tokenizer) if auto else None, data.system_turn, data.same_role_turns)


@functools.lru_cache(maxsize=8)
def _target_tokenizer(tokenizer: str) -> tuple[Any, TemplateError | None]:
    """data.tokenizer (the target's), loaded once per process: (it, None), or (None, why it cannot be loaded)."""
    try:
        return load_tokenizer(tokenizer), None
    except TemplateError as exc:
        return None, exc


@functools.lru_cache(maxsize=8)
def _probe_tokenizer(tokenizer: str) -> Any:
    """The tokenizer whose chat template `auto` probes, or None where there is none to probe: one that cannot be
    loaded (the requests go as they are; tokenize reports it), or one without a chat template."""
    tok, error = _target_tokenizer(tokenizer)
    if error is not None:
        log.warning("data.system_turn / data.same_role_turns auto: %s; conversations are sent as they are", error)
        return None
    return tok if getattr(tok, "chat_template", None) else None


@functools.lru_cache(maxsize=8)
def _counting_tokenizer(tokenizer: str) -> Any:
    """The tokenizer that counts the tokens of replies a server sent without `usage`, or None (said once) where it
    cannot be loaded: those replies then count 0 and the summary says `unknown` rather than pretend."""
    tok, error = _target_tokenizer(tokenizer)
    if error is not None:
        log.warning("the server sends replies without token counts (`usage`) and %s: tokens_generated leaves them "
                    "out (tokens_counted_by: unknown)", error)
    return tok


def reply_tokens(tok: Any, reply: Reply) -> int:
    """The tokens of a reply's text as the target's tokenizer encodes it, without special tokens: its content, its
    reasoning and each tool call's name and arguments (the markup around them, think tags or a tool-call wrapper,
    is left out: a few tokens per reply less than the server generated)."""
    calls = [c["function"] for c in reply.tool_calls or []]
    arguments = [a if isinstance(a := f.get("arguments"), str) else json.dumps(a, ensure_ascii=False) for f in calls]
    parts = [reply.content, reply.reasoning, *(f.get("name") for f in calls), *arguments]
    return sum(len(tok.encode(p, add_special_tokens=False)) for p in parts if isinstance(p, str) and p)


def settings(data: DataConfig, target: str | None) -> dict[str, Any]:
    """Everything besides the input bytes that changes the output (the cache key's other half)."""
    cfg = data.regenerate
    # system_turn and same_role_turns only when they change what is sent (merged, by `merge` or by `auto` on a
    # template that refuses them): caches made before the settings existed stay valid
    merged = {"system_turn": "merge", "same_role_turns": "merge"}
    reader = {**data.model_dump(mode="json", include={"format", "messages_key", "role_map"}),
              **{k: merged[k] for k, sent in zip(merged, sent_turns(data), strict=True) if sent}}
    # the target's weights, not only its path: a target replaced in place (a new version behind the same folder or
    # symlink) writes other replies (with endpoints the server's model is what answers: cfg.model names it)
    weights = None if cfg.endpoints else model_digest(target)
    return {"format": FORMAT, "target": target, "model": cfg.model, **({"target_weights": weights} if weights else {}),
            "sampling": request_sampling(data), "keep_truncated": cfg.keep_truncated,
            "records_per_shard": cfg.records_per_shard, "limit": cfg.limit, "reader": reader,
            # only when on: caches made before the setting existed stay valid
            **({"send_tools": True} if cfg.send_tools else {})}


def regenerate_fingerprint(source: str, data: DataConfig, target: str | None) -> str:
    """Content fingerprint of a run: input bytes + target + sampling and sharding settings."""
    return _fingerprint(list_files(source), settings(data, target))


def _fingerprint(files: list[SourceFile], state: dict[str, Any]) -> str:
    blob = json.dumps([files_digest(files), state], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_items(files: list[SourceFile], data: DataConfig, only: Collection[int] | None = None,
               claim: Callable[[int], bool] | None = None) -> Iterator[Item]:
    """Every input record in order (up to data.regenerate.limit) with its shard and messages; with `only`, those
    of these shards alone: the others are counted, not parsed, and reading stops after the last of them. `claim`
    is asked about each wanted shard at its first record (_Run.claim: its lock); a shard it declines is skipped
    as an unwanted one is."""
    roles, per_shard, limit = role_table(data.role_map), data.regenerate.records_per_shard, data.regenerate.limit
    fold, merge = sent_turns(data)
    if only is not None and not only:
        return
    last = None if only is None else max(only)
    g, asked, wanted = 0, -1, False
    for file in files:
        records = iter(FileRecords(file))
        head = list(islice(records, _DETECT_HEAD))
        schema = None  # detected from the file's head once one of its records is wanted
        for raw in chain(head, records):
            shard = g // per_shard
            if (limit is not None and g >= limit) or (last is not None and shard > last):
                return
            if shard != asked:  # a shard's records are consecutive: asked once, at its first
                asked = shard
                wanted = (only is None or shard in only) and (claim is None or claim(shard))
            if wanted:
                parsed = parse_payload(raw.payload)
                if schema is None:
                    parsed_head = [p for p in (parse_payload(r.payload) for r in head) if not isinstance(p, Drop)]
                    schema = detect_schema(parsed_head, data.format, data.messages_key)
                chat = parsed if isinstance(parsed, Drop) else record_messages(parsed, schema, roles, fold, merge)
                extra = {k: v for k, v in (("line", raw.line), ("id", record_id(parsed))) if v is not None}
                yield Item(shard, g % per_shard, {"file": file.name, "record": raw.record}, extra, chat)
            g += 1


def count_records(files: list[SourceFile], data: DataConfig) -> int:
    """How many input records a run reads (up to data.regenerate.limit): counted as stored, none parsed."""
    records = chain.from_iterable(FileRecords(f) for f in files)
    return sum(1 for _ in islice(records, data.regenerate.limit))


def regenerate_dataset(source: str, out: str, data: DataConfig, target: str | None = None,
                       tokenizer: str | None = None, shards: Collection[int] | None = None,
                       progress: Progress | None = None, fingerprint: str | None = None,
                       records: int | None = None, say: Say = log.warning) -> dict[str, Any]:
    """Regenerate the chat data under `source` into `out` (resuming what an earlier run left); returns the
    summary. `shards` restricts the run to those shards (one Prefect task run each): it reads and parses only
    their records, its counts are theirs, and it leaves manifest.json to a run of every shard, which writes it
    when every shard is done. `fingerprint` and `records`: the run's regenerate_fingerprint and count_records
    when the caller has them (a shard's task run then neither hashes nor counts the whole input again, and reads
    no further than its shard). No server is started when nothing is left to do. A shard another live process
    works on (another run on the same data: a manual run beside the nightly one) is left to it: this run does
    the others, then waits for it (`say` tells which and for whom) and takes it as it is left, or finishes it
    when that process stopped first; so the counts are of every shard, done by either."""
    cfg = data.regenerate
    files = without_output(list_files(source), out)  # an --out inside the source folder is not input
    output = OutputDir(out)
    state = settings(data, target)  # reads the ends of the target's weight files: once
    fingerprint = fingerprint or _fingerprint(files, state)
    output.claim({"fingerprint": fingerprint, "source": source, "settings": state})
    records = count_records(files, data) if records is None else records
    total_shards = cfg.shard_count(records)
    covered = range(total_shards) if shards is None else sorted(s for s in set(shards) if 0 <= s < total_shards)
    todo = output.unsettled(covered)
    model, seconds = cfg.model, 0.0
    with ExitStack() as stack:
        if not cfg.endpoints:  # local servers: started once a shard is free, one run's at a time on a host
            todo = _servers_of_this_host(output, _until_one_is_free(output, todo, say), say, stack)
        run = _Run(output, data, records, todo, progress, say)
        if todo:
            key = api_key(cfg)
            urls = cfg.endpoints or stack.enter_context(_serve(cfg, target, tokenizer, output, key))
            model, seconds = asyncio.run(run.execute(lambda only: read_items(files, data, only, run.claim), urls,
                                                     key))
    counts = tally(output, covered, data.max_examples)
    complete = all(output.shard_done(s) for s in range(total_shards))
    if counts["tools_unsent"]:
        log.warning("%d kept records carry tool definitions that were not sent with their requests "
                    "(data.regenerate.send_tools: false): the target wrote their replies without them, and training "
                    "renders them; set send_tools: true (vLLM: --enable-auto-tool-choice --tool-call-parser ...) so "
                    "the replies are the ones the target writes with its tools", counts["tools_unsent"])
    summary = {"read": counts["read"], "kept": counts["kept"], "cut": counts["cut"], "dropped": counts["dropped"],
               "tools_unsent": counts["tools_unsent"],
               "tokens_generated": counts["tokens_generated"], "tokens_counted_by": counts["tokens_counted_by"],
               "finish_reasons": counts["finish_reasons"], "model": model, "out": out, "complete": complete,
               "shards": total_shards, "tokens_per_s": run.tokens_per_s(seconds), "fingerprint": fingerprint,
               "retried": run.retried}
    if complete and shards is None:
        output.write_manifest({"format": FORMAT, "fingerprint": fingerprint, **counts, "model": model,
                               "endpoints": cfg.endpoints or [f"local {cfg.serve} serve"] * cfg.replicas,
                               "sampling": state["sampling"], "keep_truncated": cfg.keep_truncated,
                               "sources": [{"file": f.name, "bytes": f.size} for f in files]})
    return summary


def _until_one_is_free(output: OutputDir, todo: set[int], say: Say) -> set[int]:
    """The shards still to do once one of them is not held by another live run: a run that would start local
    servers starts none only to wait (another run's servers on the same GPUs leave no memory for them: they would
    fail to start, and the run with them); where the other run does them all, none is started at all."""
    said = False
    while todo and all(being_written(output.lock_target(s)) for s in todo):
        if not said:
            say(f"regenerate: every shard left to do in {output.out} ({len(todo)}) is being regenerated by another run "
                f"({output.holder(min(todo))}); waiting for it before starting local servers, to take its shards as "
                f"they are written (or to do them, if that run stops first)")
            said = True
        time.sleep(_LOCK_POLL_S)
        todo = output.unsettled(todo)
    return todo


def _servers_of_this_host(output: OutputDir, todo: set[int], say: Say, stack: ExitStack) -> set[int]:
    """The shards still to do once this run holds `.work/serve-<host>` (held in `stack` while its local servers
    run): one run's local servers at a time on a host (another run's on the same GPUs leave its own no memory:
    they would fail to start, and the run with them). While another live run on this host holds it, wait, saying
    so once; its shards are taken as it writes them, so that run's end may leave nothing to do."""
    lock = f"{output.out}/{WORK}/serve-{socket.gethostname()}"
    said = False
    while todo:
        try:
            stack.enter_context(output_lock(lock, "regenerate"))
            return output.unsettled(todo)
        except OutputLockedError:
            if not said:
                say(f"regenerate: another run's local servers are up on this host for {output.out} "
                    f"({lock_holder(lock)}); waiting for them to stop before starting this run's (the GPUs are "
                    f"taken), then doing the shards left")
                said = True
            wait_while_written(lock, _LOCK_POLL_S)
            todo = output.unsettled(todo)
    return todo


def _why(result: Regenerated) -> str:
    """What a held outcome says: its drop's detail, or why its conversation was cut."""
    return result.drop.detail if result.drop is not None else result.cut or ""


async def _answers_within(endpoint: Endpoint, seconds: float) -> bool:
    """Poll GET /models every few seconds until it answers (True) or `seconds` have passed (False)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await asyncio.sleep(min(_RESTART_POLL_S, max(deadline - time.monotonic(), 0.0)))
        if await endpoint.responsive():
            log.warning("endpoint %s answers again; its records are sent again", endpoint.url)
            return True
    return False


def _serve(cfg: RegenerateConfig, target: str | None, tokenizer: str | None, output: OutputDir, key: str | None):
    """The local servers of the target (data.regenerate.serve, `replicas` of them), their logs under .work/
    (server.log, then server-1.log, ...)."""
    if target is None:
        raise RegenerateError("no endpoint and no target: give --endpoint URL (or data.regenerate.endpoints) "
                              "or model.target for a local server")
    local = is_local(output.fs)
    workdir = Path(output.root, WORK) if local else Path(tempfile.mkdtemp(prefix="dflash-regenerate-"))
    model = servable_model(target, tokenizer or target, workdir)
    log.info("starting %s local %s server%s for %s", cfg.replicas, cfg.serve, "s" if cfg.replicas > 1 else "",
             model)
    logs = [workdir / ("server.log" if i == 0 else f"server-{i}.log") for i in range(cfg.replicas)]
    return local_servers(cfg.serve, model, cfg.serve_args, logs, cfg.startup_timeout_s, key)


class _Run:
    """One execution: the work queue, the workers of every endpoint, the journals, the counts."""

    def __init__(self, output: OutputDir, data: DataConfig, records: int, todo: Collection[int],
                 progress: Progress | None, say: Say = log.warning) -> None:
        self.output, self.cfg, self.progress, self.say = output, data.regenerate, progress, say
        self.tokenizer = data.tokenizer  # counts the replies a server sends without `usage`
        self.records = records  # in the whole input: the last shard holds the rest
        self.todo = set(todo)
        self.todo_records = sum(self.size(s) for s in todo)  # in the shards this run works on (the bar's 100%)
        self.locks: dict[int, ExitStack] = {}  # the shards this run works on now, by their held lock
        self.deferred: set[int] = set()  # this round's shards that another live process held
        # shards found held by another process: their server_error drops are not sent again (it may have just
        # sent them: a rerun will)
        self.others: set[int] = set()
        self.cleared = False  # manifest.json removed, once this run works on a shard
        self.taken = 0  # shards this run claimed or took as another left them (the rounds' progress)
        self.waited_s = 0.0
        self.counted_by: set[str] = set()  # where the token counts of this run's replies come from
        self.keep_thinking = thinking_enabled(data)
        self.body = request_sampling(data)
        self.failing_limit = max(_FAILING_IN_A_ROW, 2 * self.cfg.concurrency)  # failures in a row: endpoint out
        self.journals: dict[int, ShardJournal] = {}
        # by shard: the server_error drops of an earlier run, and those of them sent again and not yet answered
        self.retryable: dict[int, set[int]] = {}
        self.retrying: dict[int, set[int]] = {}
        self.finished: set[int] = set()
        self.sizes: dict[int, int] = {}
        self.last_shard = -1
        self.done = self.tokens = self.total = self.retried = self.resumed = 0
        # by lane (_lane: an endpoint, with or without tools sent): refusals and empty replies held back until it
        # keeps a reply or answers the probe
        self.trusted: set[str] = set()
        self.probing: set[str] = set()
        self.held: dict[str, list[tuple[Item, Regenerated]]] = {}
        self.failure: BaseException | None = None
        self.start = self.last_progress = time.monotonic()

    async def execute(self, read: Callable[[Collection[int]], Iterator[Item]], urls: list[str],
                      key: str | None = None) -> tuple[str, float]:
        """Check every endpoint, then regenerate the shards to do in rounds: `read(shards)` yields their records,
        asking claim() at each shard's first; after a round, the shards other processes held are waited for and
        the next round tries those they did not finish. Returns the model id and the seconds spent generating
        (waits left out)."""
        endpoints = [Endpoint(u, self.cfg, key) for u in urls]
        try:
            listed = await asyncio.gather(*(e.models() for e in endpoints))
            self.model = self.cfg.model or listed[0][0]
            for endpoint, models in zip(endpoints, listed, strict=True):
                if self.model not in models:  # every request would be refused: not a per-record drop
                    raise EndpointError(f"endpoint {endpoint.url} serves {models}, not {self.model!r}; "
                                        f"fix --model (data.regenerate.model) or the endpoint")
            self.start = time.monotonic()
            left, taken = set(self.todo), -1
            while left:
                if self.taken == taken:  # nothing came free since the last round (a gone holder's processes still
                    await self._pause()  # hold its lock): no busy loop
                taken = self.taken
                self.deferred = set()
                await self._pump(read(left), endpoints)
                left = await self._await_others()
            return self.model, time.monotonic() - self.start - self.waited_s
        finally:
            for journal in self.journals.values():
                journal.close()
            for lock in self.locks.values():  # after the journals: the next holder appends to them
                lock.close()
            await asyncio.gather(*(e.close() for e in endpoints))

    def claim(self, shard: int) -> bool:
        """Whether this run works on the shard now (read_items asks at its first record): it takes the shard's lock
        and keeps it until the shard is written; a shard another live process holds is left to it (waited for
        after this round), one another process finished since this run began is taken as it is."""
        lock = ExitStack()
        try:
            lock.enter_context(output_lock(self.output.lock_target(shard), "regenerate"))
        except OutputLockedError:
            self.deferred.add(shard)
            self.others.add(shard)
            return False
        try:
            elsewhere = self._finished_elsewhere(shard)
        except BaseException:  # a failed look at the output: let go, or the heartbeat keeps the lock live
            lock.close()
            raise
        if elsewhere:
            lock.close()
            return False
        self.locks[shard] = lock
        self.taken += 1
        if not self.cleared:  # the output is not complete while one of its shards is worked on
            self.output.remove_manifest()
            self.cleared = True
        return True

    def _finished_elsewhere(self, shard: int) -> bool:
        """Whether another process wrote the shard whole since this run began: its outcomes are this run's too
        (counted as resumed)."""
        if not self.output.settled(shard):
            return False
        self.resumed += self.size(shard)
        self.taken += 1
        self._report()
        return True

    async def _await_others(self) -> set[int]:
        """After a round, the shards other live processes held: once the first of them is let go (written, or its
        holder failed or is gone: publish.wait_while_written), those not written meanwhile, for the next round."""
        if not self.deferred:
            return set()
        shard = min(self.deferred)
        if holder := self.output.holder(shard):  # else let go since: nothing to wait for
            more = f" (and {len(self.deferred) - 1} more shards)" if len(self.deferred) > 1 else ""
            self.say(f"regenerate: {shard_name(shard)}{more} of {self.output.out} is being regenerated by another "
                     f"run ({holder}); waiting for it, to take its records as they are written (or to finish them, "
                     f"if that run stops first)")
        await self._pause(functools.partial(being_written, self.output.lock_target(shard)))
        return {s for s in self.deferred if not self._finished_elsewhere(s)}

    async def _pause(self, busy: Callable[[], bool] | None = None) -> None:
        """Wait while `busy()` says so (one quick look every _LOCK_POLL_S, in a thread), or _LOCK_POLL_S once without
        it: on the event loop, so that Ctrl-C or a cancel ends it at once (a whole wait in a thread would hold up
        asyncio.run's exit until the other run lets go). Its time is left out of tokens/s."""
        began = time.monotonic()
        try:
            if busy is None:
                await asyncio.sleep(_LOCK_POLL_S)
            while busy is not None and await asyncio.to_thread(busy):
                await asyncio.sleep(_LOCK_POLL_S)
        finally:
            self.waited_s += time.monotonic() - began

    def tokens_per_s(self, seconds: float) -> float | None:
        """This run's generation rate; None when it got no reply or some of its replies went uncounted."""
        if not seconds or not self.counted_by or counting(self.counted_by) == "unknown":
            return None
        return round(self.tokens / seconds, 1)

    async def _pump(self, items: Iterator[Item], endpoints: list[Endpoint]) -> None:
        self.last_shard = -1  # a round reads the input from its start
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.room = asyncio.Semaphore(2 * self.cfg.concurrency * len(endpoints))  # the reader stays close
        self.idle = asyncio.Event()
        self.pending = 0
        self.endpoints = endpoints
        workers = [asyncio.create_task(self._worker(e)) for e in endpoints for _ in range(self.cfg.concurrency)]
        try:
            for item in items:
                self._new_record(item)
                if self._known(item):
                    self.resumed += 1
                    continue
                if isinstance(item.chat, Drop):
                    self._record(item, Regenerated(drop=item.chat))
                    continue
                await self.room.acquire()
                self._raise_failure()
                self._enqueue(item)
            self._close_sizes()
            await self._drain()
            while orphans := [lane for lane, held in self.held.items() if held and not self._owner(lane).alive]:
                for lane in orphans:  # held by an endpoint taken out since: its refusals vouch for nothing
                    for item, _ in self.held.pop(lane):
                        self._enqueue(item)  # sent again, to the live ones
                await self._drain()
            for lane in list(self.held):  # the input ran out before a kept reply or _SYSTEMIC_REFUSALS held outcomes
                endpoint = self._owner(lane)
                if self.held.get(lane):  # asked of the endpoint that refused: another's reply vouches for nothing
                    await self._probe(lane, endpoint)
                    self._raise_failure()
                    if held := self.held.get(lane):
                        raise self._systemic(lane, endpoint, held, "the one-line question could not be sent to tell")
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    def _enqueue(self, item: Item) -> None:
        """Queue a record for the workers; it is pending until settled."""
        self.pending += 1
        self.idle.clear()
        self.queue.put_nowait(item)

    async def _drain(self) -> None:
        """Wait until every queued record is settled (or the run fails: raised here)."""
        while self.pending and self.failure is None:
            await self.idle.wait()
        self._raise_failure()

    def _owner(self, lane: str) -> Endpoint:
        """The endpoint of a lane (_lane: its URL, a space, then tools or not)."""
        return next(e for e in self.endpoints if lane.startswith(e.url + " "))

    def _new_record(self, item: Item) -> None:
        """Track shard sizes: a shard can finish once the reader has moved past it."""
        self.total += 1
        if item.shard != self.last_shard:
            self._close_sizes()
            self.last_shard = item.shard

    def _close_sizes(self) -> None:
        if self.last_shard >= 0:
            self.sizes[self.last_shard] = self.size(self.last_shard)
            self._maybe_finish(self.last_shard)

    def size(self, shard: int) -> int:
        """The shard's record count (records_per_shard; the last shard holds the rest)."""
        per_shard = self.cfg.records_per_shard
        return min(per_shard, self.records - shard * per_shard)

    def _known(self, item: Item) -> bool:
        """Done in an earlier run: the record's outcome is journaled and final (a server_error drop is sent again).
        Settled shards never get here: read_items leaves them out."""
        if item.shard not in self.journals:
            self.journals[item.shard] = self.output.journal(item.shard)
            self.retryable[item.shard] = self.journals[item.shard].retryable()
        if item.index in self.retryable[item.shard] and item.shard not in self.others:
            self.retrying.setdefault(item.shard, set()).add(item.index)
            self.retried += 1
            return False
        return item.index in self.journals[item.shard].lines

    async def _worker(self, endpoint: Endpoint) -> None:
        try:
            while True:
                item = await self.queue.get()
                if endpoint.waiting is not None and not endpoint.waiting.done():  # restarting: wait with it
                    if not await asyncio.shield(endpoint.waiting):
                        self._endpoint_down(endpoint, f"it did not answer within restart_wait_s "
                                                      f"({self.cfg.restart_wait_s:.0f} s)")
                if not endpoint.alive:
                    self.queue.put_nowait(item)
                    return
                try:
                    chat = cast(Chat, item.chat)  # dropped records are journaled, never queued
                    messages = chat.messages
                    result = await regenerate(messages, functools.partial(self._send, endpoint, tools=chat.tools),
                                              self.cfg.keep_truncated, self.keep_thinking)
                    endpoint.failed_in_a_row = 0
                except Rejected as exc:
                    result = Regenerated(drop=Drop("rejected_by_server", rejection(exc, messages)))
                    endpoint.failed_in_a_row = 0
                except Unavailable as exc:
                    if endpoint.alive and await endpoint.responsive():  # it answers others: only this one fails
                        endpoint.failed_in_a_row += 1
                        if endpoint.failed_in_a_row >= self.failing_limit:  # ... unless it fails them all
                            self.queue.put_nowait(item)  # another endpoint regenerates it
                            self._endpoint_down(endpoint, f"failed {endpoint.failed_in_a_row} requests in a row "
                                                          f"while it still lists its models; last: {exc}")
                            return
                        result = Regenerated(drop=Drop("server_error", str(exc)))
                    elif await self._comes_back(endpoint):
                        self.queue.put_nowait(item)  # it failed because the server was restarting
                        continue
                    else:
                        self.queue.put_nowait(item)  # another endpoint regenerates it
                        self._endpoint_down(endpoint, exc)
                        return
                await self._settle(item, result, endpoint)
                self.pending -= 1
                self.room.release()
                if not self.pending:
                    self.idle.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug must stop the run, not vanish with its task
            self._fail(exc)
            raise

    async def _settle(self, item: Item, result: Regenerated, endpoint: Endpoint) -> None:
        """Journal an outcome. An endpoint's refusals and empty replies (and conversations cut by a refusal) are
        held back until it keeps a reply; when _SYSTEMIC_REFUSALS of them are held, it is asked a one-line
        question with the run's settings: a refusal or an empty reply to that too stops the run with nothing
        journaled (a rerun after the fix sends them again), a reply says they were the records' own (journaled
        as drops). So at the start of a run and later alike, endpoint by endpoint: a server restarted mid-run
        with other settings (another --served-model-name: HTTP 404, without its tool parser, another API key)
        stops the run instead of dropping the rest of the input, even while other endpoints answer. Requests
        with tools and without are held apart (two lanes of the endpoint): a reply to a plain request does not
        vouch for refusals of requests that carried tools (a vLLM without --tool-call-parser refuses only those)."""
        drop, key = result.drop, self._lane(endpoint, item)
        if result.refused or drop is not None and drop.reason in ("rejected_by_server", "empty_reply"):
            held = self.held.setdefault(key, [])
            held.append((item, result))
            if len(held) >= _SYSTEMIC_REFUSALS and key not in self.probing:
                await self._probe(key, endpoint)
            return
        if drop is None and (self.held.get(key) or key not in self.trusted):
            self._trust(key)
        self._record(item, result)

    def _lane(self, endpoint: Endpoint, item: Item) -> str:
        """The endpoint's URL, and whether the record's tools are sent with its requests."""
        if not self.cfg.send_tools:
            return f"{endpoint.url} "
        return f"{endpoint.url} {'with' if isinstance(item.chat, Chat) and item.chat.tools else 'without'} tools"

    async def _probe(self, key: str, endpoint: Endpoint) -> None:
        """Ask the one-line question (with the tools of a held record when tools are sent) of `endpoint` for the
        lane `key`: trust the lane when it is answered, stop the run when it is refused or answered empty, hold on
        when it cannot be reached."""
        held = list(self.held.get(key, []))
        if not held:
            return
        self.probing.add(key)
        tools = next((it.chat.tools for it, _ in held if isinstance(it.chat, Chat) and it.chat.tools), None)
        try:
            reply = await self._send(endpoint, _PROBE, tools)
        except Rejected as exc:
            same = _why(held[0][1]).startswith(str(exc))
            self._fail(self._systemic(key, endpoint, held, "a one-line question with the same settings was refused too"
                                      + ("" if same else f" ({exc})")))
            return
        except Unavailable:  # cannot tell now: the next held outcome (or the end of the input) asks again
            return
        finally:
            self.probing.discard(key)
        if not reply.content.strip() and not reply.tool_calls and reply.finish_reason in FINISHED:
            self._fail(self._systemic(key, endpoint, held, "a one-line question with the same settings was answered "
                                      f"empty too ({empty_reply(reply, 1, self.keep_thinking)})"))
            return
        self._trust(key)

    def _trust(self, key: str) -> None:
        """The lane answers: the outcomes held for it are the records' own."""
        self.trusted.add(key)
        for item, result in self.held.pop(key, []):
            self._record(item, result)

    def _systemic(self, key: str, endpoint: Endpoint, held: list[tuple[Item, Regenerated]],
                  probe: str) -> RegenerateError:
        n, lane = len(held), key.removeprefix(endpoint.url).rstrip()
        which = (f"the last {n} requests{lane} in a row, after replies had been kept (its settings changed: a restart "
                 f"with another --served-model-name, without its tool parser, with an API key?)"
                 if key in self.trusted else f"every one of the first {n} requests{lane}, before a reply could "
                 f"be kept")
        return RegenerateError(
            f"the server {endpoint.url} refused {which} or answered them empty (first: {_why(held[0][1])}), and "
            f"{probe}: a setting fails them all, not the records (max_tokens beyond the server's context length, "
            f"tools sent to a server without a tool parser, a reasoning parser that files the answer as reasoning, "
            f"an API key, a model name it does not serve): fix it and run again; none of these records was "
            f"journaled, so they are sent again")

    async def _send(self, endpoint: Endpoint, messages: Messages, tools: list[dict[str, Any]] | None) -> Reply:
        """One request; a reply without the server's token count is counted with the target's tokenizer."""
        body = {"model": self.model, "messages": messages, **self.body}
        if tools and self.cfg.send_tools:
            body["tools"] = tools
        reply = await endpoint.chat(body)
        if reply.counted_by == "unknown" and (tok := _counting_tokenizer(self.tokenizer)) is not None:
            reply = replace(reply, tokens=reply_tokens(tok, reply), counted_by="tokenizer")
        return reply

    async def _comes_back(self, endpoint: Endpoint) -> bool:
        """Whether the last live endpoint, which stopped answering, answers GET /models again within
        restart_wait_s (a server restarting); its workers all wait on one poll. Never for local servers."""
        wait = self.cfg.restart_wait_s if self.cfg.endpoints else 0.0
        if wait <= 0 or any(e.alive for e in self.endpoints if e is not endpoint):
            return False
        if endpoint.waiting is None or endpoint.waiting.done() and endpoint.waiting.result():
            log.warning("endpoint %s stopped answering; waiting up to %.0f s for it to answer again (a restart: "
                        "data.regenerate.restart_wait_s)", endpoint.url, wait)
            endpoint.waiting = asyncio.ensure_future(_answers_within(endpoint, wait))
        return await asyncio.shield(endpoint.waiting)

    def _endpoint_down(self, endpoint: Endpoint, exc: Exception | str) -> None:
        if not endpoint.alive:
            return
        endpoint.alive = False
        log.warning("endpoint %s stopped answering (%s); the others take its records", endpoint.url, exc)
        if not any(e.alive for e in self.endpoints):
            names = ", ".join(e.url for e in self.endpoints)
            self._fail(EndpointError(f"every endpoint failed ({names}); last: {exc}. Finished shards and "
                                     f"journaled records are kept: run the same command again to resume"))

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self.idle.set()
        for _ in range(len(self.endpoints) * self.cfg.concurrency + 1):
            self.room.release()  # wake the reader so it sees the failure

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _record(self, item: Item, result: Regenerated) -> None:
        line: dict[str, Any] = {"i": item.index, "source": item.source, **item.extra,
                                "finish": result.finish, "tokens": result.tokens}
        if (counted_by := counting(result.counted_by)) != "server":  # absent: the server's, as in older journals
            line["tokens_counted_by"] = counted_by
        if result.drop is None:
            line["messages"] = result.messages
            if result.cut:
                line["cut"] = result.cut
            if isinstance(item.chat, Chat) and item.chat.tools:
                line["tools"] = item.chat.tools  # tokenize renders them, as the serving prompts will have them
                if not self.cfg.send_tools:
                    line["tools_unsent"] = True  # ... but the replies were written without them
        else:
            line.update(drop=result.drop.reason, detail=result.drop.detail)
        self.journals[item.shard].add(line)
        self.retrying.get(item.shard, set()).discard(item.index)
        self.done += 1
        self.tokens += result.tokens
        self.counted_by |= result.counted_by
        self._maybe_finish(item.shard)
        self._report()

    def _maybe_finish(self, shard: int) -> None:
        """Write the shard once every record has an outcome of this run or a final one of an earlier run."""
        journal = self.journals.get(shard)
        if journal is not None and shard in self.sizes and len(journal.lines) >= self.sizes[shard] \
                and not self.retrying.get(shard) and shard not in self.finished:
            self.finished.add(shard)
            journal.finish()
            # its outcomes are in the shard file now: memory holds the shards in flight only, not the whole output
            del self.journals[shard]
            self.retryable.pop(shard, None)
            self.retrying.pop(shard, None)
            self.locks.pop(shard).close()  # written: a run waiting for it takes it as it is

    def _report(self) -> None:
        now = time.monotonic()
        if self.progress is None or now - self.last_progress < _PROGRESS_EVERY_S:
            return
        self.last_progress = now
        elapsed = max(now - self.start, 1e-9)
        left = self.todo_records - self.resumed - self.done
        self.progress({"records_done": self.done, "records_resumed": self.resumed, "records_total": self.todo_records,
                       "records_read": self.total, "tokens": self.tokens,
                       "tokens_per_s": round(self.tokens / elapsed, 1), "elapsed_s": round(elapsed, 1),
                       "eta_s": round(left * elapsed / self.done) if self.done else None})
