"""Expected failures: bad input or a failed run. The CLI prints them as one line; anything else is a bug."""


class DflashError(Exception):
    """An expected failure whose message says what was wrong, where, and what to do."""

    exit_code = 2  # 2: bad input; 1: a run that failed (subclasses override)
