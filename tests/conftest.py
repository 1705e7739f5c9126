"""Shared test set-up: offline W&B, no Prefect analytics, one Prefect test server, the tiny example assets."""

import atexit
import getpass
import os
import shutil
import tempfile
from pathlib import Path

# Every temporary folder of the session (the tests', the code's under test, the servers' they start) goes under
# one folder that the session's end removes: a run of the suite leaves nothing behind in /tmp. pytest's own
# tmp_path folders (the last three runs', for a failure's post-mortem) and torch's compile cache stay where
# they were, decided before the switch.
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(),
                                                              f"torchinductor_{getpass.getuser()}"))
_SCRATCH = tempfile.mkdtemp(prefix="dflash-tests-")
# At exit, after the clean-ups registered later (atexit runs them last first: Prefect's test harness removes its
# database folder in one), the session's folders go with it.
atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)
tempfile.tempdir = _SCRATCH
os.environ["TMPDIR"] = _SCRATCH
# Before anything imports prefect or wandb: a throwaway PREFECT_HOME, no analytics, W&B offline.
_PREFECT_HOME = tempfile.mkdtemp(prefix="prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("PREFECT_API_URL", None)
# The example assets take a minute or two to build: keep them across test runs in the repo's cache folder.
REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("DFLASH_HOME", str(REPO / ".dflash-cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models gain nothing from intra-op threads; on a shared 2-core CPU they lose ~50x to oversubscription.
torch.set_num_threads(1)


# The longest test files, started first so that the other pytest worker (make test: -n 2 --dist loadfile) runs
# the rest of the suite beside them instead of after them.
LONG_POLES = ("test_demo.py",)


def pytest_collection_modifyitems(config, items):
    """The long poles first; GPU tests skip on machines without CUDA."""
    items.sort(key=lambda item: item.path.name not in LONG_POLES)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def example_assets():
    """The built-in example (tokenizer, chat data, tiny trained Qwen3 target), built once and cached."""
    from dflash_core.example import build_example

    return build_example()


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """One rank's token shards and plan (common.runs.build_inputs, world size 1), built once per test module: the
    launcher tests, whose torchrun is a stand-in or stops before training, read no more of them."""
    from common.runs import build_inputs

    return build_inputs(tmp_path_factory.mktemp("one-rank"), world_size=1)


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test server for the whole session (temporary database, generous start-up timeout)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
