"""Tokenize stage: assistant-only masks on several chat templates, formats, URIs, length policy, determinism."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from common.chat import (
    TEMPLATES,
    TRICKY,
    conversations,
    data_config,
    to_sharegpt,
    tokenizer_dir,
    write_jsonl,
)
from transformers import AutoTokenizer

from dflash_core.data.errors import TemplateError
from dflash_core.data.fingerprint import input_fingerprint
from dflash_core.data.shards import ShardReader, read_index, read_manifest
from dflash_core.data.tokenize import tokenize_dataset


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2], strict=True))


def _tokenize(tmp: Path, records: list, template: str = "chatml", name: str = "data.jsonl", **cfg) -> dict:
    data = write_jsonl(tmp / name, records)
    return tokenize_dataset(str(data), tokenizer_dir(template), str(tmp / "out"), data_config(**cfg), block_size=2)


@pytest.mark.parametrize("template", ["chatml", "gemma"])
def test_masked_tokens_decode_to_exactly_the_assistant_turns(tmp_path: Path, template: str) -> None:
    convs = TRICKY + conversations(30, seed=1, system=True)
    summary = _tokenize(tmp_path, [to_sharegpt(c, i) for i, c in enumerate(convs)], template)
    assert summary["kept"] == len(convs) and summary["dropped"] == {}
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(template))
    eot = TEMPLATES[template][1]
    reader = ShardReader(str(tmp_path / "out"))
    for sid, conv in enumerate(convs):
        ids, mask = reader.rows([sid])[0]
        assert ids.dtype == np.int32 and mask.dtype == np.uint8
        assert ids.tolist() == tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        got = [tok.decode(ids[a:b]) for a, b in _runs(mask)]
        contents = [m["content"] if template == "chatml" else m["content"].strip()
                    for m in conv if m["role"] == "assistant"]
        assert got == [c + eot for c in contents]


THINK = ("{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}{% set c = m['content'] %}"
         "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c %}"
         "{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}<|im_start|>{{ m['role'] }}\n{{ c }}<|im_end|>\n"
         "{% endfor %}")


def test_template_that_rewrites_contents_masks_what_it_renders(tmp_path: Path) -> None:
    """Qwen3-like: reasoning is cut from earlier assistant turns; the mask follows the rendered text. The template
    does not read reasoning_content, so with thinking kept the reasoning goes back inline as a <think> block."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    tok.chat_template = THINK
    tok.save_pretrained(tmp_path / "tok")
    convs = conversations(8, seed=9, system=False)
    for conv in convs:
        for m in conv:
            if m["role"] == "assistant":
                m["content"] = f"<think>\nwhy the model {m['content'][:20]}\n</think>\n\n{m['content']}"
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": c} for c in convs])
    summary = tokenize_dataset(str(data), str(tmp_path / "tok"), str(tmp_path / "out"),
                               data_config(thinking="keep"), block_size=2)
    assert summary["kept"] == len(convs)
    reader = ShardReader(str(tmp_path / "out"))
    for sid, conv in enumerate(convs):
        ids, mask = reader.rows([sid])[0]
        assert ids.tolist() == tok.apply_chat_template(conv, tokenize=True, return_dict=False)
        last_user = max(i for i, m in enumerate(conv) if m["role"] == "user")
        want = [(m["content"].split("</think>")[-1].lstrip() if i < last_user else m["content"]) + "<|im_end|>"
                for i, m in enumerate(conv) if m["role"] == "assistant"]
        assert [tok.decode(ids[a:b]) for a, b in _runs(mask)] == want


def test_system_turn_the_template_drops_is_reported_not_lost(tmp_path: Path) -> None:
    """A template that leaves system text out: by default (system_turn auto) the system prompt is folded into the
    first user turn; kept as a turn of its own, the record is dropped, saying how to fix it."""
    convs = conversations(6, seed=2, system=False)
    convs[3] = [{"role": "system", "content": "Be brief."}, *convs[3]]
    records = [to_sharegpt(c, i) for i, c in enumerate(convs)]
    assert _tokenize(tmp_path, records, "llama2")["kept"] == 6
    ids, _ = ShardReader(str(tmp_path / "out")).rows([3])[0]
    text = AutoTokenizer.from_pretrained(tokenizer_dir("llama2")).decode(ids)
    assert f"[INST] Be brief.\n\n{convs[3][1]['content']} [/INST]" in text
    assert read_manifest(str(tmp_path / "out"))["tokenizer"]["system_turn"] == "merged into the first user turn"
    summary = _tokenize(tmp_path, records, "llama2", max_bad_fraction=0.5, system_turn="keep")
    assert summary["kept"] == 5 and summary["dropped"] == {"turn_dropped_by_template": 1}
    example = read_manifest(str(tmp_path / "out"))["drop_examples"]["turn_dropped_by_template"][0]
    assert example["line"] == 4 and example["id"] == "c3" and "role_map" in example["detail"]
    # mapped to a role the template renders, the record is kept (Llama-2 masks include ' </s>')
    summary = _tokenize(tmp_path, [to_sharegpt(c, i) for i, c in enumerate(convs)], "llama2",
                        role_map={"system": "user"}, system_turn="keep")
    assert summary["kept"] == 6


