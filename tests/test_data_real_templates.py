"""The supervised tokens under the chat templates real targets publish (tests/fixtures/templates): exactly the
replies and their end-of-turn, nothing of the prompt and nothing a generation prompt pre-fills; the records a
template cannot render faithfully are dropped with their reason, never kept half right."""

from __future__ import annotations

import functools
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from common.chat import data_config

from dflash_core.data.accounting import POLICY_REASONS
from dflash_core.data.tokenize import preview_samples

FIXTURES = Path(__file__).parent / "fixtures" / "templates"
MISTRAL = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "[TOOL_CALLS]"]
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
        "<tool_response>", "</tool_response>"]
DEEPSEEK = ["<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
            "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
            "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]  # DeepSeek V3.1's and V3.2's
COHERE = ["<PAD>", "<UNK>", "<CLS>", "<SEP>", "<MASK_TOKEN>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<EOP_TOKEN>",
          "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>",
          "<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_ACTION|>",
          "<|END_ACTION|>", "<|START_TOOL_RESULT|>", "<|END_TOOL_RESULT|>", "<|START_TEXT|>", "<|END_TEXT|>",
          "<|IMG_PATCH|>"]  # Cohere's Command R7B and Cohere2 MoE's
# template file, its special tokens (the first is the pad), bos, eos
SPECS = {
    "qwen3": ("Qwen-Qwen3-0.6B", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                                  "</tool_call>", "<tool_response>", "</tool_response>"], None, "<|im_end|>"),
    "qwq": ("Qwen-QwQ-32B", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                             "</tool_call>"], None, "<|im_end|>"),
    "r1distill": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", [
        "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "dsv31": ("deepseek-ai-DeepSeek-V3.1", DEEPSEEK, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "gptoss": ("openai-gpt-oss-120b", ["<|endoftext|>", "<|startoftext|>", "<|start|>", "<|message|>", "<|channel|>",
                                       "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"], "<|startoftext|>",
               "<|return|>"),
    "nemotron": ("NVIDIA-Nemotron-Nano-v2", ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<think>", "</think>",
                                             "<TOOLCALL>", "</TOOLCALL>", "<TOOL_RESPONSE>", "</TOOL_RESPONSE>",
                                             "<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>"], None, "<SPECIAL_12>"),
    "llama31": ("meta-llama-Llama-3.1-8B-Instruct", ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>",
                                                     "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                                                     "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "gemma3": ("google-gemma-3-4b-it", ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>",
               "<eos>"),
    "nemo": ("mistralai-Mistral-Nemo-Instruct-2407", MISTRAL, "<s>", "</s>"),
    "mistral03": ("mistralai-Mistral-7B-Instruct-v0.3", MISTRAL, "<s>", "</s>"),
    "small32": ("mistralai-Mistral-Small-3.2-24B-Instruct-2506", [
        *MISTRAL, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[CALL_ID]", "[ARGS]", "[TOOL_CONTENT]"], "<s>", "</s>"),
    "phi4": ("microsoft-phi-4", ["<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"], None, "<|im_end|>"),
    "glm45": ("zai-org-GLM-4.5", ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                  "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                                  "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"],
              None, "<|endoftext|>"),
    "gemma4": ("google-gemma-4-31B-it-interleaved", ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|think|>",
                                                     "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|tool_call>",
                                                     "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>'],
               "<bos>", "<eos>"),
    "minimax": ("unsloth-MiniMax-M2", ["]!d~[", "]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>",
                                       "</minimax:tool_call>"], "]~!b[", "[e~["),
    "kimi": ("moonshotai-Kimi-K2-Thinking", ["[PAD]", "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                             "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
                                             "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                             "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"],
             "[BOS]", "[EOS]"),
    "qwen35": ("Qwen-Qwen3.5-4B", QWEN, None, "<|im_end|>"),
    "qwen3coder": ("Qwen-Qwen3-Coder-30B-A3B-Instruct", QWEN, None, "<|im_end|>"),
    "glm47": ("zai-org-GLM-4.7-Flash", ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                       "<|observation|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                                       "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>",
                                       "</tool_response>"], None, "<|endoftext|>"),
    "seedoss": ("ByteDance-Seed-Seed-OSS-36B-Instruct", ["<seed:pad>", "<seed:bos>", "<seed:eos>", "<seed:think>",
                                                         "</seed:think>", "<seed:tool_call>", "</seed:tool_call>",
                                                         "<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>"],
                "<seed:bos>", "<seed:eos>"),
    "granite4": ("ibm-granite-granite-4.0", ["<|pad|>", "<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>",
                                              "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
                 None, "<|end_of_text|>"),
    "nemotron3": ("nvidia-NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", ["<unk>", "<|im_start|>", "<|im_end|>", "<think>",
                                                                "</think>", "<tool_call>", "</tool_call>",
                                                                "<tool_response>", "</tool_response>"], None,
                  "<|im_end|>"),
    "apertus": ("swiss-ai-Apertus-8B-Instruct", ["<pad>", "<s>", "</s>", "<|system_start|>", "<|system_end|>",
                                                 "<|developer_start|>", "<|developer_end|>", "<|user_start|>",
                                                 "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                                                 "<|inner_prefix|>", "<|inner_suffix|>", "<|tools_prefix|>",
                                                 "<|tools_suffix|>"], "<s>", "<|assistant_end|>"),
    "ministral3": ("mistralai-Ministral-3-14B-Reasoning-2512", [
        *MISTRAL, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[CALL_ID]", "[ARGS]", "[THINK]", "[/THINK]", "[IMG]"],
        "<s>", "</s>"),
    "kimi3": ("moonshotai-Kimi-K3", ["[PAD]", "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"],
              "[BOS]", "[EOS]"),
    "gigachat3": ("ai-sage-GigaChat3-10B-A1.8B", ["<unk>", "<s>", "</s>", "<|role_sep|>", "<|message_sep|>"], "<s>",
                  "</s>"),
    "hy3": ("tencent-Hy3", [f"{t[0]}{t[1:-1]}:opensource{t[-1]}" for t in (
        "<｜hy_pad｜>", "<｜hy_begin_of_sentence｜>", "<｜hy_eos｜>", "<｜hy_User｜>", "<｜hy_Assistant｜>",
        "<｜reasoning_mode｜>", "<think>", "</think>", "<tool_calls>", "</tool_calls>", "<tool_call>", "</tool_call>",
        "<tool_sep>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_responses>",
        "</tool_responses>", "<tool_response>", "</tool_response>")],
            "<｜hy_begin_of_sentence:opensource｜>", "<｜hy_eos:opensource｜>"),
    "minimax3": ("MiniMaxAI-MiniMax-M3", ["]!d~[", "]~!b[", "]~b]", "[e~[", "<mm:think>", "</mm:think>", "]<]minimax[>[",
                                          "]<]image[>[", "]<]video[>["], "]~!b[", "[e~["),
    "step35": ("stepfun-ai-Step-3.5-Flash", QWEN, None, "<|im_end|>"),
    "llama4": ("meta-llama-Llama-4-Scout-17B-16E-Instruct", [
        "<|finetune_right_pad|>", "<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>", "<|header_end|>",
        "<|eot|>", "<|eom|>", "<|python_start|>", "<|python_end|>", "<|image|>"], "<|begin_of_text|>", "<|eot|>"),
    "glimmer": ("muse-glimmer", ["<|endoftext|>", "<|startoftext|>", "<|start|>", "<|message|>", "<|eot|>", "<|eom|>"],
                "<|startoftext|>", "<|eot|>"),
    "cohere2moe": ("Cohere2MoE", COHERE, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "dsv32": ("deepseek-ai-DeepSeek-V3.2", DEEPSEEK, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "commandr7b": ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", COHERE, "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "hermes3": ({"default": "NousResearch-Hermes-3-Llama-3.1-8B-default",
                 "tool_use": "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"}, [
        "<|end_of_text|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
        "<tool_response>", "</tool_response>"], "<|begin_of_text|>", "<|im_end|>"),
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _call(name: str, n: int) -> dict[str, Any]:
    return {"id": f"call{n:05d}", "type": "function", "function": {"name": name, "arguments": {"city": "Paris"}}}


RECORDS = {
    "single": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    "multi": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Q1 count"},
              {"role": "assistant", "content": "A1 three"}, {"role": "user", "content": "Q2 total"},
              {"role": "assistant", "content": "A2 six"}],
    "reason": [{"role": "user", "content": "Q1 count"},
               {"role": "assistant", "content": "A1 three", "reasoning_content": "R1 think one"},
               {"role": "user", "content": "Q2 total"},
               {"role": "assistant", "content": "A2 six", "reasoning_content": "R2 think two"}],
    "tools": [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", 1)]},
              {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "{\"temp\": 18}"},
              {"role": "assistant", "content": "It is 18 degrees."}],
    "parallel": [{"role": "user", "content": "Weather and time in Paris?"},
                 {"role": "assistant", "content": None,
                  "tool_calls": [_call("get_weather", 1), _call("get_time", 2)]},
                 {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "{\"temp\": 18}"},
                 {"role": "tool", "tool_call_id": "call00002", "name": "get_time", "content": "{\"time\": \"9:00\"}"},
                 {"role": "assistant", "content": "It is 18 degrees at 9:00."}],
}
USER_TEXTS = ("Hi there", "Q1 count", "Q2 total", "Weather in Paris?", "Weather and time in Paris?")
LAST_REPLY = {"single": "Hello! How can I help?", "multi": "A2 six", "reason": "A2 six", "tools": "It is 18 degrees.",
              "parallel": "It is 18 degrees at 9:00."}
# drops that say a template cannot render the record faithfully (policy), as opposed to failures to place it
POLICY = {"template_has_no_tools", "template_single_tool_call", "reasoning_dropped_by_template",
          "template_drops_text_with_calls", "template_rewrites_reply"}


@functools.cache
def _tokenizer(name: str, edit: tuple[str, str] = ("", "")) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    file, specials, bos, eos = SPECS[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] or "" for turns in RECORDS.values() for m in turns] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0])
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = ((FIXTURES / f"{file}.jinja").read_text() if isinstance(file, str) else  # named templates
                          {k: (FIXTURES / f"{f}.jinja").read_text() for k, f in file.items()})
    if edit[0]:  # a variant of the published template: (what, replaced by)
        assert edit[0] in fast.chat_template, edit
        fast.chat_template = fast.chat_template.replace(*edit)
    out = tempfile.mkdtemp(prefix=f"dflash-real-template-{name}-")
    fast.save_pretrained(out)
    return out


def _preview(name: str, thinking: str, records: dict[str, Any] | None = None,
             edit: tuple[str, str] = ("", "")) -> dict[str, dict[str, Any]]:
    records = records or RECORDS
    folder = Path(tempfile.mkdtemp(prefix="dflash-real-records-"))
    source = folder / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": rid, "messages": turns, **(
        {"tools": [WEATHER, TIME]} if any(m.get("tool_calls") for m in turns) else {})}) + "\n"
        for rid, turns in records.items()))
    # room for the long default system prompts (GigaChat 3's, Devstral's) in this 500-token vocabulary
    cfg = data_config(source=str(source), tokenizer=_tokenizer(name, edit), thinking=thinking, max_length=65536)
    out = preview_samples(str(source), _tokenizer(name, edit), cfg, block_size=1, limit=len(records))
    return {r["id"]: r for r in out["records"]}


