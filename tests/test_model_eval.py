"""Speculative decoding: lossless, oracle and random drafters, KV-cached vs uncached verification, stop tokens,
the tau figures, the eval entry point."""

import functools
import json
import logging

import pytest
import torch
from common.models import MASK_ID, tiny_drafter, tiny_qwen3
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from dflash_core.model.evaluate import (
    Response,
    evaluate,
    greedy_generate,
    histogram,
    mean_of_means,
    prompt_turns,
    read_instances,
    speculative_generate,
    summarize,
    tau,
)
from dflash_core.model.export import save_dflash
from dflash_core.model.target import TargetModel

B = 4


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_qwen3(seed=2))


PROMPTS = [
    torch.tensor([5, 17, 42, 8, 23]),
    torch.tensor([61, 3]),
    torch.tensor([11, 12, 13, 14, 15, 16, 17]),
]


class OracleDrafter:
    """Drafts the target's own greedy continuation (it is given that continuation up front)."""

    block_size = B
    target_layer_ids = [1]

    def __init__(self, continuation: torch.Tensor):
        self.continuation = continuation

    def draft_block(self, context_features, anchor_token, position):
        assert context_features.shape[1] == position  # context is exactly the positions before the anchor
        logits = torch.zeros(B, 100)
        for j in range(B):
            logits[j, int(self.continuation[min(position + j, len(self.continuation) - 1)])] = 1.0
        return logits


def test_greedy_reference_equals_transformers_generate(target):
    ids = PROMPTS[0][None]
    hf = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(greedy_generate(target, ids, 12), hf)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_oracle_drafter_reaches_the_block_size_and_output_is_greedy(target, prompt):
    reference = greedy_generate(target, prompt, 30 + B)[0]
    out, lengths = speculative_generate(target, OracleDrafter(reference), prompt, 30)
    assert torch.equal(out[0], reference[: len(prompt) + 30])
    assert lengths and all(n == B for n in lengths)
    assert tau(lengths) == B


@pytest.mark.parametrize("prompt", PROMPTS)
def test_random_drafter_accepts_almost_nothing_and_output_is_greedy(target, prompt):
    drafter = tiny_drafter(target, block_size=B, seed=7).eval()
    out, lengths = speculative_generate(target, drafter, prompt, 25)
    assert torch.equal(out, greedy_generate(target, prompt, 25))
    assert 1.0 <= tau(lengths) < 1.5


class NoisyOracleDrafter(OracleDrafter):
    """The oracle with slot 1, 2, 3, 1, ... wrong in successive calls: verification rejects at every slot."""

    calls = 0

    def draft_block(self, context_features, anchor_token, position):
        logits = super().draft_block(context_features, anchor_token, position)
        wrong = self.calls % (B - 1) + 1
        self.calls += 1
        logits[wrong] = logits[wrong].roll(1)  # the argmax moves to the next token id: a wrong draft
        return logits


@pytest.mark.parametrize("prompt", PROMPTS)
def test_kv_cached_verification_is_lossless_and_equal_in_tau_to_the_uncached_path(target, prompt):
    reference = greedy_generate(target, prompt, 40 + B)[0]
    random_drafter = tiny_drafter(target, block_size=B, seed=7).eval()
    for make in (lambda: NoisyOracleDrafter(reference), lambda: random_drafter):
        cached, cached_lengths = speculative_generate(target, make(), prompt, 40, kv_cache=True)
        full, full_lengths = speculative_generate(target, make(), prompt, 40, kv_cache=False)
        assert torch.equal(cached[0], reference[: len(prompt) + 40])
        assert torch.equal(full, cached)
        assert cached_lengths == full_lengths
    noisy = speculative_generate(target, NoisyOracleDrafter(reference), prompt, 40)[1]
    assert set(noisy) == {1, 2, 3}  # rejections at every slot: the cache is cropped back each time


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_kv_cache_equals_the_uncached_reference(target, prompt):
    assert torch.equal(greedy_generate(target, prompt, 30, kv_cache=True), greedy_generate(target, prompt, 30))


def test_tau_is_the_mean_of_per_response_means():
    responses = [[4, 4, 2], [1, 1], [3], []]  # the empty one: a response whose first token was a stop token
    assert mean_of_means(responses) == pytest.approx((10 / 3 + 1 + 3) / 3)  # 2.444, not the pooled 15 / 6
    assert tau([n for r in responses for n in r]) == pytest.approx(2.5)
    assert mean_of_means([[]]) is None
    assert histogram([4, 4, 2, 1, 1, 3], 4) == {"1": 2, "2": 1, "3": 1, "4": 2}