def test_roles_unknown_to_the_defaults_are_mapped_by_role_map(tmp_path: Path) -> None:
    rec = {"messages": [{"role": "narrator", "content": "Once upon a time."},
                        {"role": "user", "content": "Go on."},
                        {"role": "bot", "content": "They lived happily ever after, said the model."}]}
    assert _tokenize(tmp_path, [rec], max_bad_fraction=1.0)["dropped"] == {"unknown_role": 1}
    summary = _tokenize(tmp_path, [rec], role_map={"narrator": "system", "bot": "assistant"})
    assert summary["kept"] == 1


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [to_sharegpt(conversations(1)[0], 0)])
    with pytest.raises(TemplateError, match="no chat template") as err:
        tokenize_dataset(str(data), tokenizer_dir("none"), str(tmp_path / "out"), data_config(), block_size=2)
    assert tokenizer_dir("none") in str(err.value)


def test_every_format_in_a_folder_is_read_in_name_order(tmp_path: Path) -> None:
    convs = conversations(12, seed=3)
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", [to_sharegpt(c, i) for i, c in enumerate(convs[:3])])
    write_jsonl(src / "b.jsonl.gz", [{"messages": c} for c in convs[3:6]], gz=True)
    (src / "c.json").write_text(json.dumps([{"conversation": c} for c in convs[6:9]], indent=2))
    table = pa.table({"id": [9, 10, 11], "messages": convs[9:12]})
    pq.write_table(table, src / "d.parquet")
    (src / "notes.txt").write_text("not data")
    out = tmp_path / "out"
    summary = tokenize_dataset(str(src), tokenizer_dir("chatml"), str(out), data_config(), block_size=2)
    assert summary["read"] == summary["kept"] == 12
    sources = read_manifest(str(out))["sources"]
    assert [(s["file"], s["format"], s["messages_key"]) for s in sources] == [
        ("a.jsonl", "sharegpt", "conversations"), ("b.jsonl.gz", "openai", "messages"),
        ("c.json", "openai", "conversation"), ("d.parquet", "openai", "messages")]
    parts = pl.read_parquet(out / "part-00000.parquet")
    assert parts["sample_id"].to_list() == list(range(12))
    assert parts["source"].to_list() == ["a.jsonl"] * 3 + ["b.jsonl.gz"] * 3 + ["c.json"] * 3 + ["d.parquet"] * 3
    assert parts["record"].to_list() == [0, 1, 2] * 4
    assert parts["line"].to_list()[:7] == [1, 2, 3, 1, 2, 3, 2] and parts["line"][9] is None
    assert parts["record_id"].to_list()[-3:] == ["9", "10", "11"]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    for sid, conv in enumerate(convs):  # the same conversation gives the same tokens in every format
        assert parts["input_ids"][sid].to_list() == tok.apply_chat_template(conv, tokenize=True, return_dict=False)
    glob = tokenize_dataset(str(src / "*.json*"), tokenizer_dir("chatml"), str(tmp_path / "g"), data_config(),
                            block_size=2)
    assert glob["kept"] == 9


def test_output_inside_the_source_folder_is_not_read_back(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [to_sharegpt(c, i) for i, c in enumerate(conversations(3))])
    for _ in range(2):
        summary = tokenize_dataset(str(tmp_path), tokenizer_dir("chatml"), str(tmp_path / "out"), data_config(),
                                   block_size=2)
        assert summary["read"] == summary["kept"] == 3