def _supervised(record: dict[str, Any]) -> list[str]:
    """The supervised spans of a previewed record, each one string."""
    spans, current = [], None
    for text, supervised in record["segments"]:
        if supervised:
            current = (current or "") + text
        elif current is not None:
            spans.append(current)
            current = None
    return spans + ([current] if current is not None else [])


@pytest.mark.parametrize("thinking", ["strip", "keep"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_only_replies_are_supervised_under_real_templates(name: str, thinking: str) -> None:
    records = _preview(name, thinking)
    eos = {"gemma3": "<end_of_turn>", "glm45": "<|user|>", "glm47": "<|user|>", "gemma4": "<turn|>", "kimi": "<|im_end|>",
           "kimi3": "<|close|>message<|sep|><|end_of_msg|>", "gigachat3": "<|message_sep|>"}.get(
        name, SPECS[name][3])  # what ends a reply
    for rid, record in records.items():
        if not record["kept"]:
            assert record["reason"] in POLICY, (name, thinking, rid, record["reason"], record["detail"])
            continue
        spans = _supervised(record)
        assert spans and LAST_REPLY[rid] in spans[-1], (name, thinking, rid, spans)
        assert spans[-1].rstrip("\n").endswith(eos), (name, thinking, rid, spans[-1])
        assert not any(text in span for span in spans for text in USER_TEXTS), (name, thinking, rid, spans)
        if rid in ("tools", "parallel"):  # the turn of calls is learnt too, without the tool's result
            calls = spans[:-1]
            assert calls and "get_weather" in calls[0] and "Paris" in calls[0], (name, thinking, rid, spans)
            assert not any("temp" in span for span in calls), (name, thinking, rid, spans)
    assert records["single"]["kept"] and records["multi"]["kept"]


def test_what_a_generation_prompt_pre_fills_is_not_supervised_and_tool_turns_are_placed() -> None:
    """QwQ's and Nemotron's generation prompts pre-fill '<think>\\n' after the header that earlier turns have:
    a turn of tool calls only is placed on that header (it was a template_mismatch, which fails the stage), and
    under thinking keep QwQ's last reply is supervised from after the pre-filled '<think>\\n'."""
    for name in ("qwq", "nemotron"):
        tools = _preview(name, "strip")["tools"]
        assert tools["kept"], tools
        assert "get_weather" in _supervised(tools)[0] and "Paris" in _supervised(tools)[0]
    # DeepSeek's templates join a call's arguments into the text: they get them as JSON text, not an object (the
    # probe with an object failed, and every tool record was dropped as template_has_no_tools)
    calls = _preview("dsv31", "strip")["tools"]
    assert calls["kept"] and '{"city": "Paris"}' in _supervised(calls)[0], calls
    reason = _supervised(_preview("qwq", "keep")["reason"])
    assert reason[-1].startswith("R2 think two") and "A2 six" in reason[-1], reason


def test_templates_that_would_train_a_half_truth_drop_the_record_with_its_reason() -> None:
    """gpt-oss's template renders only the first of a turn's parallel calls (silently); DeepSeek-R1's cuts every
    reply before '</think>', so under thinking keep the reasoning would be lost: both are dropped, saying why."""
    parallel = _preview("gptoss", "strip")["parallel"]
    assert not parallel["kept"] and parallel["reason"] == "template_single_tool_call", parallel
    assert _preview("gptoss", "strip")["tools"]["kept"]
    kept_reason = _preview("r1distill", "keep")["reason"]
    assert not kept_reason["kept"] and kept_reason["reason"] == "reasoning_dropped_by_template", kept_reason
    assert _preview("r1distill", "strip")["reason"]["kept"]
    qwen3 = _supervised(_preview("qwen3", "keep")["reason"])
    assert "R2 think two" in qwen3[-1] and "R1 think one" not in "".join(qwen3)  # history as Qwen3 renders it


def _with_ids(new_id: Any) -> dict[str, Any]:
    """The tool records with each call id (and result's tool_call_id) replaced by new_id(old), or removed."""
    out = json.loads(json.dumps({rid: RECORDS[rid] for rid in ("tools", "parallel")}))
    for turns in out.values():
        for m in turns:
            for key, holder in [("id", c) for c in m.get("tool_calls") or []] + [("tool_call_id", m)] * (
                    m["role"] == "tool"):
                if new_id is None:
                    del holder[key]
                else:
                    holder[key] = new_id(holder[key])
    return out


@pytest.mark.parametrize("name", ["nemo", "mistral03", "small32"])
@pytest.mark.parametrize("ids", ["openai", "none", "numbers"])
def test_mistral_templates_get_tool_call_ids_they_accept_and_calls_only_turns_are_placed(ids: str, name: str) -> None:
    """Mistral's templates raise on a tool call id that is not 9 letters or digits (OpenAI's 'call_...' ids, or
    none at all as in Glaive-style data), and have no generation prompt to anchor a turn of calls only on: such
    records were all dropped (template_has_no_tools). Ids are now made to fit, results keep their links, and a
    turn of calls is supervised from the '[TOOL_CALLS]' the model writes."""
    new_id = {"openai": lambda old: f"call_{old}XYZ", "none": None, "numbers": lambda old: int(old[4:])}[ids]
    records = _with_ids(new_id)
    if ids != "none":  # results answer their calls out of order: linked by id, not by place
        records["parallel"][2:4] = records["parallel"][3:1:-1]
    for rid, record in _preview(name, "strip", records).items():
        assert record["kept"], (rid, record["reason"], record["detail"])
        calls, reply = _supervised(record)
        assert calls.startswith("[TOOL_CALLS]") and calls.endswith("</s>"), calls
        assert reply.strip() == f"{LAST_REPLY[rid]}</s>"
        text = "".join(t for t, _ in record["segments"])
        made = re.findall(r'"id": "([^"]*)"|\[CALL_ID\]([A-Za-z0-9]{9})', calls)
        made = [a or b for a, b in made]
        assert len(made) == len(records[rid][1 if rid == "parallel" else 2]["tool_calls"])
        assert all(len(i) == 9 and i.isalnum() for i in made) and len(set(made)) == len(made), made
        answered = [a or b for a, b in re.findall(r'"call_id": "([^"]*)"|\[TOOL_RESULTS\]([A-Za-z0-9]{9})', text)]
        results = [m for m in records[rid] if m["role"] == "tool"]
        by_call = {c["function"]["name"]: i for c, i in zip(
            records[rid][1 if rid == "parallel" else 2]["tool_calls"], made, strict=True)}
        assert answered == [by_call[m["name"]] for m in results]  # each result answers its own call
        assert not any(u in "".join(_supervised(record)) for u in USER_TEXTS)


@pytest.mark.parametrize("name", ["nemo", "small32"])
def test_a_turn_of_calls_right_after_calls_or_an_empty_result_is_placed_on_its_own_calls(name: str) -> None:
    """Without a generation prompt a turn of calls only is found by the token that opens calls; the search starts
    after the previous reply, so it never takes the previous turn's calls (it did after an empty tool result)."""
    turns = [{"role": "user", "content": "Weather, then time in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", 1)]},
             {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": ""},
             {"role": "assistant", "content": None, "tool_calls": [_call("get_time", 2)]},
             {"role": "tool", "tool_call_id": "call00002", "name": "get_time", "content": "{\"time\": \"9:00\"}"},
             {"role": "assistant", "content": "It is 9:00."}]
    record = _preview(name, "strip", {"empty": turns})["empty"]
    assert record["kept"], record
    spans = _supervised(record)
    assert len(spans) == 3 and "get_weather" in spans[0] and "get_time" in spans[1], spans
    assert "get_time" not in spans[0] and spans[2] == "It is 9:00.</s>"


def test_text_beside_calls_on_a_template_that_writes_only_the_calls_is_a_policy_drop() -> None:
    turns = json.loads(json.dumps(RECORDS["tools"]))
    turns[2]["content"] = "Let me check."
    record = _preview("nemo", "strip", {"text": turns})["text"]
    assert not record["kept"] and record["reason"] == "template_drops_text_with_calls", record
    assert record["reason"] in POLICY_REASONS


def _glm(thinking: str, records: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The previewed records and the tokenizer summary under GLM-4.5's template."""
    folder = Path(tempfile.mkdtemp(prefix="dflash-glm-records-"))
    source = folder / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": rid, "messages": turns, "tools": [WEATHER]}) + "\n"
                              for rid, turns in records.items()))
    cfg = data_config(source=str(source), tokenizer=_tokenizer("glm45"), thinking=thinking)
    out = preview_samples(str(source), _tokenizer("glm45"), cfg, block_size=1, limit=len(records))
    return {r["id"]: r for r in out["records"]}, out["summary"]["tokenizer"]


