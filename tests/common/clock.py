"""One module's view of `time` or `asyncio` with a function replaced.

`monkeypatch.setattr(checkpoint.time, "sleep", ...)` replaces time.sleep for the whole process: the threads an
earlier test left in this pytest worker (Prefect's event loop, W&B's) would call the fake too, and fill the list
a test asserts on. `monkeypatch.setattr(checkpoint, "time", ModuleWith(time, sleep=...))` changes only what the
module under test sees.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


class ModuleWith:
    """`module` with the attributes given replaced; every other attribute is the module's own."""

    def __init__(self, module: ModuleType, **replaced: Any) -> None:
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)