def test_format_override_refuses_records_of_the_other_schema(tmp_path: Path) -> None:
    records = [{"messages": c} for c in conversations(4, seed=4)]
    summary = _tokenize(tmp_path, records, format="sharegpt", max_bad_fraction=1.0)
    assert summary["dropped"] == {"wrong_schema": 4}
    assert _tokenize(tmp_path, records, format="openai", messages_key="messages")["kept"] == 4


def test_memory_uri_in_and_out(tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    records = [to_sharegpt(c, i) for i, c in enumerate(conversations(5, seed=5))]
    with fs.open("/chat-in/part.jsonl", "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records))
    try:
        summary = tokenize_dataset("memory://chat-in", tokenizer_dir("chatml"), "memory://tok-out", data_config(),
                                   block_size=2)
        assert summary["kept"] == 5
        assert read_index("memory://tok-out")["sample_id"].to_list() == list(range(5))
        ids, mask = ShardReader("memory://tok-out").rows([4])[0]
        assert len(ids) == len(mask) and mask.sum() > 0
    finally:
        fs.rm("/chat-in", recursive=True)
        fs.rm("/tok-out", recursive=True)


def test_overlong_conversations_are_cut_at_a_turn_end_or_dropped(tmp_path: Path) -> None:
    conv = conversations(1, seed=6)[0]
    conv = [m for m in conv if m["role"] != "system"]
    long = conv + conv + conv  # 3-12 exchanges
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    full = tok.apply_chat_template(long, tokenize=True, return_dict=False)
    first = tok.apply_chat_template(long[:2], tokenize=True, return_dict=False)
    limit = len(full) - 1
    summary = _tokenize(tmp_path, [{"messages": long}], max_length=limit)
    assert summary["kept"] == 1
    ids, mask = ShardReader(str(tmp_path / "out")).rows([0])[0]
    assert len(ids) <= limit and tok.decode(ids[-1:]) == "<|im_end|>" and mask[-1] == 1
    assert read_manifest(str(tmp_path / "out"))["truncated"] == {"turn_boundary": 1, "mid_turn": 0}
    summary = _tokenize(tmp_path, [{"messages": long}], max_length=len(first) - 3)  # not even one turn fits
    assert summary["kept"] == 1 and len(ShardReader(str(tmp_path / "out")).rows([0])[0][0]) == len(first) - 3
    summary = _tokenize(tmp_path, [{"messages": long}], max_length=limit, overlong="drop")
    assert summary["dropped"] == {"too_long": 1}


def test_samples_with_too_little_supervision_are_dropped_but_not_bad(tmp_path: Path) -> None:
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    records = [short] + [{"messages": c} for c in conversations(3, seed=7)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    summary = tokenize_dataset(str(data), tokenizer_dir("chatml"), str(tmp_path / "out"), data_config(),
                               block_size=4)  # policy drops never trip max_bad_fraction (25% here)
    assert summary["dropped"] == {"too_few_supervised": 1} and summary["kept"] == 3
    index = read_index(str(tmp_path / "out"))
    assert (index["n_loss_tokens"] >= 8).all()
    assert summary["supervised_tokens"] == index["n_loss_tokens"].sum()
    assert summary["tokens"] == index["length"].sum()


def _folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.slow  # starts process pools of several sizes: ~15 s
def test_same_input_gives_byte_identical_output_with_any_process_count(tmp_path: Path) -> None:
    records = [to_sharegpt(c, i) for i, c in enumerate(conversations(40, seed=8))] + ["junk"]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    outs = []
    for n, num_proc in enumerate((1, 1, 2)):
        cfg = data_config(num_proc=num_proc, batch_size=8, rows_per_part=16, rows_per_group=5, max_bad_fraction=0.1)
        tokenize_dataset(str(data), tokenizer_dir("chatml"), str(tmp_path / f"o{n}"), cfg, block_size=2)
        outs.append(_folder_bytes(tmp_path / f"o{n}"))
    assert sorted(outs[0]) == [".dflash-stage.json", "index.parquet", "manifest.json", "part-00000.parquet",
                               "part-00001.parquet", "part-00002.parquet"]
    assert outs[0] == outs[1] == outs[2]


def test_fingerprint_covers_data_tokenizer_and_parameters(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [to_sharegpt(c, i) for i, c in enumerate(conversations(3))])
    tok = tokenizer_dir("chatml")
    summary = tokenize_dataset(str(data), tok, str(tmp_path / "out"), data_config(), block_size=2)
    fp = input_fingerprint(str(data), tok, data_config(), 2)
    assert summary["fingerprint"] == fp == read_manifest(str(tmp_path / "out"))["fingerprint"]
    assert ShardReader(str(tmp_path / "out")).fingerprint == fp
    assert input_fingerprint(str(data), tok, data_config(num_proc=4, batch_size=3), 2) == fp
    assert input_fingerprint(str(data), tok, data_config(max_length=100), 2) != fp
    assert input_fingerprint(str(data), tok, data_config(), 4) != fp
    assert input_fingerprint(str(data), tokenizer_dir("gemma"), data_config(), 2) != fp
    write_jsonl(data, [to_sharegpt(c, i) for i, c in enumerate(conversations(3, seed=1))])
    assert input_fingerprint(str(data), tok, data_config(), 2) != fp


def test_a_tokenizers_named_chat_templates_are_part_of_its_fingerprint(tmp_path: Path) -> None:
    """transformers keeps a tokenizer's named templates in additional_chat_templates/ and renders a record with
    tools by the one named "tool_use": a fix to it must tokenize the data again, not reuse the old tokens."""
    from dflash_core.data.fingerprint import tokenizer_digest

    folder = tmp_path / "tok"
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("chatml"))
    tok.chat_template = {"default": tok.chat_template, "tool_use": tok.chat_template + "{{ '' }}"}
    tok.save_pretrained(folder)
    assert (folder / "additional_chat_templates" / "tool_use.jinja").is_file()  # where transformers puts it
    digest = tokenizer_digest(str(folder))
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert tokenizer_digest(str(folder)) != digest


def test_the_model_type_a_tokenizer_is_loaded_as_is_part_of_its_fingerprint(tmp_path: Path) -> None:
    """A tokenizer_config.json naming transformers 5's generic TokenizersBackend is loaded as the class of the
    config.json beside it (Qwen2Tokenizer beside a qwen2 config): the same files beside another model type are
    another tokenizer, so their tokens are not reused."""
    from dflash_core.data.fingerprint import tokenizer_digest

    folder = tmp_path / "tok"
    AutoTokenizer.from_pretrained(tokenizer_dir("chatml")).save_pretrained(folder)
    alone = tokenizer_digest(str(folder))
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    as_qwen2 = tokenizer_digest(str(folder))
    assert type(AutoTokenizer.from_pretrained(folder)).__name__ == "Qwen2Tokenizer" and as_qwen2 != alone
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 16}))
    assert tokenizer_digest(str(folder)) == as_qwen2  # the rest of the model's config does not tokenize
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    assert tokenizer_digest(str(folder)) != as_qwen2
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert tokenizer_digest("org/model", AutoTokenizer.from_pretrained(folder)) != tokenizer_digest(
        "org/model", AutoTokenizer.from_pretrained(tokenizer_dir("chatml")))  # by hub id: the class loaded counts