@pytest.mark.parametrize("thinking", ["strip", "keep"])
def test_glm_turns_are_supervised_through_the_token_that_opens_the_next_message(thinking: str) -> None:
    """GLM-4.5's template writes no end-of-turn: the model ends a reply by writing <|user|> and a turn of tool
    calls by writing <|observation|>. A turn of calls only was not supervised at all, a turn with text and calls
    only up to its text (under keep with reasoning, up to the reasoning), no reply learnt how it stops, and the
    manifest said end_of_turn '' without a word. Now each turn runs through the token that ends it; a last reply
    gets the <|user|> the model writes after it."""
    text_then_call = json.loads(json.dumps(RECORDS["tools"]))
    text_then_call[2]["content"] = "Let me check."
    reasoned = json.loads(json.dumps(RECORDS["tools"]))
    reasoned[2].update(content="", reasoning_content="R need the weather")
    records, summary = _glm(thinking, {"calls": RECORDS["tools"], "text": text_then_call, "reasoned": reasoned})
    for rid, record in records.items():
        assert record["kept"], (rid, record)
        calls, reply = _supervised(record)
        assert "<tool_call>get_weather" in calls and calls.endswith("</tool_call><|observation|>"), (rid, calls)
        assert reply.endswith("It is 18 degrees.<|user|>"), (rid, reply)
        assert "tool_response" not in "".join(_supervised(record)), rid  # the tool's result is never learnt
    assert _supervised(records["text"])[0].strip().removeprefix("<think></think>").strip().startswith("Let me check.")
    if thinking == "keep":
        reasoning = _supervised(records["reasoned"])[0]
        assert reasoning.startswith("\n<think>R need the weather</think>\n<tool_call>"), reasoning
    assert summary["end_of_turn"] == "" and "<|user|>" in summary["turn_ends_with"] and \
        "<|observation|>" in summary["turn_ends_with"], summary
    multi = _preview("glm45", thinking)["multi"]
    assert [span.strip().removeprefix("<think></think>").strip() for span in _supervised(multi)] == [
        "A1 three<|user|>", "A2 six<|user|>"], _supervised(multi)


