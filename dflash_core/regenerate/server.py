"""A local OpenAI-compatible server for the target: started as its own process group, stopped whatever happens.

`transformers serve` runs the example target on a CPU (tests, demo); `vllm serve` and SGLang run real
targets on GPUs. The server is ready when GET /v1/models answers (all three load the model before that)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from dflash_core.regenerate.client import AUTH_REFUSED, VLLM_KEY_ENV, auth_headers
from dflash_core.regenerate.errors import RegenerateError

HOST = "127.0.0.1"
# The stage always sends many requests at once, so `transformers serve` runs with continuous batching. Its KV
# cache is sized as a share of free memory, 90% by default: on a CPU that is most of the RAM (14 GB for the
# 8 MB example target). Measured on the example target (2 shared CPU cores, tokens/s at 1 / 32 requests in
# flight): 5% -> 33 / 80, 10% -> 198 / 1064 (2.7 GB RSS), no batching -> 36 / 36. serve_args come after
# these flags; a repeated flag's last value wins (on a GPU, raise the share).
DEFAULT_ARGS = {"transformers": ["--continuous-batching", "--cb-max-memory-percent", "0.1"], "vllm": [],
                "sglang": []}
# `transformers serve` runs torch on one intra-op thread unless OMP_NUM_THREADS is set: sharing 2 CPU cores with
# one busy process, 200 records of the example took 843 s at the default thread count (24.9 tokens/s) and 45 s
# with one thread (704 tokens/s); its decoding steps are too small to gain from threads that spin-wait.
# USE_HUB_KERNELS=NO: transformers 5.25 loads Hub kernels by default (a download, on a machine that may have no
# network); the served model runs transformers' own layers, as the target does in training (load_target).
DEFAULT_ENV = {"transformers": {"OMP_NUM_THREADS": "1", "USE_HUB_KERNELS": "NO"}, "vllm": {}, "sglang": {}}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(kind: str, model: str, port: int, extra: list[str]) -> list[str]:
    """The command line that serves `model` on 127.0.0.1:`port` with the OpenAI API under /v1."""
    args = [*DEFAULT_ARGS[kind], *extra]
    if kind == "transformers":
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", model,
                "--host", HOST, "--port", str(port), *args]
    if kind == "vllm":
        exe = Path(sys.executable).with_name("vllm")
        return [str(exe) if exe.exists() else "vllm", "serve", model, "--host", HOST, "--port", str(port), *args]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", HOST,
            "--port", str(port), *args]


def servable_model(target: str, tokenizer: str, workdir: Path) -> str:
    """`target` itself when it has tokenizer files (or is a hub id); else a folder of links to the target's
    files plus the tokenizer's, since the servers load the tokenizer from the model folder."""
    if not os.path.isdir(target) or any(os.path.isfile(os.path.join(target, n)) for n in TOKENIZER_FILES):
        return target
    if not os.path.isdir(tokenizer):
        raise RegenerateError(f"{target}: the target folder has no tokenizer files and the tokenizer "
                              f"{tokenizer!r} is not a local folder; copy the tokenizer files into the target")
    folder = workdir / "served-model"
    folder.mkdir(parents=True, exist_ok=True)
    for src in (tokenizer, target):  # the target's own files win over the tokenizer's
        for name in os.listdir(src):
            # made under a name of its own, then renamed over the old link: another run making the folder at the
            # same moment (two runs into one --out) never finds a link missing
            fresh = folder / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            fresh.unlink(missing_ok=True)
            fresh.symlink_to(os.path.abspath(os.path.join(src, name)))
            os.replace(fresh, folder / name)
    return str(folder)