def test_a_config_json_beside_a_tokenizer_that_names_no_model_type_fingerprints_as_none(tmp_path: Path) -> None:
    """A config.json that is no JSON object (a damaged file, a list) names no model type: the digest is the one
    without it, not a JSONDecodeError or AttributeError from hashing the tokenizer."""
    from dflash_core.data.fingerprint import tokenizer_digest

    folder = tmp_path / "tok"
    AutoTokenizer.from_pretrained(tokenizer_dir("chatml")).save_pretrained(folder)
    alone = tokenizer_digest(str(folder))
    for text in ("{not json", "[1, 2]"):
        (folder / "config.json").write_text(text)
        assert tokenizer_digest(str(folder)) == alone, text


def test_a_tokenizer_named_by_hub_id_is_fingerprinted_by_what_it_loads(tmp_path: Path) -> None:
    """A hub id has no local files to hash: the digest is over the loaded tokenizer (its vocabulary and merges, its
    chat template, its special tokens), the same for the same tokenizer loaded again, another when the template or
    a special token changes, so a nightly run on `Qwen/Qwen3-8B` tokenizes again after an upstream template fix."""
    from dflash_core.data.fingerprint import tokenizer_digest

    folder = tokenizer_dir("chatml")
    digest = tokenizer_digest("org/model", AutoTokenizer.from_pretrained(folder))
    assert tokenizer_digest("org/model", AutoTokenizer.from_pretrained(folder)) == digest
    assert digest != tokenizer_digest(folder)  # a local folder is hashed by its files instead
    retemplated = AutoTokenizer.from_pretrained(folder)
    retemplated.chat_template += "{{ '' }}"
    assert tokenizer_digest("org/model", retemplated) != digest
    special = AutoTokenizer.from_pretrained(folder)
    special.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert tokenizer_digest("org/model", special) != digest