SUM = "Seven times twenty-eight: 7*20=140, 7*8=56, total 196."
MENTION = ("R1 writes its reasoning first and closes it with </think>; split the text on that tag and keep the part "
           "after it, e.g. answer = text.split('</think>')[-1].strip().")
REASONED = {
    "field-and-inline": [{"role": "user", "content": "What is 7 x 28?"}, {
        "role": "assistant", "reasoning_content": SUM, "content": f"<think>\n{SUM}\n</think>\n\n7 x 28 = 196."}],
    "r1-style": [{"role": "user", "content": "What is 7 x 28?"},
                 {"role": "assistant", "content": f"{SUM}\n</think>\n\n7 x 28 = 196."}],
    "mentions-tag": [{"role": "user", "content": "How do I get only the answer from DeepSeek-R1 output?"},
                     {"role": "assistant", "content": MENTION}],
    "mentions-tag-earlier": [{"role": "user", "content": "How do I get only the answer from DeepSeek-R1 output?"},
                             {"role": "assistant", "content": MENTION}, {"role": "user", "content": "Thanks."},
                             {"role": "assistant", "content": "You are welcome."}],
}
# templates that never render a last reply's reasoning: DeepSeek's render none at all; Gemma 4's only a turn of tool
# calls' (a reply's thought channel is cut from its content); Kimi K2's only after the last reply without calls
NO_LAST_REASONING = ("r1distill", "dsv31", "gemma4", "kimi")
# templates that render every reply as what follows its '</think>' (DeepSeek's), or every earlier one (QwQ's and
# Nemotron's); DeepSeek's render no reasoning at all
CUT_AT_TAG = {"r1distill": ("mentions-tag", "mentions-tag-earlier"), "dsv31": ("mentions-tag", "mentions-tag-earlier"),
              "qwq": ("mentions-tag-earlier",), "nemotron": ("mentions-tag-earlier",)}


@pytest.mark.parametrize("thinking", ["strip", "keep"])
@pytest.mark.parametrize("name", ["qwen3", "llama31", "glm45", "r1distill", "dsv31", "qwq", "nemotron", "gemma4",
                                  "minimax", "kimi", "qwen35", "glm47", "nemotron3", "seedoss", "ministral3"])
def test_inline_reasoning_is_read_once_and_a_reply_that_mentions_the_tag_is_text(name: str, thinking: str) -> None:
    """Reasoning given as a field and again inline in the content was left in the content: under strip Qwen3's
    template re-read it as reasoning and supervised it, Llama's trained it as text, under keep it came twice. A
    reply that only mentions '</think>' lost its first half (Llama), was dropped as template_mismatch (Qwen3) or
    got a made-up think block (keep). Now an inline block is always taken out (the field wins), and a '</think>'
    without '<think>' ends reasoning only on a line of its own (DeepSeek-R1's). A template that still cuts such a
    reply to what follows the tag (DeepSeek-R1's, V3.1's; QwQ's and Nemotron's in earlier turns) had the record
    kept and the cut reply trained on: it is dropped as template_rewrites_reply (policy), naming the turn."""
    records = _preview(name, thinking, REASONED)
    cut = CUT_AT_TAG.get(name, ())
    for rid in ("field-and-inline", "r1-style"):
        if name in NO_LAST_REASONING and thinking == "keep":
            assert records[rid]["reason"] == "reasoning_dropped_by_template", (name, rid, records[rid])
            continue
        assert records[rid]["kept"], (name, thinking, rid, records[rid])
        supervised = "".join(_supervised(records[rid]))
        assert supervised.count("7*20=140") == (thinking == "keep"), (name, thinking, rid, supervised)
        assert "7 x 28 = 196." in supervised and "<think>\n<think>" not in supervised, supervised
    for rid in cut:
        record = records[rid]
        assert not record["kept"] and record["reason"] == "template_rewrites_reply", (name, thinking, rid, record)
        assert "turn 1 ('assistant')" in record["detail"] and "</think>" in record["detail"], record["detail"]
        assert record["reason"] in POLICY_REASONS  # the data is sound: it never fails the stage
    for rid in ("mentions-tag", "mentions-tag-earlier"):
        if rid not in cut:
            mention = "".join(_supervised(records[rid]))
            assert MENTION in mention and "closes it with \n</think>" not in mention, (name, thinking, rid, mention)


def _tool_variants() -> dict[str, list[dict[str, Any]]]:
    """The tools record with text beside the calls, with reasoning on the turn of calls (and on the answer), and
    cut after the tool result (the model's turn still in progress)."""
    text = json.loads(json.dumps(RECORDS["tools"]))
    text[2]["content"] = "Let me check."
    reasoned = json.loads(json.dumps(RECORDS["tools"]))
    reasoned[2].update(content="", reasoning_content="R need the weather")
    answered = json.loads(json.dumps(reasoned))
    answered[4]["reasoning_content"] = "R it is mild"
    return {"text": text, "reasoned": reasoned, "answered": answered, "open": reasoned[:4]}


