"""Errors of the regenerate stage (DflashErrors: the CLI prints them as one line and exits non-zero)."""

from dflash_core.errors import InputError


class RegenerateError(InputError):
    """The stage cannot go on: a server that does not start or answer, an output folder of another run."""


class EndpointError(RegenerateError):
    """An endpoint that is unreachable or keeps failing; the message names it."""