def test_tau_server_is_sglangs_per_request_figure_averaged_over_requests():
    """SGLang's meta_info spec_accept_length is completion_tokens / spec_verify_ct per request (the first token,
    from the prefill, among the completion tokens), and the public benchmark's sglang backend reports the mean of
    it over requests: not tau (no prefill token) and not pooled over requests."""
    from dflash_core.model.evaluate import sglang_passes

    responses = [Response("s", 0, [4, 4, 2], 11, seconds=1.0, server_passes=3),  # 1 prefill token + 10 in 3
                 Response("s", 1, [1, 1], 3, seconds=1.0, server_passes=2),
                 Response("s", 2, [3], 2, seconds=1.0, server_passes=1),  # cut at max_new_tokens 2
                 Response("s", 3, [2], 1, seconds=0.0, server_passes=0)]  # its first token a stop: no pass
    out = summarize(responses, 4)
    # a request SGLang verified nothing for carries no spec_accept_length (SGLang since its late-2025 metrics
    # rework, the builds z-lab pins), and z-lab's benchmark averages only the requests that carry one
    assert out["tau_server"] == pytest.approx((11 / 3 + 3 / 2 + 2 / 1) / 3)
    assert out["tau"] == pytest.approx((10 / 3 + 1 + 3 + 2) / 4)  # tau still counts it, as the reference loop
    assert summarize([], 4)["tau_server"] is None
    assert summarize([Response("s", 0, [2], 1, seconds=0.0, server_passes=0)], 4)["tau_server"] is None
    # a response decoded without SGLang's count of its passes: every decoding step is one
    assert summarize([Response("s", 0, [4, 4, 2], 11, seconds=1.0)], 4)["tau_server"] == pytest.approx(11 / 3)
    # SGLang's passes: none after a stop token from the prefill; none once max_new_tokens are committed (the
    # reference loop steps once more with exactly max_new_tokens committed, and counts that step in tau)
    assert sglang_passes([4, 4, 2], 2048, first_is_stop=False) == 3
    assert sglang_passes([2], 2048, first_is_stop=True) == 0
    assert sglang_passes([3], 1, first_is_stop=False) == 0  # max_new_tokens 1: the prefill's token is all
    assert sglang_passes([4, 4, 3], 9, first_is_stop=False) == 2  # 1 + 4 + 4 = 9 committed: no third pass


def test_speedup_is_the_ratio_of_mean_per_token_decoding_times_as_the_benchmark_reports_it():
    """z-lab/dflash benchmark.py: each response's decoding seconds (after the prefill and the first draft pass)
    per new token, averaged over responses; throughput is 1 / that mean, speedup the ratio of the two means (not
    pooled seconds over pooled tokens, which would let long responses dominate)."""
    responses = [Response("s", 0, [2, 2], 4, seconds=2.0, baseline_tokens=4, baseline_seconds=4.0),
                 Response("s", 1, [3], 100, seconds=10.0, baseline_tokens=100, baseline_seconds=12.0)]
    out = summarize(responses, B)
    spec, base = (0.5 + 0.1) / 2, (1.0 + 0.12) / 2  # mean seconds per token
    assert out["tokens_per_s"] == pytest.approx(1 / spec) and out["baseline_tokens_per_s"] == pytest.approx(1 / base)
    assert out["speedup"] == pytest.approx(base / spec)  # 1.867; pooled it would be 16/104 / (12/104) = 1.333
    assert summarize([Response("s", 0, [], 0, seconds=0.0)], B)["tokens_per_s"] is None


def test_decoding_time_starts_after_the_prefill_and_the_first_draft_pass(target):
    """Where both decoders call `decoding_starts`: the greedy baseline after its one prefill forward, speculative
    decoding after the prefill and the first draft_block (before that block's verify pass), once each."""
    model, calls, prompt = target.model, [], PROMPTS[0]
    forward = model.forward

    @functools.wraps(forward)  # the same signature: decoding picks its cache keyword from it
    def counted(*args, **kwargs):
        calls.append("target")
        return forward(*args, **kwargs)

    class Counting(OracleDrafter):
        def draft_block(self, *args):
            calls.append("draft")
            return super().draft_block(*args)

    reference = greedy_generate(target, prompt, 12 + B)[0]
    model.forward = counted
    try:
        greedy_generate(target, prompt, 6, kv_cache=True, decoding_starts=lambda: calls.append("start"))
        assert calls == ["target", "start"] + ["target"] * 5
        calls.clear()
        speculative_generate(target, Counting(reference), prompt, 12, decoding_starts=lambda: calls.append("start"))
        assert calls[:4] == ["target", "draft", "start", "target"] and calls.count("start") == 1
    finally:
        del model.forward