def test_kimi_calls_are_named_by_ids_of_the_shape_its_model_writes() -> None:
    """Kimi K2's template writes a call's id and not its name (its model writes `functions.<name>:<n>` and the
    name is read from that): the probe saw no name and every tool record was dropped as template_has_no_tools. Such
    a template now gets ids of that shape (n counts the conversation's calls), results answer their own calls, and
    an id already of that shape is kept."""
    openai = _with_ids(lambda old: f"call_{old}XYZ")
    openai["parallel"][2:4] = openai["parallel"][3:1:-1]  # results out of order: linked by id, not by place
    records = {"tools": RECORDS["tools"], "parallel": RECORDS["parallel"], "tools-openai": openai["tools"],
               "parallel-openai": openai["parallel"]}
    kimi_ids = json.loads(json.dumps(RECORDS["tools"]))
    kimi_ids[2]["tool_calls"][0]["id"] = kimi_ids[3]["tool_call_id"] = "functions.get_weather:7"
    no_ids = _with_ids(None)["parallel"]
    out = _preview("kimi", "strip", {**records, "kimi-ids": kimi_ids, "no-ids": no_ids})
    for rid, record in out.items():
        assert record["kept"], (rid, record["reason"], record["detail"])
        calls, reply = _supervised(record)
        text = "".join(t for t, _ in record["segments"])
        if rid == "kimi-ids":
            assert "<|tool_call_begin|>functions.get_weather:7<|tool_call_argument_begin|>" in calls, calls
            assert "## Return of functions.get_weather:7\n" in text
            continue
        assert calls.startswith("<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                                "<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"), (rid, calls)
        assert calls.endswith("<|tool_calls_section_end|><|im_end|>") and "call0" not in text, (rid, text)
        assert "## Return of functions.get_weather:0\n{\"temp\": 18}" in text
        if "parallel" in rid or rid == "no-ids":
            assert "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>" in calls
            assert "## Return of functions.get_time:1\n{\"time\": \"9:00\"}" in text
        assert reply.endswith("<|im_end|>") and "## Return" not in reply
    folder = Path(tempfile.mkdtemp(prefix="dflash-kimi-records-"))
    (folder / "chats.jsonl").write_text(json.dumps({"messages": RECORDS["single"]}) + "\n")
    cfg = data_config(source=str(folder), tokenizer=_tokenizer("kimi"), thinking="strip")
    identity = preview_samples(str(folder), _tokenizer("kimi"), cfg, block_size=1, limit=1)["summary"]["tokenizer"]
    assert identity["tool_call_ids"].startswith("functions.<name>:<n>") and identity["renders_tools"], identity


@pytest.mark.parametrize("name", ["gemma4", "minimax", "kimi", "qwen3", "glm45", "qwen35", "glm47", "nemotron3",
                                  "seedoss", "ministral3"])
def test_reasoning_of_the_turn_in_progress_is_kept_or_the_record_dropped(name: str) -> None:
    """Under thinking keep, a turn of tool calls after the last user turn is the model's own turn in progress: its
    reasoning must be learnt with it. Kimi K2's template renders reasoning only after the last reply without calls
    (never in a finished conversation), so the turn of calls was supervised as '<think></think>' and its calls,
    the reasoning lost without a word; it is dropped now, naming the turn. Gemma 4's renders a turn of calls'
    reasoning (its thought channel), MiniMax's after the '<think>\\n' its generation prompt pre-fills, and both
    drop a record whose last reply's reasoning they cannot render (Gemma 4) or keep it (MiniMax)."""
    out = _preview(name, "keep", _tool_variants())
    if name == "kimi":
        for rid in ("reasoned", "answered"):
            assert not out[rid]["kept"] and out[rid]["reason"] == "reasoning_dropped_by_template", (rid, out[rid])
            assert "turn 2 ('assistant')" in out[rid]["detail"] and "strip" in out[rid]["detail"], out[rid]["detail"]
        calls = _supervised(out["open"])[0]  # still in progress: the template renders its reasoning
        assert calls.startswith("<think>R need the weather</think><|tool_calls_section_begin|>"), calls
        return
    opener = {"gemma4": "<|channel>thought\nR need the weather<channel|><|tool_call>call:get_weather{",
              "minimax": "R need the weather\n</think>\n\n\n<minimax:tool_call>\n<invoke name=\"get_weather\">",
              "qwen3": "<think>\nR need the weather\n</think>\n\n<tool_call>",
              "glm45": "\n<think>R need the weather</think>\n<tool_call>get_weather",
              # the generation prompt pre-fills the opener (<think>\n, <think>): the calls follow the reasoning
              "qwen35": "R need the weather\n</think>\n\n<tool_call>\n<function=get_weather>",
              "glm47": "R need the weather</think><tool_call>get_weather",
              "nemotron3": "R need the weather\n</think>\n<tool_call>\n<function=get_weather>",
              "seedoss": "<seed:think>R need the weather</seed:think>\n<seed:tool_call>\n<function=get_weather>",
              "ministral3": "[THINK]R need the weather[/THINK][TOOL_CALLS]get_weather[ARGS]"}[name]
    for rid in ("reasoned", "open", "answered"):
        if rid == "answered" and name == "gemma4":  # a reply's thought channel is cut from its content
            assert not out[rid]["kept"] and out[rid]["reason"] == "reasoning_dropped_by_template", out[rid]
            assert "the last reply" in out[rid]["detail"], out[rid]["detail"]
            continue
        assert out[rid]["kept"], (rid, out[rid])
        calls = _supervised(out[rid])[0]
        assert calls.startswith(opener), (rid, calls)
        assert "Weather in Paris?" not in "".join(_supervised(out[rid])) and "temp" not in calls
    if name != "gemma4":
        answer = _supervised(out["answered"])[-1]
        assert "R it is mild" in answer and answer.rstrip("\n").endswith(
            SPECS[name][3] if name not in ("glm45", "glm47") else "<|user|>"), answer


def test_gemma4_writes_a_turns_text_after_its_calls_so_such_a_turn_is_a_policy_drop() -> None:
    """Gemma 4's template writes a model turn's calls first and its text after them (where a turn goes on after
    the tool results in Gemma's own format); a turn whose text precedes its calls, as in OpenAI-style data, was
    kept with the text supervised after the calls, which the model never writes there. It is dropped as
    template_rewrites_reply (policy); the templates that write the text first keep it, before the calls."""
    for thinking in ("strip", "keep"):
        record = _preview("gemma4", thinking, _tool_variants())["text"]
        assert not record["kept"] and record["reason"] == "template_rewrites_reply", record
        assert "turn 2 ('assistant')" in record["detail"] and "after its tool calls" in record["detail"]
        assert record["reason"] in POLICY_REASONS
    think = json.loads(json.dumps(_tool_variants()["text"]))  # a tool named like a special token's word
    think[2]["tool_calls"][0]["function"]["name"] = think[3]["name"] = "think"
    for name in ("qwen3", "glm45", "minimax", "kimi", "dsv31", "qwen35", "apertus", "ministral3"):
        for thinking in ("strip", "keep"):
            records = _preview(name, thinking, {**_tool_variants(), "think": think})
            for rid in ("text", "think"):
                assert records[rid]["kept"], (name, thinking, rid, records[rid])
                calls = _supervised(records[rid])[0]
                assert calls.index("Let me check.") < calls.rindex(think[2]["tool_calls"][0]["function"]["name"]
                                                                   if rid == "think" else "get_weather"), calls


@pytest.mark.parametrize("thinking", ["strip", "keep"])
def test_what_gemma4_and_minimax_prompts_pre_fill_or_switch_on_is_never_supervised(thinking: str) -> None:
    """Gemma 4's generation prompt pre-fills an empty thought channel with thinking off, and thinking on writes
    '<|think|>' into the system turn; MiniMax's always pre-fills '<think>\\n'. None of it is learnt: a reply is
    supervised from where the model starts writing, through its end-of-turn."""
    gemma = _preview("gemma4", thinking)
    for rid in ("single", "multi"):
        spans = _supervised(gemma[rid])
        assert all(span.startswith(("Hello", "A1", "A2")) and span.endswith("<turn|>") for span in spans), spans
        assert not any(tag in "".join(spans) for tag in ("<|think|>", "<|channel>", "<|turn>")), spans
    assert ("<|think|>" in "".join(t for t, _ in gemma["single"]["segments"])) == (thinking == "keep")
    minimax = _preview("minimax", thinking)
    assert [span for span in _supervised(minimax["multi"])] == ["A1 three[e~[", "A2 six[e~["]
    reason = _supervised(minimax["reason"])
    if thinking == "keep":  # the last reply's reasoning follows the pre-filled '<think>\n'; history's is not shown
        assert reason == ["A1 three[e~[", "R2 think two\n</think>\n\nA2 six[e~["], reason
    else:
        assert reason == ["A1 three[e~[", "A2 six[e~["], reason


def test_glm45_a_last_turn_of_calls_ends_with_observation_and_a_last_user_turn_gets_nothing() -> None:
    """GLM-4.5's template writes no end-of-turn: the model ends a turn of calls by writing <|observation|> (not
    <|user|>), and that is appended and supervised after a record's last turn of calls (xlam's pairs end so); a
    record that ends with a user turn gets no stop appended (the model writes none after a prompt)."""
    records = {"calls-last": RECORDS["tools"][:3],
               "user-last": [*RECORDS["single"], {"role": "user", "content": "Q2 total"}]}
    out = _preview("glm45", "strip", records)
    calls = out["calls-last"]
    assert calls["kept"], calls
    assert _supervised(calls)[-1].endswith("</tool_call><|observation|>"), _supervised(calls)
    user = out["user-last"]
    assert user["kept"], user
    assert "".join(t for t, _ in user["segments"]).endswith("Q2 total/nothink"), user["segments"][-3:]


def test_kimi_call_ids_count_the_calls_of_the_whole_conversation() -> None:
    """Kimi K2's model numbers its calls across the conversation (functions.<name>:<n>): the call of a second
    turn of calls is :1, not :0 again (two calls named :0 would link the second result to the first call)."""
    turns = [{"role": "user", "content": "Weather, then time in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", 1)]},
             {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 18}"},
             {"role": "assistant", "content": None, "tool_calls": [_call("get_time", 2)]},
             {"role": "tool", "tool_call_id": "call00002", "content": "{\"time\": \"9:00\"}"},
             {"role": "assistant", "content": "It is 18 degrees at 9:00."}]
    record = _preview("kimi", "strip", {"two-turns": turns})["two-turns"]
    assert record["kept"], record
    text = "".join(t for t, _ in record["segments"])
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text, text
    assert "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>" in text, text
    assert "## Return of functions.get_time:1\n{\"time\": \"9:00\"}" in text


