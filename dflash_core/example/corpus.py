"""The example chat corpus: seeded, learnable number and list tasks with a long-tailed length distribution.

Every answer follows from the conversation (count up or down, times tables, small arithmetic, copy, reverse
or sort a list, count its items, pick an item), so a tiny target can learn it and drafter acceptance means
something: counting and tables are predictable from local patterns, list copies need attention across the chat. Lengths follow a
clipped log-normal: most conversations are a few dozen tokens, about a fifth run to several hundred
(long lists, several turns), which is the shape that made length buckets unequal in DESIGN.md's incident.
"""

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NUM_CONVERSATIONS = 3000
# Conversation budgets in estimated tokens: log-normal body, clipped so nothing exceeds the 512-token demo limit.
MEDIAN_TOKENS = 90
SIGMA = 1.6
MIN_TOKENS = 40
MAX_TOKENS = 490
# Hard cap on a rendered conversation; under the demo's 512 so nothing is truncated.
MAX_RECORD_TOKENS = 500
MAX_EXCHANGES = 4
SYSTEM_SHARE = 0.3
FOLLOW_UP_SHARE = 0.45
# Sizing lists: every word and number is one token of the example tokenizer; an exchange adds ~24 more.
EXCHANGE_OVERHEAD = 24
# A list task shows its list about three times: in the question, restated and transformed in the answer.
LIST_COPIES = 3
SEQUENCE_OVERHEAD = 20

WORDS = """
ant ape bat bear bee bird boar bull calf camel cat chick clam cod colt cow crab crow deer dog dove duck
eagle eel elk emu ewe fawn finch fish fly fox frog gnat goat goose gull hare hawk hen heron horse jay
kid kite lamb lark lion lynx mole moth mouse mule newt owl ox panda pig pony pug puma ram rat raven seal
shark sheep slug snail snake swan tiger toad trout tuna wasp whale wolf worm yak zebra
apple bean beet berry cherry corn date fig grape kiwi leek lemon lime mango melon nut olive onion pea
peach pear plum rice yam bread cake honey jam milk salt soup tea
red blue green black white pink gray brown gold amber ivory jade ruby teal
bag ball bell boat book bowl box brick broom brush cap car card chair clock coat cup desk door drum fan
flag fork hat jar key lamp map mug nail net pan pen pipe pot ring rope rug sack shoe sock spoon star
stone table tent tile toy tray van vase wheel
""".split()

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant that works with lists and numbers.",
    "You are a precise assistant. Answer briefly and exactly.",
    "You help with small list and number puzzles. Keep answers short.",
    "You are a friendly tutor for simple counting and sorting tasks.",
)


NUMBERS = [str(i) for i in range(100)]
POOLS = {"numbers": NUMBERS, "words": WORDS, "mixed": NUMBERS + WORDS}


@dataclass
class ListState:
    """The list the conversation is about (kind: numbers, words or mixed), so follow-ups can refer to it."""

    items: list[str]
    kind: str

    @property
    def sortable(self) -> bool:
        return self.kind != "mixed"


Exchange = tuple[str, str, ListState | None]


def _fmt(items: list[str]) -> str:
    return " ".join(items)


def _sorted(state: ListState) -> list[str]:
    return sorted(state.items, key=int) if state.kind == "numbers" else sorted(state.items)


def _copy(rng: random.Random, s: ListState) -> tuple[str, str]:
    ask = rng.choice(
        ("Repeat this list: {}", "Copy this list exactly: {}", "Please write these items again: {}")
    )
    say = rng.choice(
        (
            "Here is the list again, item by item: {}. That is the whole list.",
            "Sure, the same list in the same order: {}. Nothing is left out.",
        )
    )
    return ask.format(_fmt(s.items)), say.format(_fmt(s.items))


def _reverse(rng: random.Random, s: ListState) -> tuple[str, str]:
    ask = rng.choice(
        ("Reverse this list: {}", "Write this list backwards: {}", "Put these in reverse order: {}")
    )
    say = rng.choice(("The list was {}. In reverse order it is: {}.", "Reading {} from the end gives: {}."))
    return ask.format(_fmt(s.items)), say.format(_fmt(s.items), _fmt(s.items[::-1]))


