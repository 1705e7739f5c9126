"""Every record is kept or dropped for a named reason; bad input above a threshold stops the stage."""

from __future__ import annotations

from collections import Counter
from typing import Any

from dflash_core.data.errors import BadInputError

# Drops that follow from the length or tools policy, from ordinary data quality (nothing to learn, images, what
# the data's own source excludes from its reviewed set: excluded_by_source), or
# from a template that cannot render a sound record as written (template_rewrites_reply: it cuts or rewrites a
# reply, as DeepSeek-R1's keeps only what follows a '</think>' the reply mentions), not from broken input: they
# never count toward data.max_bad_fraction. Everything else does: unparsable, unreadable, truncated_file (one per
# file: the lost part cannot be counted), wrong_schema, unknown_role, ...
POLICY_REASONS = frozenset({"too_long", "too_few_supervised", "template_has_no_tools", "template_single_tool_call",
                            "template_drops_text_with_calls", "template_rewrites_reply",
                            "empty_conversation", "no_assistant_turn", "no_assistant_content", "no_trained_turn",
                            "non_text_content", "excluded_by_source"})


class DropLog:
    """Counts drops by reason and keeps the first few examples of each (file, record, line, id, detail)."""

    def __init__(self, max_examples: int) -> None:
        self.max_examples = max_examples
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[dict[str, Any]]] = {}

    def add(self, reason: str, file: str, record: int, line: int | None, rid: str | None, detail: str) -> None:
        """Count one dropped record."""
        self.counts[reason] += 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < self.max_examples:
            example = {"file": file, "record": record, "line": line, "id": rid, "detail": detail}
            kept.append({k: v for k, v in example.items() if v is not None})

    @property
    def bad(self) -> int:
        """Records dropped because the input itself was unusable."""
        return sum(n for reason, n in self.counts.items() if reason not in POLICY_REASONS)

    def dropped(self) -> dict[str, int]:
        """Counts by reason, sorted by reason name."""
        return dict(sorted(self.counts.items()))

    def check(self, read: int, max_fraction: float) -> None:
        """Raise BadInputError, showing examples, when bad records exceed max_fraction of those read."""
        if read == 0 or self.bad / read <= max_fraction:  # not bad <= fraction * read: 0.29 * 100 < 29 in floats
            return
        lines = [f"{self.bad} of {read} records ({self.bad / read:.1%}) are bad input, above "
                 f"data.max_bad_fraction={max_fraction}:"]
        for reason, n in self.dropped().items():
            if reason not in POLICY_REASONS:
                lines.append(f"  {reason}: {n}")
                lines += [f"    {describe(e)}" for e in self.examples[reason]]
        lines.append("Fix or remove those records, map unknown roles with data.role_map, set data.format / "
                     "data.messages_key, or raise data.max_bad_fraction.")
        raise BadInputError("\n".join(lines))


def describe(example: dict[str, Any]) -> str:
    """'file line 3 (record 2, id x): detail'."""
    where = f"line {example['line']}, record {example['record']}" if "line" in example else \
        f"record {example['record']}"
    rid = f", id {example['id']}" if "id" in example else ""
    return f"{example['file']} {where}{rid}: {example['detail']}"