def test_a_target_named_by_hub_id_is_known_by_its_cached_snapshot(tmp_path: Path, monkeypatch) -> None:
    """A target given by hub id is told apart by the commit of the snapshot in the local Hugging Face cache (a new
    upstream version, once downloaded, regenerates its replies again); an id not in the cache by the id alone."""
    import huggingface_hub.constants

    from dflash_core.data.fingerprint import model_digest

    repo = tmp_path / "models--org--model"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    (repo / "refs" / "main").write_text("a" * 40)
    assert model_digest("org/model") == f"hub commit {'a' * 40}"
    (repo / "refs" / "main").write_text("b" * 40)
    assert model_digest("org/model") == f"hub commit {'b' * 40}"
    assert model_digest("org/other") is None and model_digest(None) is None


def test_progress_reports_records_tokens_rate_and_eta(tmp_path: Path) -> None:
    calls: list[dict] = []
    data = write_jsonl(tmp_path / "d.jsonl", [to_sharegpt(c, i) for i, c in enumerate(conversations(5))])
    summary = tokenize_dataset(str(data), tokenizer_dir("chatml"), str(tmp_path / "out"), data_config(),
                               block_size=2, progress=calls.append)
    last = calls[-1]
    assert last["records"] == summary["read"] and last["tokens"] == summary["tokens"]
    assert last["fraction"] == 1.0 and last["eta_s"] == 0.0 and last["tokens_per_s"] > 0


def test_example_tokenizer_masks_assistant_turns(tmp_path: Path) -> None:
    example_tok = pytest.importorskip("dflash_core.example.tokenizer")
    corpus = pytest.importorskip("dflash_core.example.corpus")
    if not all(hasattr(example_tok, f) for f in ("train_tokenizer", "save_tokenizer")) or not hasattr(
            corpus, "generate_conversations") or not hasattr(corpus, "to_messages"):
        pytest.skip("example tokenizer API not there yet")
    records = corpus.generate_conversations(20, seed=0)
    convs = [corpus.to_messages(r) for r in records]
    tok = example_tok.train_tokenizer(m["content"] for c in convs for m in c)
    example_tok.save_tokenizer(tok, tmp_path / "tok")
    data = write_jsonl(tmp_path / "d.jsonl", records)
    summary = tokenize_dataset(str(data), str(tmp_path / "tok"), str(tmp_path / "out"), data_config(),
                               block_size=1)
    reader = ShardReader(str(tmp_path / "out"))
    kept = [c for c in convs if sum(len(m["content"]) for m in c if m["role"] == "assistant") > 0]
    assert summary["kept"] == len(kept)
    eot = read_manifest(str(tmp_path / "out"))["tokenizer"]["end_of_turn"]
    for sid, conv in enumerate(kept):
        ids, mask = reader.rows([sid])[0]
        got = [tok.decode(ids[a:b]) for a, b in _runs(mask)]
        assert got == [m["content"] + eot for m in conv if m["role"] == "assistant"]