def test_apertus_calls_whose_results_follow_in_the_same_turn_are_learnt_through_their_closing_token() -> None:
    """Apertus writes a turn of calls, their results and the reply after them as one assistant turn
    ('<|tools_prefix|>[...]<|tools_suffix|>[results]reply<|assistant_end|>'): no end-of-turn and no header follows
    the calls, so a turn of calls only was an empty span: the record was kept and its calls never learnt. The
    calls now run through the last special token before the result; the result is never learnt."""
    for thinking in ("strip", "keep"):
        records = _preview("apertus", thinking, {**RECORDS, "open": RECORDS["tools"][:4]})
        for rid in ("tools", "parallel", "open"):
            assert records[rid]["kept"], (thinking, rid, records[rid])
            spans = _supervised(records[rid])
            assert spans[0].startswith('<|tools_prefix|>[{"get_weather": {"city": "Paris"}}') and spans[0].endswith(
                "]<|tools_suffix|>"), (thinking, rid, spans)
            assert not any("temp" in span or "9:00\"" in span for span in spans), (thinking, rid, spans)
        assert _supervised(records["tools"])[1] == "It is 18 degrees.<|assistant_end|>"


_APERTUS_CALL = """{{- '{"' + function.name + '": ' + function.arguments|tojson + '}' }}"""


def test_calls_each_closed_by_the_same_token_are_learnt_through_the_last_one() -> None:
    """An Apertus variant that also wraps each call in <|tools_prefix|>...<|tools_suffix|>: the calls end at the
    last special token before the result, not the first of the tokens repeated there (which cut the calls after
    the first one's closing token, leaving the rest unlearnt)."""
    each = (_APERTUS_CALL, _APERTUS_CALL.replace("'{\"'", "'<|tools_prefix|>{\"'").replace("+ '}' }}",
                                                                                      "+ '}<|tools_suffix|>' }}"))
    records = _preview("apertus", "strip", edit=each)
    for rid in ("tools", "parallel"):
        assert records[rid]["kept"], records[rid]
        calls = _supervised(records[rid])[0]
        assert calls.startswith("<|tools_prefix|>[<|tools_prefix|>") and calls.endswith(
            "}<|tools_suffix|>]<|tools_suffix|>"), (rid, calls)
        assert "temp" not in calls
    assert "get_time" in _supervised(records["parallel"])[0]


def test_calls_closed_by_no_special_token_learn_nothing_of_the_result_after_them() -> None:
    """An Apertus variant whose calls are written as plain '[...]' (no <|tools_prefix|>/<|tools_suffix|>) with the
    results right after them: where the calls end cannot be told from the result's own '[', so the turn of calls
    supervises nothing past its own text (not through to the result), and the reply after the results is learnt."""
    plain = ("{%- set tool_calls_token = '<|tools_prefix|>' -%}\n{%- set end_tool_calls_token = '<|tools_suffix|>' -%}",
             "{%- set tool_calls_token = '' -%}\n{%- set end_tool_calls_token = '' -%}")
    first = _preview("apertus", "strip", {"tools": RECORDS["tools"]}, edit=plain)["tools"]
    assert first["kept"], first
    assert _supervised(first) == ["It is 18 degrees.<|assistant_end|>"]


