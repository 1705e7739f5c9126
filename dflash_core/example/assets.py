"""The example assets on disk: built once per (version, seed) into a cache folder, atomically, then reused.

Layout of `<home>/example-v1-seed<S>/`: data.jsonl (ShareGPT chats), tokenizer/ (transformers fast tokenizer),
target/ (tiny Qwen3, safetensors, tokenizer files alongside), example.json (build metadata: target losses,
length statistics), done.json (sha256 of every file; written last, so its presence means complete), and
heldout.jsonl: the held-out conversations the target's held-out loss is measured on (the same generator under
another seed), less those whose opening question data.jsonl also asks; the promotion gate evaluates on them.
Caches built before it existed get it on first use: it depends only on the seed and data.jsonl.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_core.errors import InputError
from dflash_core.example.corpus import NUM_CONVERSATIONS, generate_conversations, to_messages
from dflash_core.io import write_jsonl

logger = logging.getLogger(__name__)

VERSION = "v1"
EXAMPLE_URIS = ("example://data", "example://tokenizer", "example://target", "example://heldout")
HELD_OUT_CONVERSATIONS = 200
HELD_OUT_SEED_OFFSET = 1_000_003
ACCURACY_PROMPTS = 16
HELD_OUT_FILE = "heldout.jsonl"
LENGTH_BANDS = ((0, 64), (64, 128), (128, 256), (256, 512), (512, None))


class ExampleError(InputError):
    """A bad example:// URI or an unusable example cache folder."""


@dataclass(frozen=True)
class ExampleAssets:
    """Paths of the built example: data (JSONL file), tokenizer (dir), target (dir), home (the asset folder),
    heldout (JSONL file of conversations not in data)."""

    data: str
    tokenizer: str
    target: str
    home: str
    heldout: str


def default_home() -> Path:
    """$DFLASH_HOME, else ~/.cache/dflash-pipeline."""
    env = os.environ.get("DFLASH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-pipeline"


def asset_dir(home: str | Path | None = None, seed: int = 0, target_steps: int | None = None) -> Path:
    """The versioned folder the assets for this seed (and non-default step count) live in."""
    root = Path(home).expanduser() if home is not None else default_home()
    suffix = "" if target_steps is None else f"-steps{target_steps}"
    return root / f"example-{VERSION}-seed{seed}{suffix}"


def build_example(
    home: str | None = None, seed: int = 0, *, target_steps: int | None = None
) -> ExampleAssets:
    """Build the example assets into home (default: $DFLASH_HOME or ~/.cache/dflash-pipeline), or reuse them."""
    final = asset_dir(home, seed, target_steps)
    if _complete(final):
        return _assets(final, seed)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / f".{final.name}.lock"):
        # Another process may have finished the build while this one waited for the lock.
        if _complete(final):
            return _assets(final, seed)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        tmp.mkdir()
        with _progress_logging():
            logger.info("building example assets in %s (once; later runs reuse them)", final)
            _build_into(tmp, seed, target_steps)
        if final.exists():
            logger.warning("replacing the incomplete or modified example folder %s", final)
            shutil.rmtree(final)
        os.rename(tmp, final)
    return _assets(final, seed)


def resolve_uri(uri: str) -> str:
    """example://data|tokenizer|target -> the built path (building if needed); other strings unchanged."""
    if not uri.startswith("example://"):
        return uri
    if uri not in EXAMPLE_URIS:
        raise ExampleError(f"unknown example asset {uri!r}: use one of {', '.join(EXAMPLE_URIS)}")
    return getattr(build_example(), uri.removeprefix("example://"))


def read_metadata(assets: ExampleAssets) -> dict:
    """The build metadata (example.json): target losses, held-out accuracy, length statistics."""
    return json.loads((Path(assets.home) / "example.json").read_text())


def _assets(folder: Path, seed: int) -> ExampleAssets:
    heldout = folder / HELD_OUT_FILE
    if not heldout.is_file():  # a cache built before heldout.jsonl existed: written once, atomically
        _write_held_out(folder, held_out_conversations(seed))
    return ExampleAssets(
        data=str(folder / "data.jsonl"),
        tokenizer=str(folder / "tokenizer"),
        target=str(folder / "target"),
        home=str(folder),
        heldout=str(heldout),
    )