def test_on_an_object_store_the_fingerprint_uses_its_checksums_and_downloads_nothing(tmp_path: Path) -> None:
    """A bucket's files are fingerprinted by the checksum the store keeps (S3 ETag, GCS md5Hash, ...): a nightly
    run over a large bucket reads no byte to find out whether anything changed; new content changes it. Local
    files, which have no such checksum, are hashed as before."""
    import hashlib

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from dflash_core.data.sources import list_files

    class ETagStore(MemoryFileSystem):
        """An in-memory object store that reports an S3-style ETag (the MD5 of a single-part upload)."""

        protocol = ("etagstore",)
        store: dict = {}
        pseudo_dirs = [""]
        opened: list[str] = []

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).replace("etagstore://", "memory://", 1))

        def info(self, path, **kwargs):
            out = super().info(path, **kwargs)
            if out["type"] == "file":
                out["ETag"] = f'"{hashlib.md5(self.store[self._strip_protocol(path)].getvalue()).hexdigest()}"'
            return out

        def _open(self, path, mode="rb", **kwargs):
            type(self).opened.append(path)
            return super()._open(path, mode, **kwargs)

    fsspec.register_implementation("etagstore", ETagStore, clobber=True)
    records = [to_sharegpt(c, i) for i, c in enumerate(conversations(3))]
    body = "".join(json.dumps(r) + "\n" for r in records).encode()
    fsspec.filesystem("etagstore").pipe("/bucket/chats/d.jsonl", body)
    ETagStore.opened.clear()
    tok, uri = tokenizer_dir("chatml"), "etagstore://bucket/chats/"
    (file,) = list_files(uri)
    assert file.checksum == f"ETag:{hashlib.md5(body).hexdigest()}"
    fp = input_fingerprint(uri, tok, data_config(), 2)
    assert ETagStore.opened == [] and input_fingerprint(uri, tok, data_config(), 2) == fp
    fsspec.filesystem("etagstore").pipe("/bucket/chats/d.jsonl", body + body.splitlines(keepends=True)[0])
    ETagStore.opened.clear()
    assert input_fingerprint(uri, tok, data_config(), 2) != fp and ETagStore.opened == []
    local = write_jsonl(tmp_path / "d.jsonl", records)
    assert list_files(str(local))[0].checksum is None  # a local disk's files are hashed
    summary = tokenize_dataset(uri, tok, str(tmp_path / "out"), data_config(), block_size=2)
    assert summary["read"] == 4 and ETagStore.opened  # tokenizing reads the bytes, of course


@pytest.mark.parametrize(("info", "expected"), [
    ({"ETag": '"9b2cf535f27731c974343645a3985328"', "LastModified": "x"}, "ETag:9b2cf535f27731c974343645a3985328"),
    ({"ETag": '"e1"', "ChecksumSHA256": "q1"}, "ChecksumSHA256:q1"),  # S3 with an additional checksum
    ({"md5Hash": "rL0Y20zC+Fzt72VPzMSk2A==", "crc32c": "AAAAAA==", "etag": "CMf"}, "md5Hash:rL0Y20zC+Fzt72VPzMSk2A=="),
    ({"crc32c": "AAAAAA==", "etag": "CMf"}, "crc32c:AAAAAA=="),  # a composite GCS object has no md5Hash
    ({"content_settings": {"content_md5": bytearray(b"\x01\xff")}, "etag": '"0x8DB"'}, "content_md5:01ff"),
    ({"content_settings": {"content_md5": None}, "etag": '"0x8DB"'}, "etag:0x8DB"),  # Azure, block upload
    ({"size": 10, "mtime": 1.0, "type": "file"}, None),  # a local disk: hashed
])
def test_the_stored_checksum_of_each_object_store(info: dict, expected: str | None) -> None:
    from dflash_core.data.sources import stored_checksum

    assert stored_checksum(info) == expected


def _split_files(root: Path, names: list[str]) -> None:
    """A parquet file of three chats at each relative name under root."""
    for k, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"messages": conversations(3, seed=k)}), root / name)


def test_a_folder_of_several_splits_is_refused_naming_each_split_and_how_to_read_it(tmp_path: Path) -> None:
    """A hub snapshot (huggingface-cli download HuggingFaceH4/ultrachat_200k) or a save_to_disk DatasetDict given
    as the source was read whole, test split first, without a word: held-out prompts went into training. It is
    refused; the error names the splits and the folder, glob or file that reads one. One split's shards are read."""
    from dflash_core.data.errors import DataError
    from dflash_core.data.sources import list_files

    hub = tmp_path / "ultrachat_200k"
    _split_files(hub, [f"data/{s}-0000{k}-of-00002-abc.parquet" for s in ("test_gen", "test_sft", "train_gen",
                                                                         "train_sft") for k in (0, 1)])
    with pytest.raises(DataError) as hub_error:
        tokenize_dataset(str(hub), tokenizer_dir("chatml"), str(tmp_path / "out"), data_config(), block_size=2)
    message = str(hub_error.value)
    assert message.startswith(f"{hub}: ") and "test_gen, test_sft, train_gen, train_sft" in message
    assert f"train_sft: {hub}/data/train_sft-*" in message and "held-out" in message
    assert len(list_files(f"{hub}/data/train_sft-*")) == 2  # what the error says to give reads that split

    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict({split: datasets.Dataset.from_list([{"messages": c} for c in conversations(3, seed=k)])
                          for k, split in enumerate(["train", "test"])}).save_to_disk(str(saved))
    with pytest.raises(DataError, match=rf"DatasetDict.*test, train;.*train: {saved}/train"):
        list_files(str(saved))
    assert [f.name for f in list_files(str(saved / "train"))] == ["data-00000-of-00001.arrow"]

    files = tmp_path / "files"  # test.jsonl beside train.jsonl: the file itself is what to give
    _split_files(files, ["test.parquet", "train.parquet", "validation.parquet"])
    with pytest.raises(DataError, match=rf"train: {files}/train.parquet; validation: {files}/validation.parquet"):
        list_files(str(files))

    shards = tmp_path / "shards"  # one split's shards, or shards named by nothing: an ordinary folder
    _split_files(shards, [f"train-0000{k}-of-00004.parquet" for k in range(4)] + ["extra/part-00000.parquet"])
    assert len(list_files(str(shards))) == 5
    _split_files(tmp_path / "parts", ["part-00000.parquet", "part-00001.parquet", "trainer/part-00002.parquet"])
    assert len(list_files(str(tmp_path / "parts"))) == 3


