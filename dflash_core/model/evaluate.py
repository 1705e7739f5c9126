"""`dflash eval`: acceptance length (tau) of a drafter by the public DFlash benchmark's protocol.

Every turn of an instance is one response: the chat so far is rendered with the chat template (thinking off
unless asked), tokenized with `tokenizer.encode` as z-lab/dflash `benchmark.py` does, decoded with speculative
decoding (greedy, or the target's tokens sampled at `temperature` as its `--temperature` does) until an
eos/end-of-turn token or `max_new_tokens`, and the answer (decoded with
`skip_special_tokens=True`) is fed back as the assistant turn before the next user turn. tau is the mean over
responses of each response's mean acceptance length (DFLASH_SPEC.md "Evaluation"); `tau_pooled` is the mean
over all decoding steps; `tau_server` the mean, over responses with at least one verify pass, of new tokens
per verify pass (the figure SGLang reports per request, which the benchmark's server backend averages).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dflash_core.data.template import for_template, template_text, thinking_switch
from dflash_core.model.decoding import (
    GREEDY,
    Drafter,
    ResizedBlocks,
    TokenPicker,
    greedy_generate,
    speculative_generate,
)
from dflash_core.model.export import load_dflash
from dflash_core.model.instances import (
    EvalDataError,
    Instance,
    as_instances,
    check_limit,
    messages,
    prompt_turns,
    read_instances,
)
from dflash_core.model.suites import load_suite
from dflash_core.model.target import TargetModel, load_target

__all__ = [
    "EvalDataError",
    "Instance",
    "Response",
    "evaluate",
    "greedy_generate",
    "histogram",
    "mean_of_means",
    "prompt_turns",
    "render_prompt",
    "speculative_generate",
    "summarize",
    "tau",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


def tau(acceptance_lengths: Sequence[int]) -> float:
    """Mean acceptance length over decoding steps (NaN with no steps)."""
    return sum(acceptance_lengths) / len(acceptance_lengths) if acceptance_lengths else float("nan")


def mean_of_means(per_response: Sequence[Sequence[int]]) -> float | None:
    """The benchmark's tau: the mean over responses of each one's mean acceptance length.

    A response with no decoding step (max_new_tokens 0) has no mean and is left out.
    """
    means = [tau(lengths) for lengths in per_response if lengths]
    return sum(means) / len(means) if means else None


def histogram(acceptance_lengths: Sequence[int], block_size: int) -> dict[str, int]:
    """Counts of acceptance lengths 1..B (JSON keys)."""
    return {str(n): sum(1 for x in acceptance_lengths if x == n) for n in range(1, block_size + 1)}


@dataclass(frozen=True)
class Response:
    """One decoded turn: its acceptance lengths, its new tokens and decoding seconds (from after the prefill and
    the first draft pass, as the published benchmark times it), and the same of target-only greedy decoding when
    the baseline ran."""

    suite: str
    instance: int
    lengths: list[int]
    tokens: int
    seconds: float
    baseline_tokens: int | None = None
    baseline_seconds: float | None = None
    matches_baseline: bool | None = None
    past_context: bool = False  # prompt + its new tokens exceed the target's max_position_embeddings
    server_passes: int | None = None  # the verify passes a server makes for it (sglang_passes); None: every step


def sglang_passes(lengths: Sequence[int], max_new_tokens: int, first_is_stop: bool) -> int:
    """The verify passes SGLang runs for a response of these acceptance lengths: none when the prefill's token
    ends it (a stop token, or max_new_tokens 1), then one while fewer than max_new_tokens are committed (the
    reference loop also steps once with exactly max_new_tokens committed, which SGLang does not)."""
    committed, passes = 1, 0
    for n in [] if first_is_stop else lengths:
        if committed >= max_new_tokens:
            break
        passes, committed = passes + 1, committed + n
    return passes


def prompt_ids(responses: Sequence[Response], suites: Mapping[str, Sequence[Instance]]) -> list[int]:
    """Each response's prompt as a number: the same for responses to the same system prompt and user turns so
    far (a row server sampling wraps round to, a prompt listed twice or in two suites, the first turn of two
    conversations that open alike). Greedy decoding answers such prompts alike, so they repeat one measurement,
    and the paired gain counts them as one."""
    ids: dict[tuple[str | None, tuple[str, ...]], int] = {}
    turns: dict[tuple[str, int], int] = {}
    out = []
    for r in responses:
        turn = turns[r.suite, r.instance] = turns.get((r.suite, r.instance), -1) + 1
        instance = suites[r.suite][r.instance]
        out.append(ids.setdefault((instance.system, instance.turns[: turn + 1]), len(ids)))
    return out


def summarize(responses: Sequence[Response], block_size: int) -> dict[str, Any]:
    """The figures of a list of responses: tau (mean of means), tau_pooled, histogram, throughput."""
    pooled = [n for r in responses for n in r.lengths]
    passes = [(r.tokens, len(r.lengths) if r.server_passes is None else r.server_passes) for r in responses]
    # a request SGLang verified nothing for (its first token ended it) carries no spec_accept_length in the
    # SGLang builds z-lab pins, and the public benchmark averages only the requests that carry one
    per_request = [tokens / n for tokens, n in passes if n]
    out: dict[str, Any] = {
        "tau": mean_of_means([r.lengths for r in responses]),
        "tau_pooled": tau(pooled) if pooled else None,
        # SGLang's per-request spec_accept_length (completion tokens, the prefill's first token among them, over
        # verify passes), averaged over the responses that have one, as the public benchmark's server backend
        "tau_server": sum(per_request) / len(per_request) if per_request else None,
        "instances": len({(r.suite, r.instance) for r in responses}),
        "responses": len(responses),
        "tokens_generated": sum(r.tokens for r in responses),
        "histogram": histogram(pooled, block_size),
        "tokens_per_s": _throughput([(r.tokens, r.seconds) for r in responses]),
    }
    if past := sum(r.past_context for r in responses):  # decoded and counted, as the reference does; said
        out["past_context"] = past
    timed = [r for r in responses if r.baseline_seconds is not None]
    if timed:
        out["baseline_tokens_per_s"] = _throughput([(r.baseline_tokens or 0, r.baseline_seconds or 0.0)
                                                     for r in timed])
        # per-token time of target-only greedy over that of speculative decoding, each the mean over responses
        # of one response's decoding seconds per new token (the benchmark's "Decoding speedup")
        spec = _throughput([(r.tokens, r.seconds) for r in timed])
        base = out["baseline_tokens_per_s"]
        out["speedup"] = spec / base if spec and base else None
        if all(r.matches_baseline is not None for r in timed):  # greedy: the outputs must be the same
            out["baseline_matches"] = sum(bool(r.matches_baseline) for r in timed)
    return out


def _throughput(timings: Sequence[tuple[int, float]]) -> float | None:
    """1 / the mean over responses of seconds per new token (responses without a token left out), as the
    benchmark reports throughput."""
    per_token = [seconds / tokens for tokens, seconds in timings if tokens > 0]
    mean = sum(per_token) / len(per_token) if per_token else 0.0
    return 1 / mean if mean > 0 else None


def render_prompt(tokenizer: PreTrainedTokenizerBase, chat: list[dict[str, str]], thinking: bool) -> list[int]:
    """Chat template with the generation prompt, then `tokenizer.encode` (special tokens added, as the
    reference does: Qwen3 adds none; a tokenizer that adds a BOS gets a second one, in the reference too).
    The reasoning switch goes under every name templates read (thinking_switch; Qwen3's `enable_thinking`, the
    reference's, DeepSeek-V3.1's `thinking`, and the template's own where it reads one); one that cannot render a
    system turn gets it folded into the first user turn, as tokenize does by default (data.system_turn auto)."""
    text = tokenizer.apply_chat_template(for_template(tokenizer, chat), tokenize=False, add_generation_prompt=True,
                                         **thinking_switch(thinking, template_text(tokenizer)))
    return tokenizer.encode(text)


def _stop_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> set[int]:
    """The tokenizer's eos, the generation config's eos ids, and the end-of-turn token when there is one."""
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    return ids


def _timed(fn: Callable[[Callable[[], None]], T], device: torch.device) -> tuple[T, float]:
    """(result, wall seconds of its decoding): `fn` gets a callback that it calls where decoding starts (after
    the prefill and, for speculative decoding, the first draft pass), and the seconds run from that call to the
    end, the device drained at both ends so GPU work is inside the window (the published benchmark's decode
    time; from the start of `fn` if it never calls it)."""
    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    start = [now()]
    result = fn(lambda: start.__setitem__(0, now()))
    return result, now() - start[0]


SAMPLE_SHUFFLES = ("random", "datasets", "server")


def sample_instances(items: list[Instance], sample: int, seed: int = 0, shuffle: str = "random") -> list[Instance]:
    """The `sample` instances the public benchmark evaluates with `--max-samples sample`: its current script
    (`shuffle` random) shuffles the whole list with Python's `random` seeded `seed` (0 in its transformers
    backend) and takes the first ones; the paper's script (`shuffle` datasets) took `Dataset.shuffle(seed=0)
    .select(range(sample))`, a NumPy default_rng permutation. A list of at most `sample` is kept whole and in
    order, as in both. `shuffle` server takes what its SGLang/vLLM backends measure with `--num-prompts sample
    --concurrency 1` (the published commands of its Qwen3.5/3.6, gpt-oss and Kimi drafters): row k % len for k
    in 1..sample (row 0 is the warm-up request; a suite shorter than that wraps round, so rows repeat), first
    turn only; `seed` is not used."""
    check_limit(sample)
    if shuffle not in SAMPLE_SHUFFLES:
        raise EvalDataError(f"sample shuffle {shuffle!r}: choose from {', '.join(SAMPLE_SHUFFLES)}")
    if shuffle == "server" and items:
        return [replace(items[k % len(items)], turns=items[k % len(items)].turns[:1]) for k in range(1, sample + 1)]
    if len(items) <= sample:
        return items
    if shuffle == "datasets":
        return [items[int(i)] for i in np.random.default_rng(seed).permutation(len(items))[:sample]]
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    return shuffled[:sample]


def _suites(
    data: str | None, instances: Sequence[Any] | None, benches: Mapping[str, str | None] | Sequence[str],
    limit: int | None, sample: int | None = None, sample_seed: int = 0, sample_shuffle: str = "random",
) -> dict[str, list[Instance]]:
    """{suite name: its first `limit` instances, or the reference's `sample`} from a data URI, an in-memory
    list and named benchmarks."""
    if limit is not None and sample is not None:
        raise EvalDataError("give limit (the first N instances) or sample (the reference's N), not both")
    suites: dict[str, list[Instance]] = {}
    if data is not None:
        suites[data] = read_instances(data, limit)
    if instances is not None:
        suites["instances"] = as_instances(instances, limit)
    named = benches if isinstance(benches, Mapping) else dict.fromkeys(benches)
    for name, source in named.items():
        suites[name] = load_suite(name, limit, source)
    if not suites or not any(suites.values()):
        raise EvalDataError("nothing to evaluate: give data (a file), instances, or benches (named suites)")
    if sample is not None:
        suites = {name: sample_instances(items, sample, sample_seed, sample_shuffle) for name, items in suites.items()}
    return suites


def evaluate(
    target: str | TargetModel,
    drafter_dir: str | Drafter,
    tokenizer: str | PreTrainedTokenizerBase,
    data: str | None = None,
    instances: Sequence[Any] | None = None,
    benches: Mapping[str, str | None] | Sequence[str] = (),
    limit: int | None = None,
    max_new_tokens: int = 2048,
    sample: int | None = None,
    sample_seed: int = 0,
    sample_shuffle: str = "random",
    thinking: bool = False,
    temperature: float = 0.0,
    seed: int = 0,
    block_size: int | None = None,
    kv_cache: bool = True,
    baseline: bool = False,
    device: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    per_response: bool = False,
) -> dict[str, Any]:
    """Speculative decoding of every turn of every instance -> {tau, tau_pooled, instances, responses,
    tokens_generated, histogram, tokens_per_s, ...}; `per_response` adds each response's mean acceptance
    length in decoding order (None for a response with no step) and per_response_prompts (prompt_ids), to pair
    two drafters on the same prompts.

    Paths or loaded objects for target, drafter and tokenizer. Instances come from `data` (a file, glob or
    folder of benchmark or chat records), `instances` (Instance, {"turns": [...]} or chat records) and
    `benches` (suite names, or {name: local copy or None}); `limit` takes the first N of each, `sample` the
    N the public benchmark's `--max-samples N` takes (sample_instances: `sample_shuffle` random for its current
    script, datasets for the paper's). `temperature` > 0 samples the target's tokens (the drafts stay greedy), the
    k-th response from a generator seeded `seed + k`, so two drafters' k-th responses start from the same draws.
    `block_size` drafts blocks of that size instead of the drafter's own (the summary then adds
    trained_block_size).
    With `baseline`, target-only decoding (KV cache, same temperature) is timed on the same prompts:
    baseline_tokens_per_s, speedup, and when greedy baseline_matches (responses whose output equals it). Several suites add "benchmarks": the same
    figures per suite.
    """
    suites = _suites(data, instances, benches, limit, sample, sample_seed, sample_shuffle)
    TokenPicker(temperature)  # a bad temperature or block size is refused before anything loads
    if block_size is not None and block_size < 2:
        raise EvalDataError(f"block size {block_size}: must be at least 2 (the anchor and one draft)")
    if isinstance(target, str):
        target = eval_target(target, device, dtype, trust_remote_code)
    if isinstance(drafter_dir, str):
        drafter_dir = load_dflash(drafter_dir, target, dtype=target.dtype).eval()
    if isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
    if len(tokenizer) > target.vocab_size:  # ids past the embedding would index out of range mid-decoding
        raise EvalDataError(f"the tokenizer has {len(tokenizer)} tokens but the target's vocabulary has "
                            f"{target.vocab_size}: pass the target's own tokenizer (--tokenizer)")
    trained_block = drafter_dir.block_size
    drafter: Drafter = drafter_dir
    if block_size is not None and block_size != trained_block:
        drafter = ResizedBlocks(drafter_dir, block_size)
    run = _Run(target, drafter, tokenizer, max_new_tokens, thinking, kv_cache, baseline, temperature, seed)
    responses = [r for name, items in suites.items() for r in run.suite(name, items)]
    summary = {
        **summarize(responses, drafter.block_size),
        "block_size": drafter.block_size,
        **({"trained_block_size": trained_block} if drafter.block_size != trained_block else {}),
        "max_new_tokens": max_new_tokens,
        "thinking": thinking,
        "temperature": temperature,
        "kv_cache": kv_cache,
    }
    layers = getattr(drafter_dir, "layer_attention", None)
    if layers and not all(layer.plain for layer in layers):  # a drafter that does not attend as DFlash's original
        summary["layer_attention"] = [str(layer) for layer in layers]
    if per_response:
        summary["per_response"] = [tau(r.lengths) if r.lengths else None for r in responses]
        summary["per_response_prompts"] = prompt_ids(responses, suites)
    if len(suites) > 1:
        summary["benchmarks"] = {
            name: summarize([r for r in responses if r.suite == name], drafter.block_size) for name in suites
        }
    return summary


def eval_target(path: str, device: str | None = None, dtype: str = "auto",
                trust_remote_code: bool = False) -> TargetModel:
    """The target as `evaluate` loads it from a path: on the GPU when there is one (load it once to evaluate
    several drafters)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return load_target(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


class _Run:
    """One evaluation's fixed settings, decoding instances turn by turn."""

    def __init__(
        self, target: TargetModel, drafter: Drafter, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
        thinking: bool, kv_cache: bool, baseline: bool, temperature: float = 0.0, seed: int = 0,
    ):
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.max_new_tokens, self.thinking, self.kv_cache, self.baseline = max_new_tokens, thinking, kv_cache, baseline
        self.temperature, self.seed, self._decoded = temperature, seed, 0
        self.greedy = TokenPicker(temperature).greedy
        self.stops = _stop_ids(tokenizer, target.model)
        # the text model's (a multimodal config such as Gemma 3's nests it under text_config)
        self.context: int | None = getattr(target.model.config.get_text_config(), "max_position_embeddings", None)
        self._warned_past_context = False
        self._warm = not baseline  # timings matter only with a baseline to compare against

    def _picker(self, k: int) -> TokenPicker:
        """The token picker of the k-th response (a fresh generator for each: the draws do not depend on how
        many an earlier response, or another drafter, used)."""
        if self.greedy:
            return GREEDY
        return TokenPicker(self.temperature, torch.Generator(self.target.device).manual_seed(self.seed + k))

    def suite(self, name: str, instances: list[Instance]) -> list[Response]:
        """Every turn of every instance of one suite, answers fed back."""
        responses = []
        for index, instance in enumerate(instances):
            answers: list[str] = []
            for _turn in instance.turns:
                ids = torch.tensor(render_prompt(self.tokenizer, messages(instance, answers), self.thinking))
                response, answer = self._decode(name, index, ids)
                answers.append(answer)
                responses.append(response)
            log.info("eval %s %d/%d: %d turns, tau %.2f", name, index + 1, len(instances), len(instance.turns),
                     mean_of_means([r.lengths for r in responses[-len(instance.turns):]]) or float("nan"))
        return responses

    def _decode(self, suite: str, index: int, ids: torch.Tensor) -> tuple[Response, str]:
        """One response: speculative decoding, and target-only decoding when timing a baseline."""
        device = self.target.device
        if not self._warm:  # first-call costs (kernel selection, allocator growth) stay out of the timings
            speculative_generate(self.target, self.drafter, ids, 8, self.stops, self.kv_cache)
            greedy_generate(self.target, ids, 8, self.stops, kv_cache=True)
            self._warm = True
        k, self._decoded = self._decoded, self._decoded + 1
        (out, lengths), seconds = _timed(
            lambda starts: speculative_generate(self.target, self.drafter, ids, self.max_new_tokens, self.stops,
                                                self.kv_cache, decoding_starts=starts, pick=self._picker(k)),
            device,
        )
        new = out[0, ids.shape[0]:]
        past = self.context is not None and ids.shape[0] + new.shape[0] > self.context
        if past and not self._warned_past_context:
            log.warning("eval %s instance %d: a prompt of %d tokens + %d new ones exceed the target's "
                        "max_position_embeddings %d; decoded and counted as the reference does (the summary's "
                        "past_context counts such responses): lower --max-new-tokens or drop the long prompts",
                        suite, index, ids.shape[0], new.shape[0], self.context)
        self._warned_past_context |= past
        first_is_stop = new.shape[0] > 0 and int(new[0]) in self.stops
        response = Response(suite, index, lengths, int(new.shape[0]), seconds, past_context=past,
                            server_passes=sglang_passes(lengths, self.max_new_tokens, first_is_stop))
        if self.baseline:
            ref, base_seconds = _timed(
                lambda starts: greedy_generate(self.target, ids, self.max_new_tokens, self.stops, kv_cache=True,
                                               decoding_starts=starts, pick=self._picker(k)),
                device,
            )
            matches = torch.equal(ref, out) if self.greedy else None  # sampled outputs differ
            response = replace(response, baseline_tokens=ref.shape[1] - ids.shape[0], baseline_seconds=base_seconds,
                               matches_baseline=matches)
        return response, str(self.tokenizer.decode(new.tolist(), skip_special_tokens=True))
