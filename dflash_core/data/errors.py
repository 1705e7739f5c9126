"""Errors of the tokenize stage: all ValueErrors whose messages say what, where and what to do."""

from dflash_core.errors import InputError


class DataError(InputError):
    """Chat data or a tokenizer that the stage cannot use."""


class TemplateError(DataError):
    """A tokenizer without a usable chat template."""


class BadInputError(DataError):
    """Too many input records could not be used (above data.max_bad_fraction)."""