def test_stop_token_ends_generation_like_greedy(target):
    prompt = PROMPTS[0]
    reference = greedy_generate(target, prompt, 20)[0, len(prompt) :].tolist()
    stop = reference[5]
    drafter = tiny_drafter(target, block_size=B, seed=7).eval()
    out, _ = speculative_generate(target, drafter, prompt, 20, stop_token_ids=[stop])
    assert out[0, len(prompt) :].tolist() == reference[: reference.index(stop) + 1]
    assert torch.equal(out, greedy_generate(target, prompt, 20, stop_token_ids=[stop]))


def test_prompt_turns_cut_before_the_first_assistant_turn():
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "hi"},
            {"from": "gpt", "value": "yo"},
            {"from": "human", "value": "more"},
        ]
    }
    assert prompt_turns(sharegpt) == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    openai = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert prompt_turns(openai) == [{"role": "user", "content": "a"}]
    assert prompt_turns({"messages": [{"role": "assistant", "content": "b"}]}) is None
    assert prompt_turns({"text": "no turns"}) is None


WORDS = [
    "[UNK]",
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
    "<|mask|>",
    "user",
    "assistant",
    "system",
    "what",
    "is",
    "two",
    "plus",
    "three",
    "hello",
    "there",
    "count",
    "to",
    "ten",
    "?",
]


def tiny_tokenizer(path) -> None:
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|mask|>", "<pad>"])
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        mask_token="<|mask|>",
        chat_template=template,
    )
    fast.save_pretrained(path)


