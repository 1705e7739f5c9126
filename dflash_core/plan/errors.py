"""Errors of the plan stage: ValueErrors whose messages say what was wrong, where, and what to do."""

from dflash_core.errors import InputError


class PlanError(InputError):
    """Lengths, a config or a plan folder that the plan stage cannot use."""