def test_reasoning_read_as_a_thinking_chunk_is_written_as_the_template_writes_it() -> None:
    """Ministral 3 Reasoning's template reads reasoning only from a content chunk {'type': 'thinking'} and writes it
    as '[THINK]...[/THINK]'; it was taken for gpt-oss's `thinking` field, which it never reads, so under thinking
    keep every reasoned record was dropped as reasoning_dropped_by_template. The reasoning now goes inline between
    the marks the template writes a thinking chunk with; after a pre-filled nothing the model writes [THINK]."""
    reason = _preview("ministral3", "keep")["reason"]
    assert reason["kept"], reason
    assert _supervised(reason) == ["[THINK]R1 think one[/THINK]A1 three</s>", "[THINK]R2 think two[/THINK]A2 six</s>"]
    assert "<think>" not in "".join(t for t, _ in reason["segments"])
    strip = _preview("ministral3", "strip")["reason"]
    assert _supervised(strip) == ["A1 three</s>", "A2 six</s>"], strip
    from dflash_core.data.template import reasoning_field
    assert reasoning_field((FIXTURES / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text()) is None
    assert reasoning_field((FIXTURES / "openai-gpt-oss-120b.jinja").read_text()) == "thinking"


def test_kimi_k3s_turns_are_learnt_through_their_whole_closing_and_its_thinking_switch_is_set() -> None:
    """Kimi K3 closes a turn with '<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>': only its first
    token was learnt (the model writes the rest before it stops), and a turn of calls, which comes after the empty
    response's '<|close|>', was learnt as that token alone, calls left out. Its template reads the switch as
    `thinking` (on by default): with thinking strip every reply was rendered with an empty think block."""
    closing = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    strip = _preview("kimi3", "strip")
    assert _supervised(strip["single"]) == [f"Hello! How can I help?{closing}"]
    calls, reply = _supervised(strip["tools"])
    assert calls.startswith("<|close|>response<|sep|><|open|>tools<|sep|>") and 'tool="get_weather"' in calls
    assert calls.endswith("<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>") and "temp" not in calls
    assert reply == f"It is 18 degrees.{closing}"
    assert "think" not in "".join(t for t, _ in strip["multi"]["segments"])
    kept = _supervised(_preview("kimi3", "keep")["reason"])
    assert kept[-1].startswith("R2 think two<|close|>think<|sep|><|open|>response<|sep|>A2 six"), kept


# what a generation prompt rendered with thinking off / on holds, for templates with a switch of their own (None:
# nothing but the absence of the off marker)
OWN_SWITCH = {
    "seedoss": ("thinking budget is 0", None),
    "cohere2moe": ("<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>", "<|CHATBOT_TOKEN|><|START_THINKING|>"),
    "minimax3": ("ai\n</mm:think>", "ai\n<mm:think>"),
    "hy3": ("reasoning_effort:no_think", "reasoning_effort:high"),
    "qwen3": ("<think>\n\n</think>\n\n", "<|im_start|>assistant\n"),
}


@pytest.mark.parametrize("name", sorted(OWN_SWITCH))
def test_a_templates_own_reasoning_switch_follows_data_thinking(name: str) -> None:
    """Seed-OSS reads thinking_budget (0 is off), Cohere2 MoE `reasoning`, MiniMax-M3 thinking_mode and Hy3
    reasoning_effort (no_think | low | high), not enable_thinking: told only the common names, the first three
    rendered thinking on under data.thinking strip, and Hy3 thinking off under keep, in training records, in
    regenerate's requests and in eval's prompts alike."""
    from transformers import AutoTokenizer

    from dflash_core.model.evaluate import render_prompt

    tok = AutoTokenizer.from_pretrained(_tokenizer(name))
    chat = [{"role": "user", "content": "Q1 count"}]
    off, on = (tok.decode(render_prompt(tok, chat, thinking)) for thinking in (False, True))
    off_marker, on_marker = OWN_SWITCH[name]
    assert off_marker in off and off_marker not in on, (off[-200:], on[-200:])
    assert on_marker is None or on_marker in on, on[-200:]
    rendered = {thinking: "".join(t for t, _ in _preview(name, thinking)["multi"]["segments"])
                for thinking in ("strip", "keep")}
    if name in ("seedoss", "hy3"):  # the switch shows in the records' system prompt
        marker = "thinking budget is 0" if name == "seedoss" else "reasoning_effort:no_think"
        assert marker in rendered["strip"] and marker not in rendered["keep"]
    if name == "minimax3":
        assert "thinking mode: disabled" in rendered["strip"] and "thinking mode: enabled" in rendered["keep"]


def test_a_generation_prompt_the_template_writes_unasked_is_learnt_and_anchors_a_turn_of_calls() -> None:
    """Command R7B's tool_use template ends every render with its generation prompt, asked or not: nothing was
    learnt as the prompt, and every turn of calls (which opens with it) was a template_mismatch. The prompt is what
    follows a last reply's end-of-turn; a turn of calls is learnt from '<|START_ACTION|>' through its end-of-turn,
    and the prompt written after the last turn is not supervised."""
    prompt = "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>"
    out = _preview("commandr7b", "strip")
    calls, reply = _supervised(out["tools"])
    assert calls.startswith("<|START_ACTION|>[") and '"tool_name": "get_weather"' in calls, calls
    assert calls.endswith("]<|END_ACTION|><|END_OF_TURN_TOKEN|>") and "temp" not in calls, calls
    assert reply == "It is 18 degrees.<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"
    text, supervised = out["tools"]["segments"][-1]
    assert text.endswith(prompt) and not supervised
    assert _supervised(out["single"]) == ["Hello! How can I help?<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"]


CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _named(templates: dict[str, str]) -> str:
    """The qwen3 test tokenizer with named chat templates instead of its one, saved to a folder."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_tokenizer("qwen3"))
    tok.chat_template = templates
    out = tempfile.mkdtemp(prefix="dflash-named-templates-")
    tok.save_pretrained(out)
    return out


def test_named_templates_render_and_mask_each_record_under_the_one_transformers_picks() -> None:
    """A tokenizer with named templates (Hermes 3, Mixtral 8x22B, Command R: 'default' and 'tool_use'): a record
    with tools is rendered with tool_use, and the turns it writes are placed by what tool_use's own generation
    prompt pre-fills (here Qwen3's '<think>\\n\\n</think>\\n\\n' with thinking off: learnt from the default's
    prompts, it was supervised); a chat without tools is rendered with default. Eval's and regenerate's switch
    read the default template."""
    from transformers import AutoTokenizer

    from dflash_core.data.template import template_text

    qwen3 = (FIXTURES / "Qwen-Qwen3-0.6B.jinja").read_text()
    folder = _named({"default": CHATML, "tool_use": qwen3})
    source = Path(tempfile.mkdtemp(prefix="dflash-named-records-")) / "chats.jsonl"
    source.write_text("".join(json.dumps({"id": rid, "messages": RECORDS[rid], **(
        {"tools": [WEATHER, TIME]} if rid == "tools" else {})}) + "\n" for rid in ("tools", "multi")))
    cfg = data_config(source=str(source), tokenizer=folder, thinking="strip", max_length=65536)
    out = preview_samples(str(source), folder, cfg, block_size=1, limit=2)
    records = {r["id"]: r for r in out["records"]}
    calls, reply = _supervised(records["tools"])
    assert calls.startswith("<tool_call>\n") and reply == "It is 18 degrees.<|im_end|>", (calls, reply)
    assert "<think>" not in "".join(t for t, _ in records["multi"]["segments"])  # ChatML, not Qwen3's
    assert _supervised(records["multi"]) == ["A1 three<|im_end|>", "A2 six<|im_end|>"]
    identity = out["summary"]["tokenizer"]
    assert identity["chat_templates"] == ["default", "tool_use"]
    assert identity["generation_prompts"] == ["<|im_start|>assistant\n"]
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in identity["tool_use"]["generation_prompts"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert template_text(tok) == CHATML and template_text(tok, tools=True) == qwen3
    assert template_text(AutoTokenizer.from_pretrained(_named({"default": CHATML})), tools=True) == CHATML


def test_named_templates_without_a_default_are_refused_saying_what_to_name() -> None:
    from dflash_core.data.errors import TemplateError
    from dflash_core.data.template import chat_encoder, load_tokenizer

    folder = _named({"chat": CHATML, "tool_use": CHATML})
    with pytest.raises(TemplateError, match=r"has chat templates named \['chat', 'tool_use'\], none 'default': "
                                            r"transformers and the serving engines render a chat without tools"):
        chat_encoder(load_tokenizer(folder), folder)


def test_a_shared_switch_name_with_other_values_is_not_sent() -> None:
    """gpt-oss reads reasoning_effort too, as low | medium | high with no off: it is left to its default, as is
    Muse Glimmer's reasoning_strength; a template jinja cannot parse gets the common names only."""
    from dflash_core.data.template import template_variables, thinking_switch

    for file in ("openai-gpt-oss-120b", "muse-glimmer"):
        template = (FIXTURES / f"{file}.jinja").read_text()
        assert thinking_switch(False, template) == {"enable_thinking": False, "thinking": False}
    assert template_variables("{% if x %}") == frozenset()
    assert thinking_switch(True, "{% if x %}") == {"enable_thinking": True, "thinking": True}
    seed = (FIXTURES / "ByteDance-Seed-Seed-OSS-36B-Instruct.jinja").read_text()
    assert thinking_switch(True, seed) == {"enable_thinking": True, "thinking": True}  # its default: unlimited
    assert thinking_switch(False, seed)["thinking_budget"] == 0


def test_a_turn_of_calls_written_after_its_closed_empty_reply_is_learnt_with_its_calls() -> None:
    """GigaChat 3 writes a turn of calls as an empty reply closed by '<|message_sep|>', then a 'function call'
    message: the span ended at that first '<|message_sep|>', so the calls were never learnt."""
    calls, reply = _supervised(_preview("gigachat3", "strip")["tools"])
    assert calls.startswith("<|message_sep|>") and '"name": "get_weather"' in calls, calls
    assert calls.endswith('"city": "Paris"}}<|message_sep|>') and reply == "It is 18 degrees.<|message_sep|>"


def test_calls_written_one_message_each_are_learnt_from_the_first() -> None:
    """Muse Glimmer writes each parallel call as a message of its own ('<|start|>assistant to=get_weather...<|eom|>
    <|start|>assistant to=get_time...<|eot|>'): the span started at the last header, the first call left out."""
    calls, reply = _supervised(_preview("glimmer", "strip")["parallel"])
    assert calls.startswith(" to=get_weather<|message|>") and "<|eom|><|start|>assistant to=get_time" in calls
    assert calls.endswith("</atem:function_calls><|eot|>") and reply == " to=user<|message|>It is 18 degrees at 9:00.<|eot|>"


def test_a_turn_of_calls_whose_header_is_neither_the_prompt_nor_a_replys_is_placed_on_what_they_share() -> None:
    """Cohere2 MoE's generation prompt is '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>', a
    reply in history '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_TEXT|>...', a turn of calls
    '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_ACTION|>[...]': neither header is before the calls, and every
    tool record was dropped as template_mismatch (failing the stage). The calls are learnt from the
    '<|START_ACTION|>' the model writes after the header they share; a reply in history still from its text.
    DeepSeek-V3.2's turn of calls opens with the '<｜Assistant｜></think>' of a reply in history (the prompt with
    thinking off: '<｜Assistant｜><think></think>'): learnt from after it."""
    for thinking in ("strip", "keep"):
        records = _preview("cohere2moe", thinking)
        calls, reply = _supervised(records["parallel"])
        assert calls.startswith("<|START_ACTION|>[") and '"tool_name": "get_time"' in calls, calls
        assert calls.endswith("]<|END_ACTION|><|END_OF_TURN_TOKEN|>") and "temp" not in calls, calls
        assert reply == "It is 18 degrees at 9:00.<|END_TEXT|><|END_OF_TURN_TOKEN|>", reply
        assert _supervised(records["multi"]) == ["A1 three<|END_TEXT|><|END_OF_TURN_TOKEN|>",
                                                 "A2 six<|END_TEXT|><|END_OF_TURN_TOKEN|>"]
    calls, reply = _supervised(_preview("dsv32", "strip")["tools"])
    assert calls.startswith("\n\n<｜DSML｜function_calls>") and 'invoke name="get_weather"' in calls, calls
    assert calls.endswith("</｜DSML｜function_calls><｜end▁of▁sentence｜>") and reply == "It is 18 degrees.<｜end▁of▁sentence｜>"


def _multi_step(result: str, second: str) -> list[dict[str, Any]]:
    """Calls, their result, calls again, their result, the answer: multi-step tool use."""
    return [{"role": "user", "content": "Weather twice?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", 1)]},
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": result},
            {"role": "assistant", "content": None, "tool_calls": [_call(second, 2)]},
            {"role": "tool", "tool_call_id": "call00002", "name": second, "content": '{"temp": 18}'},
            {"role": "assistant", "content": "It is 18 degrees."}]