def _die_with_parent() -> None:
    # Linux: the server gets SIGKILL when the stage's process dies, even by kill -9 (no orphaned server).
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class LocalServer:
    """A server process group; `url` is its OpenAI base URL once `wait_ready()` returned."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.port, self.log_path = cmd, port, log_path
        self.url = f"http://{HOST}:{port}/v1"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        # The kind's defaults give way to the caller's environment (set OMP_NUM_THREADS to use more threads).
        full_env = {**(env or {}), **os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True,
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except OSError as exc:
            self._log.close()
            raise RegenerateError(f"cannot start the server ({' '.join(cmd[:4])} ...): {exc}; "
                                  f"install it (e.g. pip install 'transformers[serving]')") from None

    def wait_ready(self, timeout_s: float, key: str | None = None) -> None:
        """Poll GET /v1/models until the model is listed; RegenerateError with the log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RegenerateError(f"the local server exited with code {self.proc.returncode} while starting "
                                      f"({' '.join(self.cmd)}); log {self.log_path}:\n{self.log_tail()}")
            try:
                status = httpx.get(f"{self.url}/models", timeout=2.0, headers=auth_headers(key)).status_code
                if status == 200:
                    return
                if status in AUTH_REFUSED:
                    raise RegenerateError(f"the local server wants an API key (GET /models: HTTP {status}); it "
                                          f"takes one from its environment ({VLLM_KEY_ENV}) or from serve_args "
                                          f"--api-key: set data.regenerate.api_key_env to the variable holding it")
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RegenerateError(f"the local server was not ready after {timeout_s:.0f} s "
                              f"(data.regenerate.startup_timeout_s); log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after a grace period; idempotent."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # children that outlived their parent
        self.proc.wait()
        _wait_group_gone(self.proc.pid)  # a SIGKILL is delivered, not awaited: on a busy machine they linger
        self._log.close()


def _wait_group_gone(pgid: int, timeout_s: float = 10.0) -> None:
    """Wait until no process of group `pgid` is alive (zombies aside: a container's pid 1 may never reap them);
    Linux /proc only, elsewhere a no-op."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _group_members(pgid):
        time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while listed
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def warm_up(url: str, key: str | None = None) -> None:
    """One 1-token request before the real load: `transformers serve` builds its continuous-batching cache on
    the first request (110 s measured with the default cache share), which then no real request's timeout pays.
    The scheduler is also sized from that first request: once measured 1064 tokens/s at 32 in flight after a
    4-token first request vs 57 without, not reproduced with the stage's own settings (see README)."""
    headers = auth_headers(key)
    model = httpx.get(f"{url}/models", timeout=30, headers=headers).json()["data"][0]["id"]
    httpx.post(f"{url}/chat/completions", timeout=600, headers=headers, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0.0,
    }).raise_for_status()


def _warmed(server: LocalServer, key: str | None = None) -> None:
    """warm_up, a refusal told as the server's own error with its log."""
    try:
        warm_up(server.url, key)
    except httpx.HTTPError as exc:
        raise RegenerateError(f"the local server failed its first request ({exc}); log {server.log_path}:\n"
                              f"{server.log_tail()}") from None


@contextmanager
def local_servers(kind: str, model: str, extra: list[str], log_paths: list[Path],
                  timeout_s: float, key: str | None = None) -> Iterator[list[str]]:
    """Serve `model` once per log path, side by side (each its own process group and port: data parallel on one
    machine), for the duration of the block; yields their base URLs; all are stopped on exit, error or cancel.
    They start and warm up together, so a second replica costs little start-up time."""
    servers: list[LocalServer] = []
    try:
        ports: list[int] = []
        while len(ports) < len(log_paths):  # a port just released can come back: each replica needs its own
            if (port := free_port()) not in ports:
                ports.append(port)
        for port, path in zip(ports, log_paths, strict=True):
            servers.append(LocalServer(server_command(kind, model, port, extra), port, path, DEFAULT_ENV[kind]))
        deadline = time.monotonic() + timeout_s
        for server in servers:
            server.wait_ready(max(deadline - time.monotonic(), 1.0), key)
        if kind == "transformers":  # side by side too: each takes ~30 s on the example (its cache is built)
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda server: _warmed(server, key), servers))
        yield [server.url for server in servers]
    finally:
        for server in servers:
            server.stop()


@contextmanager
def local_server(kind: str, model: str, extra: list[str], log_path: Path, timeout_s: float) -> Iterator[str]:
    """Serve `model` for the duration of the block; yields its base URL; stopped on exit, error or cancel."""
    with local_servers(kind, model, extra, [log_path], timeout_s) as urls:
        yield urls[0]