@pytest.mark.parametrize(("names", "held_out"), [
    (["train.jsonl", "train_extra.jsonl"], None),  # training splits only: an ordinary folder
    (["train_en.jsonl", "train_fr.jsonl"], None),
    (["train_a.jsonl", "train_b.jsonl"], None),
    (["data/train_sft-00000-of-00001.parquet", "data/train_gen-00000-of-00001.parquet"], None),
    (["test.jsonl"], None),  # one split, held-out or not, is what was given
    (["train.jsonl", "test.jsonl"], "test"),
    (["train_en.jsonl", "dev_en.jsonl"], "dev_en"),
    (["data/train-00000-of-00002.parquet", "data/validation-00000-of-00001.parquet"], "validation"),
    (["train_extra.jsonl", "val.jsonl"], "val"),
], ids=lambda v: "+".join(v) if isinstance(v, list) else f"held_out={v}")
def test_a_folder_is_refused_only_when_a_held_out_split_lies_beside_another(
        tmp_path: Path, names: list[str], held_out: str | None) -> None:
    """train.jsonl beside train_extra.jsonl (or train_en beside train_fr) was refused as several splits whose
    held-out ones would be trained on, though none is held out. Only a test/validation/val/dev split beside
    data of another split is refused, and the error names it."""
    from dflash_core.data.errors import DataError
    from dflash_core.data.sources import list_files

    _split_files(tmp_path / "d", [n for n in names if n.endswith(".parquet")])
    for k, name in enumerate(n for n in names if n.endswith(".jsonl")):
        write_jsonl(tmp_path / "d" / name, [to_sharegpt(c, i) for i, c in enumerate(conversations(2, seed=k))])
    if held_out is None:
        assert len(list_files(str(tmp_path / "d"))) == len(names)
    else:
        with pytest.raises(DataError, match=rf"held-out ones \({held_out}\) included"):
            list_files(str(tmp_path / "d"))


@pytest.mark.parametrize(("splits", "refused"), [
    (["train"], False),  # what load_dataset(...).save_to_disk(d) writes for most datasets
    (["train", "train_extra"], False),
    (["train", "test"], True),
    (["train", "validation"], True),
    (["dev", "train_sft"], True),
], ids=lambda v: "+".join(v) if isinstance(v, list) else f"refused={v}")
def test_a_dataset_dict_is_refused_only_when_it_holds_a_held_out_split_beside_another(
        tmp_path: Path, splits: list[str], refused: bool) -> None:
    """A save_to_disk DatasetDict of a train split alone was refused as a folder of several splits. Its folders
    are its splits: read whole unless one is held out and another is there too."""
    datasets = pytest.importorskip("datasets")
    from dflash_core.data.errors import DataError
    from dflash_core.data.sources import list_files

    saved = tmp_path / "saved"
    datasets.DatasetDict({split: datasets.Dataset.from_list([{"messages": c} for c in conversations(3, seed=k)])
                          for k, split in enumerate(splits)}).save_to_disk(str(saved))
    if refused:
        with pytest.raises(DataError, match=rf"DatasetDict.*{', '.join(sorted(splits))};.*held-out"):
            list_files(str(saved))
    else:
        files = list_files(str(saved))
        assert sorted(f.name for f in files) == [f"{s}/data-00000-of-00001.arrow" for s in sorted(splits)]
        summary = tokenize_dataset(str(saved), tokenizer_dir("chatml"), str(tmp_path / "out"), data_config(),
                                   block_size=2)
        assert summary["kept"] == 3 * len(splits)


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.zstd"])
def test_zstd_compressed_json_lines_are_read_as_a_file_and_in_a_folder(tmp_path: Path, suffix: str) -> None:
    """A .jsonl.zst given as the source was read as raw bytes (every record bad_utf8, the user told to fix
    them), and in a folder it was skipped without a word. Both read like .jsonl.gz, frames written one after
    another (pzstd) included."""
    import zstandard  # a dependency: fsspec reads .zst only with it

    records = [to_sharegpt(c, i) for i, c in enumerate(conversations(6, seed=5))]
    lines = [json.dumps(r).encode() + b"\n" for r in records]
    src = tmp_path / "src"
    src.mkdir()
    compress = zstandard.ZstdCompressor().compress
    (src / f"chats{suffix}").write_bytes(compress(b"".join(lines[:4])) + compress(b"".join(lines[4:])))
    write_jsonl(tmp_path / "plain.jsonl", records)
    plain = tokenize_dataset(str(tmp_path / "plain.jsonl"), tokenizer_dir("chatml"), str(tmp_path / "p"),
                             data_config(), block_size=2)
    for source in (src / f"chats{suffix}", src):
        out = tmp_path / f"out-{source.name}"
        summary = tokenize_dataset(str(source), tokenizer_dir("chatml"), str(out), data_config(), block_size=2)
        assert summary["read"] == summary["kept"] == 6 and summary["dropped"] == {}, summary
        assert [s["file"] for s in read_manifest(str(out))["sources"]] == [f"chats{suffix}"]
        assert summary["tokens"] == plain["tokens"]