def _sort(rng: random.Random, s: ListState) -> tuple[str, str]:
    if s.kind == "numbers":
        ask = rng.choice(("Sort these numbers from smallest to largest: {}", "Sort these numbers: {}"))
        say = "The numbers were {}. Sorted from smallest to largest they are: {}."
    else:
        ask = rng.choice(("Sort these words alphabetically: {}", "Put these words in alphabetical order: {}"))
        say = "The words were {}. In alphabetical order they are: {}."
    return ask.format(_fmt(s.items)), say.format(_fmt(s.items), _fmt(_sorted(s)))


def _count(rng: random.Random, s: ListState) -> tuple[str, str]:
    ask = rng.choice(("How many items are in this list? {}", "Count the items in this list: {}"))
    counting = _fmt([str(i) for i in range(1, len(s.items) + 1)])
    return ask.format(
        _fmt(s.items)
    ), f"Counting the items one by one: {counting}. The list has {len(s.items)} items."


def _pick(rng: random.Random, s: ListState) -> tuple[str, str]:
    if s.kind == "numbers" and rng.random() < 0.5:
        largest = rng.random() < 0.5
        word, value = ("largest", max(s.items, key=int)) if largest else ("smallest", min(s.items, key=int))
        ask, say = (
            f"What is the {word} number in this list? {{}}",
            f"The numbers are {{}}. The {word} of them is {value}.",
        )
    else:
        first = rng.random() < 0.5
        word, value = ("first", s.items[0]) if first else ("last", s.items[-1])
        ask, say = (
            f"What is the {word} item of this list? {{}}",
            f"The list is {{}}. Its {word} item is {value}.",
        )
    return ask.format(_fmt(s.items)), say.format(_fmt(s.items))


LIST_TASKS: tuple[Callable[[random.Random, ListState], tuple[str, str]], ...] = (_copy, _reverse, _sort)
SHORT_TASKS: tuple[Callable[[random.Random, ListState], tuple[str, str]], ...] = (_count, _pick)

FOLLOW_UPS: dict[str, Callable[[ListState], tuple[str, ListState]]] = {
    "Now reverse it.": lambda s: (
        "Reversing the list I just wrote gives: {}.",
        ListState(s.items[::-1], s.kind),
    ),
    "Now sort it.": lambda s: ("Sorting the list I just wrote gives: {}.", ListState(_sorted(s), s.kind)),
    "Repeat it once more.": lambda s: ("Once more, the same list: {}.", s),
}

VERBS = {"plus": "take {a} and add {b}", "minus": "take {a} and subtract {b}", "times": "multiply {a} by {b}"}


def _arithmetic(rng: random.Random) -> Exchange:
    op = rng.choice(("plus", "minus", "times"))
    if op == "times":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        c = a * b
    else:
        a, b = rng.randint(0, 60), rng.randint(0, 39)
        a, b = (max(a, b), min(a, b)) if op == "minus" else (a, b)
        c = a + b if op == "plus" else a - b
    ask = rng.choice(("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Please work out {a} {op} {b}."))
    say = "To work out {a} {op} {b}, " + VERBS[op] + ". That gives {c}, so {a} {op} {b} equals {c}."
    return ask.format(a=a, op=op, b=b), say.format(a=a, op=op, b=b, c=c), None