@pytest.mark.parametrize("thinking", ["strip", "keep"])
@pytest.mark.parametrize("name", sorted(set(SPECS) - {"dsv32"}))  # llama.cpp's V3.2 calls open with text markers
def test_each_turn_of_multi_step_tool_use_is_placed_on_its_own_calls(name: str, thinking: str) -> None:
    """A second turn of calls after a result: DeepSeek V3.1 writes no header after a tool result
    ('<｜tool▁output▁end｜><｜tool▁calls▁begin｜>...'), gpt-oss and Apertus an empty result with no text to bound
    the turn before (gpt-oss's first turn ran to the last header before the next text, Apertus' to the last
    special token: both over the second turn), Kimi K3 and Muse Glimmer name the tool in a result's header. Every
    such record was a template_mismatch, which fails the stage."""
    records = _preview(name, thinking, {"same": _multi_step('{"temp": 17}', "get_weather"),
                                        "empty": _multi_step("", "get_weather"),
                                        "other": _multi_step('{"temp": 17}', "get_time")})
    for rid, record in records.items():
        if not record["kept"]:
            assert record["reason"] in POLICY, (name, thinking, rid, record["reason"], record["detail"])
            continue
        *calls, reply = _supervised(record)
        assert len(calls) == 2 and "It is 18 degrees." in reply and "temp" not in reply, (name, rid, calls, reply)
        for turn in calls:
            assert turn.count("Paris") == 1 and "temp" not in turn, (name, thinking, rid, turn)