def test_evaluate_end_to_end(tmp_path, target):
    target.model.save_pretrained(tmp_path / "target")
    save_dflash(tiny_drafter(target, block_size=B, seed=7), str(tmp_path / "drafter"))
    tiny_tokenizer(tmp_path / "tok")
    records = [
        {
            "conversations": [
                {"from": "human", "value": "what is two plus three ?"},
                {"from": "gpt", "value": "x"},
                {"from": "human", "value": "count to ten"},
            ]
        },
        {"messages": [{"role": "system", "content": "hello"}, {"role": "user", "content": "count to ten"}]},
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
        {"conversations": [{"from": "human", "value": "hello there"}]},
    ]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert len(read_instances(str(tmp_path / "data.jsonl"))) == 3
    summary = evaluate(  # the keywords `dflash eval` uses
        target=str(tmp_path / "target"),
        drafter_dir=str(tmp_path / "drafter"),
        tokenizer=str(tmp_path / "tok"),
        data=str(tmp_path / "data.jsonl"),
        instances=[{"turns": ["hello there", "what is two plus three ?"]}],
        limit=2,
        max_new_tokens=10,
        baseline=True,
        device="cpu",
        per_response=True,
    )
    assert summary["instances"] == 3 and summary["responses"] == 5  # 2 + 1 turns from the file, 2 from the list
    assert len(summary["per_response"]) == 5  # each response's mean, in decoding order: tau is their mean
    assert summary["tau"] == pytest.approx(sum(summary["per_response"]) / 5)
    assert summary["per_response_prompts"] == [0, 1, 2, 3, 4]  # five different prompts: five pairs
    assert 1.0 <= summary["tau"] <= B and 1.0 <= summary["tau_pooled"] <= B
    assert 1.0 <= summary["tau_server"] <= B + 1  # the prefill's token on top of the accepted ones
    assert list(summary["histogram"]) == ["1", "2", "3", "4"]
    assert 0 < summary["tokens_generated"] <= 50
    assert summary["baseline_matches"] == 5  # lossless: every response equals target-only greedy decoding
    assert summary["tokens_per_s"] > 0 and summary["baseline_tokens_per_s"] > 0 and summary["speedup"] > 0
    per_suite = summary["benchmarks"]
    assert list(per_suite) == [str(tmp_path / "data.jsonl"), "instances"]
    assert [s["responses"] for s in per_suite.values()] == [3, 2]
    assert sum(s["tokens_generated"] for s in per_suite.values()) == summary["tokens_generated"]
    assert MASK_ID == 99  # the drafter's mask id comes from its config, not the tokenizer
    assert "layer_attention" not in summary  # DFlash's original layers: nothing to say
    json.dumps(summary)
    # a drafter with a causal sliding-window layer (Qwen3.6's kind) says so, to read its tau by
    windowed = tiny_drafter(target, block_size=B, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    save_dflash(windowed, str(tmp_path / "windowed"))
    summary = evaluate(target=str(tmp_path / "target"), drafter_dir=str(tmp_path / "windowed"),
                       tokenizer=str(tmp_path / "tok"), instances=[{"turns": ["hello there"]}], max_new_tokens=10,
                       device="cpu")
    assert summary["layer_attention"] == ["causal, window 8", "full"]


def test_evaluate_at_a_temperature_is_reproducible_by_seed(tmp_path, target):
    """Sampled decoding: the same seed gives the same figures, another seed other outputs; the baseline is timed
    but not compared (sampled outputs differ), and the summary says the temperature."""
    target.model.save_pretrained(tmp_path / "target")
    save_dflash(tiny_drafter(target, block_size=B, seed=7), str(tmp_path / "drafter"))
    tiny_tokenizer(tmp_path / "tok")
    run = functools.partial(evaluate, target=str(tmp_path / "target"), drafter_dir=str(tmp_path / "drafter"),
                            tokenizer=str(tmp_path / "tok"), instances=[{"turns": ["hello there", "count to ten"]},
                                                                        {"turns": ["what is two plus three ?"]}],
                            max_new_tokens=12, device="cpu", per_response=True)
    greedy = run()
    first, again = run(temperature=1.0, seed=5, baseline=True), run(temperature=1.0, seed=5)
    other = run(temperature=1.0, seed=6)
    assert greedy["temperature"] == 0.0 and first["temperature"] == 1.0
    assert first["per_response"] == again["per_response"] and first["histogram"] == again["histogram"]
    assert first["tokens_generated"] == again["tokens_generated"]
    assert (first["histogram"], first["tokens_generated"]) != (greedy["histogram"], greedy["tokens_generated"])
    assert (other["histogram"], other["tokens_generated"]) != (first["histogram"], first["tokens_generated"])
    assert first["baseline_tokens_per_s"] > 0 and "baseline_matches" not in first
    with pytest.raises(ValueError, match="temperature -1"):
        run(temperature=-1)
    resized = run(block_size=2)  # the benchmark's --block-size: blocks of 2 from a drafter trained with 4
    assert (resized["block_size"], resized["trained_block_size"]) == (2, B) and list(resized["histogram"]) == ["1", "2"]
    assert "trained_block_size" not in run(block_size=B)


def test_responses_past_the_targets_context_are_counted_and_said(tmp_path, target, monkeypatch, caplog):
    """A prompt whose response runs past max_position_embeddings is decoded (as the reference does) but no longer
    silently: the summary counts it and one warning says what to do."""
    save_dflash(tiny_drafter(target, block_size=B, seed=7), str(tmp_path / "drafter"))
    tiny_tokenizer(tmp_path / "tok")
    run = functools.partial(evaluate, target=target, drafter_dir=str(tmp_path / "drafter"),
                            tokenizer=str(tmp_path / "tok"), max_new_tokens=8, device="cpu")
    assert "past_context" not in run(instances=[{"turns": ["hello there"]}])
    monkeypatch.setattr(target.model.config, "max_position_embeddings", 24)
    long = " ".join(["count to ten"] * 6)
    with caplog.at_level(logging.WARNING, logger="dflash_core.model.evaluate"):
        summary = run(instances=[{"turns": ["hello there"]}, {"turns": [long]}, {"turns": [long]}])
    assert summary["past_context"] == 2 and summary["responses"] == 3
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "exceed the target's max_position_embeddings 24" in warning and "--max-new-tokens" in warning


@pytest.mark.parametrize("kind", ["qwen3_5", "gpt_oss", "gemma4", "deepseek_v3"])
def test_kv_cached_verification_on_targets_whose_cache_cannot_simply_be_cropped(kind):
    """gpt-oss's sliding-window layers drop keys past their window, and Qwen3.5/3.6's linear-attention layers
    fold every token into a recurrent state no crop can undo: rejected drafts must still leave no trace. With
    rejections at every slot and whole blocks accepted, the cached path equals the uncached one and greedy."""
    from common.models import tiny_hybrid

    target = TargetModel(tiny_hybrid(kind))
    for prompt in PROMPTS:
        reference = greedy_generate(target, prompt, 40 + B)[0]
        assert torch.equal(greedy_generate(target, prompt, 40 + B, kv_cache=True)[0], reference)
        for make in (lambda: NoisyOracleDrafter(reference), lambda: OracleDrafter(reference)):  # noqa: B023
            cached, cached_lengths = speculative_generate(target, make(), prompt, 40, kv_cache=True)
            full, full_lengths = speculative_generate(target, make(), prompt, 40, kv_cache=False)
            assert torch.equal(cached[0], reference[: len(prompt) + 40])
            assert torch.equal(full, cached) and cached_lengths == full_lengths
    assert set(speculative_generate(target, NoisyOracleDrafter(reference), prompt, 40)[1]) == {1, 2, 3}