def test_the_last_resort_search_places_each_text_after_the_previous_one():
    """When even the skeleton (contents replaced by markers) fails to render, each slot's text is searched for in
    order after the previous one, stripped when the template trimmed it; a reply that cannot be found is no
    placement at all (the record is a template_mismatch), a prompt or reasoning text that cannot be is skipped."""
    from dflash_core.data.template import _searched_spans

    messages = [{"role": "user", "content": "ok"}, {"role": "assistant", "content": " ok \n", "reasoning_content": "r"},
                {"role": "user", "content": "gone"}, {"role": "assistant", "content": "fine"}]
    slots = [(0, "content"), (1, "reasoning_content"), (1, "content"), (2, "content"), (3, "content")]
    text = "U: ok\nA: ok\nA: fine"  # the reply " ok \n" rendered trimmed; reasoning and the second prompt dropped
    assert _searched_spans(messages, slots, text) == {0: (3, 5), 2: (9, 11), 4: (15, 19)}
    assert _searched_spans(messages, slots, text.replace("fine", "good")) is None  # a reply not in the text
    assert _searched_spans(messages, slots[:3], "A: ok\nU: ok") == {0: (3, 5), 2: (9, 11)}  # never before the last


def test_the_offsets_fallback_masks_exactly_the_tokens_inside_the_assistant_spans():
    """A span border on a character no token holds (here a space a whitespace pre-tokenizer drops; in practice a
    normalizer) sends `_masked` to the offsets path. Token borders at the span borders: the token ending where a
    span starts and the one starting where it ends are outside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from dflash_core.data.template import _masked

    words = ["q1", "q2", "a1", "a2", "q3", "a3"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)} | {"[UNK]": 6}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    enc = tok.encode("q1 q2 a1 a2 q3 a3")  # tokens at chars 0-2, 3-5, 6-8, 9-11, 12-14, 15-17
    assert enc.char_to_token(5) is None  # the border character has no token: the offsets decide
    out = _masked(enc, [(5, 12), (14, 17)])  # " a1 a2 " and " a3"
    assert out.mask.tolist() == [0, 0, 1, 1, 0, 1]
    assert out.turn_ends.tolist() == [4, 6]  # the token index after each span, as the char_to_token path gives
    # an empty slot (an assistant turn the template rendered nothing of) inside a token trains nothing and ends no
    # turn, as on the char_to_token path: before, "q3" around it was supervised and a third turn end was added
    with_empty = _masked(enc, [(5, 12), (13, 13), (14, 17)])
    assert (with_empty.mask.tolist(), with_empty.turn_ends.tolist()) == ([0, 0, 1, 1, 0, 1], [4, 6])
    assert _masked(enc, [(6, 11), (13, 13), (15, 17)]).mask.tolist() == [0, 0, 1, 1, 0, 1]  # char_to_token path
