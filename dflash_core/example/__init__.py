"""The built-in example: a seeded chat corpus, a BPE tokenizer with a chat template and a tiny trained Qwen3.

`build_example()` builds them once into $DFLASH_HOME (or ~/.cache/dflash-pipeline) and reuses them after;
`resolve_uri("example://data" | "example://tokenizer" | "example://target" | "example://heldout")` gives their paths.
"""

from dflash_core.example.assets import (
    EXAMPLE_URIS,
    ExampleAssets,
    ExampleError,
    build_example,
    default_home,
    read_metadata,
    resolve_uri,
)

__all__ = [
    "EXAMPLE_URIS",
    "ExampleAssets",
    "ExampleError",
    "build_example",
    "default_home",
    "read_metadata",
    "resolve_uri",
]