def held_out_conversations(seed: int) -> list[dict]:
    """The held-out conversations of the example built with `seed` (another seed of the same generator)."""
    return generate_conversations(HELD_OUT_CONVERSATIONS, seed + HELD_OUT_SEED_OFFSET)


def _write_held_out(folder: Path, held_out: list[dict]) -> None:
    """heldout.jsonl: the held-out conversations whose opening question is not asked anywhere in data.jsonl
    (short arithmetic questions can coincide by chance), written under a temporary name then renamed."""
    asked: set[str] = set()
    with open(folder / "data.jsonl") as f:
        for line in f:
            asked.update(t["value"] for t in json.loads(line)["conversations"] if t["from"] == "human")
    fresh = [r for r in held_out
             if next(t["value"] for t in r["conversations"] if t["from"] == "human") not in asked]
    tmp = folder / f".{HELD_OUT_FILE}.tmp-{os.getpid()}"
    write_jsonl(str(tmp), fresh, sort_keys=True)
    os.replace(tmp, folder / HELD_OUT_FILE)


def _build_into(out: Path, seed: int, target_steps: int | None) -> None:
    start = time.perf_counter()
    # Heavy imports only when building, so resolving a cached asset stays cheap.
    from transformers import AutoTokenizer

    from dflash_core.example.target import TrainSettings, build_target
    from dflash_core.example.tokenizer import render, save_tokenizer, train_tokenizer

    records = generate_conversations(NUM_CONVERSATIONS, seed)
    write_jsonl(str(out / "data.jsonl"), records, sort_keys=True)  # sorted keys: bytes depend only on records
    save_tokenizer(train_tokenizer(render(to_messages(r)) for r in records), out / "tokenizer")
    # Load it back through the same path real tokenizers take.
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    settings = (
        TrainSettings(seed=seed) if target_steps is None else TrainSettings(seed=seed, steps=target_steps)
    )
    held_out = held_out_conversations(seed)
    target = build_target(tokenizer, records, held_out, settings, out / "target", ACCURACY_PROMPTS)
    _write_held_out(out, held_out)  # the conversations generated once for the target's held-out loss
    meta = {
        "version": VERSION,
        "seed": seed,
        "conversations": len(records),
        "tokenizer_size": len(tokenizer),
        "train": asdict(settings),
        "target": target,
        "lengths": length_stats(tokenizer, records),
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    (out / "example.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "done.json").write_text(json.dumps({"version": VERSION, "files": _hashes(out)}, indent=2) + "\n")
    logger.info(
        "example assets built in %.0fs: target loss %.3f -> %.3f, held-out assistant loss %.3f",
        meta["build_seconds"],
        target["initial_loss"],
        target["final_loss"],
        target["held_out_assistant_loss"],
    )


def length_stats(tokenizer, records: list[dict]) -> dict:
    """Rendered-chat token lengths: median, p90, max and the share of conversations per length band."""
    texts = [tokenizer.apply_chat_template(to_messages(r), tokenize=False) for r in records]
    lengths = sorted(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    n = len(lengths)
    bands = {
        f"{lo}-{hi if hi is not None else 'max'}": sum(lo <= x < (hi or x + 1) for x in lengths) / n
        for lo, hi in LENGTH_BANDS
    }
    return {
        "median": statistics.median(lengths),
        "p90": lengths[int(0.9 * (n - 1))],
        "max": lengths[-1],
        "mean": sum(lengths) / n,
        "bands": bands,
    }


def _hashes(folder: Path) -> dict[str, str]:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "done.json")
    return {str(p.relative_to(folder)): _sha256(p) for p in files}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _complete(folder: Path) -> bool:
    """True when done.json exists and every file it lists is present with the same sha256."""
    marker = folder / "done.json"
    if not marker.is_file():
        return False
    try:
        expected = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        return False
    return all(
        (folder / rel).is_file() and _sha256(folder / rel) == digest for rel, digest in expected.items()
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock, so concurrent processes build the assets only once."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress_logging() -> Iterator[None]:
    """Show build progress on stderr when nobody configured logging (a build takes a minute or two)."""
    package = logging.getLogger("dflash_core.example")
    if logging.getLogger().handlers or package.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    level = package.level
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(level)
