"""Expected failures: bad input or a failed run. The CLI prints them as one line; anything else is a bug.

Anything that is not a `DflashError` keeps its traceback. Bad-input errors also subclass ValueError, so code that
caught ValueError before keeps working.
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class DflashError(Exception):
    """An expected failure whose message says what was wrong, where, and what to do."""

    exit_code: int = EXIT_BAD_INPUT  # 2: bad input; 1: a run that failed (subclasses override)


class TransientError(DflashError):
    """A storage or network failure that may pass (a connection reset mid-read): run again (exit code 1)."""

    exit_code = EXIT_FAILED


class InputError(DflashError, ValueError):
    """Input the pipeline cannot use: a config, data, a plan, a command line (exit code 2)."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(InputError):
    """A config file that cannot be used; the message names the file and the key (`keys`: the dotted keys at
    fault, where validation found them)."""

    keys: list[str] = []


class UsageError(InputError):
    """Bad command-line or launch arguments; the message says what to pass instead."""
