"""The built-in example: tokenizer, chat data and tiny target, as the other stages and users will load them."""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_core.example import EXAMPLE_URIS, ExampleError, build_example, read_metadata, resolve_uri
from dflash_core.example.assets import _assets
from dflash_core.example.corpus import generate_conversations, read_jsonl, to_messages
from dflash_core.example.target import TrainSettings, evaluate_loss, train_target
from dflash_core.example.tokenizer import render, save_tokenizer, train_tokenizer
from dflash_core.io import write_jsonl

CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Reverse this list: 3 17 42"},
    {"role": "assistant", "content": "The list was 3 17 42. In reverse order it is: 42 17 3."},
    {"role": "user", "content": "Now sort it."},
    {"role": "assistant", "content": "Sorting the list I just wrote gives: 3 17 42."},
]


@pytest.fixture(scope="module")
def tokenizer(example_assets):
    return AutoTokenizer.from_pretrained(example_assets.tokenizer)


@pytest.fixture(scope="module")
def target(example_assets):
    return AutoModelForCausalLM.from_pretrained(example_assets.target).eval()


@pytest.fixture(scope="module")
def lengths(example_assets, tokenizer) -> np.ndarray:
    records = read_jsonl(example_assets.data)
    texts = [tokenizer.apply_chat_template(to_messages(r), tokenize=False) for r in records]
    return np.array([len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]])


def test_chat_template_round_trips_a_multi_turn_chat(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert text == render(CHAT)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_has_end_of_turn_mask_and_pad_tokens(tokenizer, target):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.mask_token == "<|mask|>"
    ids = {
        tokenizer.convert_tokens_to_ids(t)
        for t in ("<|im_start|>", "<|im_end|>", "<|mask|>", "<|endoftext|>")
    }
    assert len(ids) == 4 and max(ids) < target.config.vocab_size
    # Special tokens are atomic: the literal text never splits into pieces.
    assert tokenizer.encode("<|mask|><|im_end|>", add_special_tokens=False) == [
        tokenizer.mask_token_id,
        tokenizer.eos_token_id,
    ]
    assert target.config.eos_token_id == tokenizer.eos_token_id


def test_target_loads_and_returns_hidden_states(example_assets, tokenizer, target):
    cfg = target.config
    assert cfg.model_type == "qwen3" and not cfg.tie_word_embeddings
    assert cfg.vocab_size >= len(tokenizer) and cfg.max_position_embeddings >= 1024
    ids = torch.tensor([tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)])
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == cfg.num_hidden_layers + 1
    assert all(h.shape == (1, ids.shape[1], cfg.hidden_size) for h in out.hidden_states)
    assert out.logits.shape == (1, ids.shape[1], cfg.vocab_size)
    # The target folder ships its tokenizer, like a hub checkpoint.
    assert AutoTokenizer.from_pretrained(example_assets.target).get_vocab() == tokenizer.get_vocab()