def _sequence(rng: random.Random, budget: float) -> Exchange:
    step = rng.choice((1, 1, 1, 2, 5, 10))
    room = max(3, int(budget - SEQUENCE_OVERHEAD))
    # Numbers stay within 0-99 (one token each); a long budget counts there and back.
    there_and_back = room > 100
    size = min(room // 2 if there_and_back else room, 99 // step + 1)
    start = rng.randint(0, 99 - (size - 1) * step)
    numbers = [str(start + i * step) for i in range(size)]
    down = rng.random() < 0.3
    if down:
        numbers.reverse()
    ask = f"Count {'down ' if down else ''}from {numbers[0]} to {numbers[-1]}"
    ask += "" if step == 1 else f" in steps of {step}"
    if there_and_back:
        ask += f", then back to {numbers[0]}"
        numbers += numbers[-2::-1]
    say = rng.choice(("Sure: {}. Done.", "Here you go: {}. That is the whole count."))
    return ask + ".", say.format(_fmt(numbers)), ListState(numbers, "numbers")


def _times_table(rng: random.Random) -> Exchange:
    k = rng.randint(2, 9)
    rows = " ".join(f"{k} times {i} is {k * i}." for i in range(1, 11))
    return f"Write the times table of {k}.", f"Here is the times table of {k}. {rows}", None


def _new_list(rng: random.Random, budget: float) -> ListState:
    size = max(3, int((budget - EXCHANGE_OVERHEAD) / LIST_COPIES))
    kinds = [k for k, pool in POOLS.items() if len(pool) >= size] or ["mixed"]
    kind = rng.choice(kinds)
    # Distinct items: a copy is then unambiguous (each item says where the copy continues), like real text.
    return ListState(rng.sample(POOLS[kind], min(size, len(POOLS[kind]))), kind)


def _exchange(rng: random.Random, budget: float, last: ListState | None) -> Exchange:
    # A follow-up repeats the last list once, so it only fits when that list fits the budget.
    if last is not None and len(last.items) + EXCHANGE_OVERHEAD <= budget and rng.random() < FOLLOW_UP_SHARE:
        ask = rng.choice([a for a in FOLLOW_UPS if last.sortable or a != "Now sort it."])
        say, state = FOLLOW_UPS[ask](last)
        return ask, say.format(_fmt(state.items)), state
    # Counting and tables are learnable from local patterns; lists need copying across the chat.
    kind = rng.random()
    if kind < (0.4 if budget < 44 else 0.1):
        return _arithmetic(rng)
    if kind < 0.5 and budget <= SEQUENCE_OVERHEAD + 200:
        return _sequence(rng, budget)
    if kind < 0.6 and 70 <= budget <= 150:
        return _times_table(rng)
    state = _new_list(rng, budget)
    short = len(state.items) <= 12 and rng.random() < 0.4
    tasks = SHORT_TASKS if short else LIST_TASKS if state.sortable else LIST_TASKS[:2]
    ask, say = rng.choice(tasks)(rng, state)
    return ask, say, state


def _split(rng: random.Random, total: float, parts: int) -> list[float]:
    weights = [rng.gammavariate(2.0, 1.0) for _ in range(parts)]
    return [total * w / sum(weights) for w in weights]


def _budget(rng: random.Random) -> float:
    return min(MAX_TOKENS, max(MIN_TOKENS, rng.lognormvariate(math.log(MEDIAN_TOKENS), SIGMA)))


TOKEN = re.compile(r"\w+|[^\w\s]")


def estimate_tokens(record: dict) -> int:
    """Tokens of the rendered chat, assuming every word and number is one token (true for the example tokenizer)."""
    # Each message adds <|im_start|>, its role, "\n", <|im_end|> and "\n".
    return sum(5 + len(TOKEN.findall(t["value"])) for t in record["conversations"])


def make_conversation(rng: random.Random, index: int) -> dict:
    """One ShareGPT record of at most MAX_RECORD_TOKENS estimated tokens, long-tailed in length."""
    while True:
        record = _draft_conversation(rng, index)
        if estimate_tokens(record) <= MAX_RECORD_TOKENS:
            return record


def _draft_conversation(rng: random.Random, index: int) -> dict:
    budget = _budget(rng)
    turns: list[dict[str, str]] = []
    if rng.random() < SYSTEM_SHARE:
        turns.append({"from": "system", "value": rng.choice(SYSTEM_PROMPTS)})
        budget -= 12
    # Long chats are mostly several exchanges, as in real data, rather than one giant answer.
    max_exchanges = max(1, min(MAX_EXCHANGES, int(budget // 40)))
    min_exchanges = max(1, min(max_exchanges, round(budget / 180)))
    last: ListState | None = None
    for share in _split(rng, budget, rng.randint(min_exchanges, max_exchanges)):
        ask, say, last = _exchange(rng, share, last)
        turns += [{"from": "human", "value": ask}, {"from": "gpt", "value": say}]
    return {"id": f"example-{index:05d}", "conversations": turns}


def generate_conversations(n: int = NUM_CONVERSATIONS, seed: int = 0) -> list[dict]:
    """n ShareGPT records, identical for the same (n, seed)."""
    rng = random.Random(seed)
    return [make_conversation(rng, i) for i in range(n)]


ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def to_messages(record: dict) -> list[dict[str, str]]:
    """A ShareGPT record as chat-template messages (role/content)."""
    return [{"role": ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]]


def read_jsonl(path: str | Path) -> list[dict]:
    """Read the records written by dflash_core.io.write_jsonl."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