def test_data_is_multi_turn_sharegpt_with_system_prompts(example_assets):
    records = read_jsonl(example_assets.data)
    assert len(records) == 3000
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        roles = [t["from"] for t in r["conversations"]]
        body = roles[1:] if roles[0] == "system" else roles
        assert body[0::2] == ["human"] * (len(body) // 2) and body[1::2] == ["gpt"] * (len(body) // 2)
        assert len(body) % 2 == 0 and 1 <= len(body) // 2 <= 4
    system = np.mean([r["conversations"][0]["from"] == "system" for r in records])
    multi_turn = np.mean([len(r["conversations"]) >= 4 for r in records])
    assert 0.2 < system < 0.4 and multi_turn > 0.2


def test_lengths_are_long_tailed(lengths):
    # Most chats are short, about a fifth are long: batches of long chats hold ~8x fewer samples.
    assert np.median(lengths) < 100
    assert 0.10 <= np.mean(lengths > 256) <= 0.30
    assert lengths.max() <= 512 and lengths.max() >= 8 * np.quantile(lengths, 0.3)


def test_answers_follow_from_the_prompt():
    for record in generate_conversations(300, seed=5):
        turns = record["conversations"]
        for ask, say in zip(turns, turns[1:], strict=False):
            if ask["from"] != "human" or say["from"] != "gpt":
                continue
            if ask["value"].startswith("Reverse this list: "):
                items = ask["value"].removeprefix("Reverse this list: ").split()
                assert say["value"].endswith(": " + " ".join(items[::-1]) + ".")
            if ask["value"].startswith("Sort these numbers"):
                items = ask["value"].split(": ", 1)[1].split()
                assert say["value"].endswith(" ".join(sorted(items, key=int)) + ".")


def test_target_models_held_out_chats_far_better_than_uniform(tokenizer, target, example_assets):
    held_out = generate_conversations(100, seed=12345)
    uniform = math.log(target.config.vocab_size)
    assert evaluate_loss(target, tokenizer, held_out)["all"] < uniform - 3.0
    # Counting follows from local patterns, so a real (tiny) LM of the corpus predicts it well; random lists
    # need copying across the chat, which a model this size does not learn in a minute.
    counting = [
        r
        for r in held_out
        if all(
            t["value"].startswith(("Count from", "Count down"))
            for t in r["conversations"]
            if t["from"] == "human"
        )
    ]
    assert len(counting) >= 10
    assert evaluate_loss(target, tokenizer, counting)["assistant"] < 1.0
    meta = read_metadata(example_assets)["target"]
    assert meta["final_loss"] < meta["initial_loss"] - 4.0 and meta["held_out_loss"] < uniform - 3.0


def test_data_and_tokenizer_are_deterministic(example_assets, tmp_path):
    records = generate_conversations(seed=0)
    write_jsonl(str(tmp_path / "data.jsonl"), records, sort_keys=True)
    assert (tmp_path / "data.jsonl").read_bytes() == Path(example_assets.data).read_bytes()
    save_tokenizer(train_tokenizer(render(to_messages(r)) for r in records), tmp_path / "tok")
    expected = Path(example_assets.tokenizer, "tokenizer.json").read_bytes()
    assert (tmp_path / "tok" / "tokenizer.json").read_bytes() == expected
    assert generate_conversations(50, seed=1) != generate_conversations(50, seed=0)


def test_target_training_is_deterministic(tokenizer):
    records = generate_conversations(40, seed=0)
    settings = TrainSettings(steps=3, seq_len=64, batch_size=2)
    first, losses = train_target(tokenizer, records, settings)
    second, again = train_target(tokenizer, records, settings)
    assert losses == again
    assert all(
        torch.equal(a, b)
        for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )


def test_reuse_is_quick_and_does_not_rebuild(example_assets):
    marker = Path(example_assets.home, "done.json")
    before = marker.stat().st_mtime_ns
    start = time.perf_counter()
    again = build_example()
    assert time.perf_counter() - start < 10
    assert again == example_assets and marker.stat().st_mtime_ns == before


def test_resolve_uri_maps_example_uris_and_passes_others_through(example_assets):
    assert [resolve_uri(u) for u in EXAMPLE_URIS] == [
        example_assets.data,
        example_assets.tokenizer,
        example_assets.target,
        example_assets.heldout,
    ]
    assert resolve_uri("s3://bucket/chats.jsonl") == "s3://bucket/chats.jsonl"
    with pytest.raises(ExampleError, match="example://data"):
        resolve_uri("example://weights")


BUILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from dflash_core.example import build_example
print(json.dumps(build_example(sys.argv[1], target_steps=2).__dict__))
"""


@pytest.mark.slow
def test_concurrent_builds_build_once_and_a_damaged_cache_is_rebuilt(tmp_path):
    env = {**os.environ, "DFLASH_HOME": str(tmp_path / "unused")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(tmp_path)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert sum("building example assets" in err for _, err in outs) == 1
    paths = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == ["example-v1-seed0-steps2"]
    data = Path(paths[0]["data"])
    original = data.read_bytes()
    data.write_bytes(original + b"\n")
    assert build_example(str(tmp_path), target_steps=2).data == str(data)
    assert data.read_bytes() == original


def test_held_out_prompts_are_not_in_the_training_data_and_come_back_when_missing(example_assets, tmp_path):
    def opening(record):
        return next(t["value"] for t in record["conversations"] if t["from"] == "human")

    asked = {t["value"] for line in open(example_assets.data)
             for t in json.loads(line)["conversations"] if t["from"] == "human"}
    held_out = [json.loads(line) for line in open(example_assets.heldout)]
    assert len(held_out) > 100 and not any(opening(r) in asked for r in held_out)
    old_cache = tmp_path / "example-v1-seed0"  # a cache built before heldout.jsonl existed (other tests share ours)
    old_cache.mkdir()
    shutil.copy(example_assets.data, old_cache / "data.jsonl")
    assert _assets(old_cache, seed=0).heldout == str(old_cache / "heldout.jsonl")
    assert (old_cache / "heldout.jsonl").read_bytes() == Path(example_assets.heldout).read_bytes()
