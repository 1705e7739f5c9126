"""Reliability of `torchrun -m dflash_core.runtime.worker` with 2 CPU processes (gloo), tiny models.

Each launch pays Python + torch + transformers start-up per rank, so these are marked slow (they run in CI).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import polars as pl
import pytest
import torch
import yaml
from common.chat import tokenizer_dir
from common.runs import MASK_ID, build_inputs, torchrun, write_config, write_shards
from safetensors.torch import load_file
from transformers import AutoTokenizer

from dflash_core.model.export import load_dflash
from dflash_core.model.target import load_target
from dflash_core.runtime.checkpoint import CheckpointManager
from dflash_core.runtime.launch import TrainingFailed, launch_train
from dflash_core.runtime.ledger import read_launches

pytestmark = pytest.mark.slow

REQUIRED = {"step", "epoch", "loss", "acc", "accept_len", "acc_by_slot", "grad_norm", "grad_norm_avg", "clipped",
            "clip", "lr", "n_tokens", "n_loss_tokens", "n_samples", "max_len", "bucket_mix", "bucket_tokens",
            "loss_by_bucket", "nonfinite", "nonfinite_total", "skipped", "tokens_per_s", "queue_depth",
            "drafter_wait_s", "stage_s", "time", "tflops", "mfu", "step_tflop"}
# every candidate anchor is used (num_anchors >= positions), so results do not depend on which rank or micro-batch
# slot a sample lands in: a 2-rank run and a 1-rank run over the same step contents must agree
ALL_ANCHORS = {"num_anchors": 512}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _summary(output: str) -> dict:
    return json.loads(next(line for line in reversed(output.splitlines()) if line.startswith("{")))


def _config(tmp: Path, inputs, name: str, model: dict | None = None, **train) -> str:
    path = write_config(tmp / f"{name}.yaml", inputs, **train)
    if model:
        import yaml

        raw = yaml.safe_load(Path(path).read_text())
        raw["model"].update(model)
        Path(path).write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("runtime-e2e"))


@pytest.fixture(scope="module")
def baseline(inputs, tmp_path_factory):
    """One uninterrupted 2-process run; other tests compare against it."""
    tmp = tmp_path_factory.mktemp("baseline")
    config = _config(tmp, inputs, "base", ALL_ANCHORS)
    out = tmp / "out"
    run = torchrun(inputs, out, config)
    assert run.returncode == 0, run.output[-4000:]
    return out, config, run


def test_two_processes_write_the_contract_files(inputs, baseline):
    out, _, run = baseline
    summary = _summary(run.output)
    plan = json.loads((Path(inputs.plan) / "plan.json").read_text())
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(plan["num_steps"]))
    assert all(REQUIRED <= set(r) for r in records)
    assert all(r["grad_norm"] > 0 and r["nonfinite"] is False for r in records)
    table = pl.read_parquet(Path(inputs.plan) / "plan.parquet")
    step0 = table.filter(pl.col("step") == 0)
    assert records[0]["n_samples"] == int(step0["n_samples"].sum())  # both ranks' micro-batches counted
    assert records[0]["n_tokens"] == int(step0["n_tokens"].sum())
    assert records[0]["max_len"] == int(step0["max_len"].max())
    assert sum(records[0]["bucket_mix"].values()) == step0.height
    assert summary["steps"] == plan["num_steps"] and summary["world_size"] == 2
    assert summary["steady_steps"] == plan["num_steps"] - 2 and summary["steady_tokens_per_s"] > 0
    assert summary["checkpoint_s"] > 0 and summary["export_s"] > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-6", "step-7"]  # keep 2
    drafter = load_dflash(str(out / "drafter"), load_target(inputs.target))
    assert drafter.block_size == 4
    # the mask token's text, as SGLang resolves it, is the tokenizer's token at the mask id
    mask_text = AutoTokenizer.from_pretrained(tokenizer_dir("chatml")).convert_ids_to_tokens(MASK_ID)
    assert drafter.dflash_config == {"mask_token_id": MASK_ID, "target_layer_ids": drafter.target_layer_ids,
                                     "mask_token": mask_text}


def test_loss_is_normalised_over_the_whole_step_across_ranks(inputs, baseline, tmp_path):
    """Same step contents on 1 rank x 4 micro-batches: the same losses and weights as 2 ranks x 2."""
    out2, config, _ = baseline
    table = pl.read_parquet(Path(inputs.plan) / "plan.parquet")
    meta = json.loads((Path(inputs.plan) / "plan.json").read_text())
    plan1 = tmp_path / "plan-w1"
    plan1.mkdir()
    # rank r micro m of the 2-rank plan becomes micro 2r+m of a 1-rank plan (same row order)
    table.with_columns(micro=(pl.col("rank") * 2 + pl.col("micro")).cast(pl.Int32), rank=pl.lit(0, pl.Int32)) \
        .write_parquet(plan1 / "plan.parquet")
    (plan1 / "plan.json").write_text(json.dumps({**meta, "world_size": 1, "grad_accum": 4}))
    out1 = tmp_path / "out1"
    run = torchrun(inputs, out1, config, nproc=1, plan=str(plan1))
    assert run.returncode == 0, run.output[-4000:]
    one, two = _metrics(out1), _metrics(out2)
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
        assert a["n_loss_tokens"] == b["n_loss_tokens"]
        # FLOPs are the whole step's, summed over the ranks like n_tokens (all anchors: no sampling differs)
        assert a["step_tflop"] == pytest.approx(b["step_tflop"], rel=1e-9)
    w1 = load_file(out1 / "checkpoints" / "step-7" / "model.safetensors")
    w2 = load_file(out2 / "checkpoints" / "step-7" / "model.safetensors")
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("stage", ["prefetch", "target", "drafter"])
def test_exception_in_a_stage_ends_the_run_fast_with_the_original_traceback(inputs, tmp_path, stage):
    config = _config(tmp_path, inputs, "c")
    run = torchrun(inputs, tmp_path / "out", config, fault=f"{stage}@3:1")
    assert run.returncode != 0
    assert "InjectedFault" in run.output and f"injected fault in stage '{stage}'" in run.output
    origin = {"prefetch": "prefetch.py", "target": "target_loop.py", "drafter": "train_loop.py"}[stage]
    assert re.search(rf'File ".*{origin}", line \d+, in (load|forward|_micro_step)', run.output)
    fired = float(re.search(r"at unix time (\d+\.\d+)", run.output).group(1))
    assert run.ended - fired < 10, f"run ended {run.ended - fired:.1f} s after the fault"


def test_nan_micro_batch_is_skipped_counted_and_training_continues(inputs, tmp_path):
    """Also: rank 1's teardown after the run hangs (as seen in CI on a loaded machine); the exit watchdog ends it
    with status 0 after EXIT_GRACE_S instead of torchrun waiting forever."""
    config = _config(tmp_path, inputs, "c", max_nonfinite=3)  # tolerated (the default, 0, stops at the first)
    run = torchrun(inputs, tmp_path / "out", config, fault="nan@2,hang_at_exit@0:1")
    assert run.returncode == 0, run.output[-4000:]
    assert "rank 1 hangs in its teardown" in run.output and run.seconds < 200
    records = _metrics(tmp_path / "out")
    bad = records[2]
    assert bad["nonfinite"] and bad["skipped"] and bad["grad_norm"] is None and bad["loss"] is None
    assert [r["nonfinite_total"] for r in records] == [0, 0, 1, 1, 1, 1, 1]
    assert all(r["grad_norm"] is not None for r in records[3:])
    assert _summary(run.output)["nonfinite_total"] == 1


def test_too_many_nonfinite_steps_abort_with_a_clear_message(inputs, tmp_path):
    config = _config(tmp_path, inputs, "c")  # the default: the first one stops the run, as the gate would fail it
    run = torchrun(inputs, tmp_path / "out", config, fault="nan@1")
    assert run.returncode != 0
    assert "NonFiniteError" in run.output and "train.max_nonfinite=0" in run.output
    assert [r["step"] for r in _metrics(tmp_path / "out")] == [0, 1]  # the bad step is logged first


def _same_drafter(a: Path, b: Path) -> bool:
    return (a / "drafter" / "model.safetensors").read_bytes() == (b / "drafter" / "model.safetensors").read_bytes()


def test_kill_9_then_rerun_resumes_bit_identically(inputs, baseline, tmp_path):
    base_out, config, _ = baseline
    out = tmp_path / "out"
    killed = torchrun(inputs, out, config, fault="kill@5:1")
    assert killed.returncode != 0 and "SIGKILL" in killed.output
    assert (out / "checkpoints" / "step-3").exists() and not (out / "drafter").exists()
    resumed = torchrun(inputs, out, config)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert _summary(resumed.output)["start_step"] == 3
    assert _summary(resumed.output)["steps_redone"] == 2  # steps 3 and 4 were logged before the kill
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(7))  # each step exactly once
    base = _metrics(base_out)
    assert [r["loss"] for r in records] == [r["loss"] for r in base]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in base]
    assert _same_drafter(out, base_out)


def test_wandb_has_every_step_once_after_rank_0_is_killed_and_the_run_resumed(inputs, tmp_path):
    """Rank 0 killed outright before step 5: W&B (offline) had written none of its records (it writes whole
    32 KiB blocks), so the relaunch removes that empty folder (`wandb sync` stops at one), logs the steps
    metrics.jsonl kept (0-2) and then those it re-runs (before, it took metrics.jsonl's steps 0-4 for W&B's and
    logged 5 and 6 alone)."""
    from dflash_core.monitor.sinks import wandb_file_steps

    out = tmp_path / "out"
    config = _config(tmp_path, inputs, "wandb", wandb={"mode": "offline", "project": "t"})
    killed = torchrun(inputs, out, config, fault="kill@5:0")
    assert killed.returncode != 0 and "SIGKILL" in killed.output
    resumed = torchrun(inputs, out, config)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert _summary(resumed.output)["start_step"] == 3
    assert "killed before W&B wrote a record" in resumed.output
    logged = [step for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
              for kind, step in wandb_file_steps(path) if kind == "train"]
    assert logged == list(range(7))


def test_sigterm_checkpoints_the_step_reached_and_the_rerun_resumes_bit_identically(inputs, baseline, tmp_path):
    """A preempted pod's ranks get SIGTERM (here rank 0 alone, before step 4): every rank finishes step 4, writes
    the checkpoint step-5 together (not one of the every-3 schedule) and stops with a message saying so; the
    rerun resumes there and ends with the bytes of the uninterrupted run."""
    base_out, config, _ = baseline
    out = tmp_path / "out"
    stopped = torchrun(inputs, out, config, fault="sigterm@4:0")
    assert stopped.returncode != 0
    assert "SIGTERM: checkpointing at the end of this step" in stopped.output
    assert "stopped on SIGTERM after plan step 4 (5 of 7 steps done): checkpoint step-5 is written" in stopped.output
    ckpts = CheckpointManager(out / "checkpoints", keep=2)
    assert ckpts.latest().name == "step-5" and not (out / "drafter").exists()
    resumed = torchrun(inputs, out, config)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert _summary(resumed.output)["start_step"] == 5
    assert [r["step"] for r in _metrics(out)] == list(range(7))
    assert [r["loss"] for r in _metrics(out)] == [r["loss"] for r in _metrics(base_out)]
    assert _same_drafter(out, base_out)


def test_a_cancelled_launch_gives_the_ranks_time_to_checkpoint(inputs, tmp_path):
    """Cancelling (a Prefect cancel, train.timeout_s) SIGTERMs the process group: the ranks checkpoint the step they
    reached within the grace period, so the rerun does not start over (checkpoint_every is 100 here)."""
    import threading

    one = build_inputs(inputs.root, world_size=1)
    config = _config(tmp_path, one, "c", checkpoint_every=100)
    out = tmp_path / "out"
    cancel = threading.Event()

    def watch() -> None:  # cancel once two steps are logged
        metrics = out / "metrics.jsonl"
        while not cancel.wait(0.05):
            if metrics.exists() and metrics.read_text().count("\n") >= 2:
                cancel.set()

    threading.Thread(target=watch, daemon=True).start()
    # the cancel first (it is the cause), then what the ranks said as they stopped
    with pytest.raises(TrainingFailed, match="^training was cancelled; rank 0: StoppedBySignal: stopped on SIGTERM "
                                             "after plan step"):
        launch_train(one.tokenized, one.plan, str(out), config, on_line=lambda _: None, timeout_s=600,
                     cancel=cancel, env={"DFLASH_FAULT": "slow@0"})
    [step] = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")]
    done = int(step.split("-")[1])
    assert done >= 2
    resumed = launch_train(one.tokenized, one.plan, str(out), config, on_line=lambda _: None, timeout_s=600)
    assert resumed["start_step"] == done and resumed["steps"] == resumed["num_steps"] - done


def test_a_sigterm_to_the_launcher_lets_the_ranks_checkpoint_before_it_ends(inputs, tmp_path):
    """Kubernetes stops a pod by SIGTERM to its first process, the launcher (here `dflash train` run the way the
    flow's task runs it): the ranks get their grace, write the step they reached, and the launcher then ends by
    the signal as it would have; the checkpoint is there for the next pod."""
    import os
    import signal
    import subprocess
    import sys
    import time as clock

    from common.runs import REPO

    one = build_inputs(inputs.root, world_size=1)
    config = _config(tmp_path, one, "c", checkpoint_every=100)
    out = tmp_path / "out"
    code = ("import sys; from dflash_core.runtime.launch import launch_train; "
            f"launch_train({one.tokenized!r}, {one.plan!r}, {str(out)!r}, {config!r}, timeout_s=600)")
    env = {**os.environ, "DFLASH_FAULT": "slow@0", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = clock.monotonic() + 300
    while clock.monotonic() < deadline and not (
            (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        clock.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGTERM, output[-3000:]
    assert "stopped on SIGTERM after plan step" in output
    [step] = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")]
    assert int(step.split("-")[1]) >= 2


def test_a_rerun_with_a_lower_lr_resumes_at_that_lr(inputs, baseline, tmp_path):
    """The non-finite abort says to lower train.lr: the rerun resumes from the newest checkpoint and trains on
    at the new lr from the schedule's position (a checkpoint used to bring back the lr it was written with)."""
    base_out, _, _ = baseline
    out = tmp_path / "out"
    config = _config(tmp_path, inputs, "lr", ALL_ANCHORS)
    killed = torchrun(inputs, out, config, fault="kill@5:1")
    assert killed.returncode != 0
    lower = _config(tmp_path, inputs, "lower", ALL_ANCHORS, lr=1e-4, clip_grad=0.5)
    resumed = torchrun(inputs, out, lower)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "note: resumed with train {'initial_lr': 0.0001}" in resumed.output
    # any other setting that changes what is learned is said too, and the summary keeps it
    start = _summary(resumed.output)["start_step"]
    assert (f"note: resumed with settings changed since checkpoint step-{start}: train.clip_grad 1.0 -> 0.5; "
            f"steps before {start} were trained with the old ones") in resumed.output
    assert _summary(resumed.output)["changed_on_resume"] == {"train.clip_grad": [1.0, 0.5]}  # the launch ledger's
    assert "lr schedule now spans" not in resumed.output  # same max_steps: the schedule is the same
    records, base = _metrics(out), _metrics(base_out)
    base_lr, start = yaml.safe_load(Path(config).read_text())["train"]["lr"], _summary(resumed.output)["start_step"]
    assert 0 < start < len(base) and [r["step"] for r in records] == list(range(len(base)))
    for record, reference in zip(records[start:], base[start:], strict=True):  # the steps after the resume
        assert record["lr"] == pytest.approx(reference["lr"] * 1e-4 / base_lr)
    assert [r["lr"] for r in records[:start]] == [r["lr"] for r in base[:start]]


def test_a_resume_that_changes_max_steps_says_the_lr_moved(inputs, baseline, tmp_path):
    """train.max_steps sets what the lr schedule spans: a resume with another value continues on the new schedule,
    whose lr at the resumed step is not the old one's; the log says so (it used to jump without a word)."""
    base_out, _, _ = baseline
    out = tmp_path / "out"
    killed = torchrun(inputs, out, _config(tmp_path, inputs, "steps", ALL_ANCHORS), fault="kill@5:1")
    assert killed.returncode != 0
    total = len(_metrics(base_out)) - 2
    resumed = torchrun(inputs, out, _config(tmp_path, inputs, "fewer", ALL_ANCHORS, max_steps=total))
    assert resumed.returncode == 0, resumed.output[-4000:]
    start = _summary(resumed.output)["start_step"]
    assert f"note: the lr schedule now spans {total} steps (the checkpoint's run: {total + 2}; " in resumed.output
    assert f"the lr at step {start} is " in resumed.output
    assert [r["step"] for r in _metrics(out)] == list(range(total))


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(inputs, baseline, tmp_path):
    base_out, config, _ = baseline
    out = tmp_path / "out"
    crashed = torchrun(inputs, out, config, fault="crash_in_checkpoint@6:0")
    assert crashed.returncode != 0
    ckpts = CheckpointManager(out / "checkpoints", keep=2)
    assert ckpts.latest().name == "step-3" and ckpts.load(ckpts.latest()).step == 3
    assert list((out / "checkpoints").glob(".tmp-step-6-*"))
    resumed = torchrun(inputs, out, config)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    assert _same_drafter(out, base_out)


def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_previous_one_resumed(inputs, baseline, tmp_path):
    """A bucket mounted with gcsfuse renames a folder by copying it file by file, meta.json first: a pod killed
    mid-rename leaves a newest checkpoint that looks complete and does not load. The rerun says so, keeps it aside
    and resumes from the one before, ending with the bytes of the uninterrupted run."""
    base_out, config, _ = baseline
    out = tmp_path / "out"
    shutil.copytree(base_out / "checkpoints", out / "checkpoints")
    shutil.copy(base_out / "metrics.jsonl", out / "metrics.jsonl")
    weights = out / "checkpoints" / "step-7" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    run = torchrun(inputs, out, config)
    assert run.returncode == 0, run.output[-4000:]
    assert re.search(r"warning: checkpoint \S+step-7 cannot be loaded \(\w+: .*\): moved to \S+damaged-step-7-\d+T\d+; "
                     r"resuming from step-6", run.output), run.output[-3000:]
    assert _summary(run.output)["start_step"] == 6
    assert [r["step"] for r in _metrics(out)] == list(range(7))
    assert _same_drafter(out, base_out)
    ckpts = CheckpointManager(out / "checkpoints", keep=2)
    assert [p.name for _, p in ckpts.complete()] == ["step-6", "step-7"]  # step 7 written again, whole
    assert len(list((out / "checkpoints").glob("damaged-step-7-*/model.safetensors"))) == 1


def test_two_nodes_train_one_run_and_each_launcher_ends_with_a_summary(inputs, baseline, tmp_path):
    """Two `dflash train` launches as the two nodes of one run (1 rank each, c10d rendezvous on loopback, the run
    folder shared), the second started once the first holds the run folder's lock (as on a cluster, where node 0
    is up first; the second node joins that run, it is not refused as a rival writer): both exit 0 with a summary
    (rank 0's and rank 1's; the rendezvous, not --node-rank, decides which node gets rank 0), each node keeps its
    own log, and the weights are the 2-rank single-node run's."""
    base_out, config, _ = baseline
    out = tmp_path / "out"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DFLASH_FAULT", None)

    def node(k: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "dflash_app.cli", "train", "--tokenized", inputs.tokenized, "--plan", inputs.plan,
             "--out", str(out), "--config", config, "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(k),
             "--rdzv-endpoint", f"127.0.0.1:{port}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)  # its own group: a failed test stops the node's torchrun too

    nodes = [node(0)]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "out.lock").exists() and nodes[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "out.lock").exists(), "node 0 never locked the run folder"
        nodes.append(node(1))
        second = nodes[1].communicate(timeout=400)  # first: a refused node 1 fails at once, node 0 would wait on it
        assert nodes[1].returncode == 0, second[1][-3000:]
        ended = [nodes[0].communicate(timeout=400), second]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(err[-3000:] for _, err in ended)
    summaries = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in ended]
    assert sorted(s["rank"] for s in summaries) == [0, 1]
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"] == _summary(baseline[2].output)["final_loss"]
    assert (out / "train.log").exists() and (out / "train.node-1.log").exists()
    assert "no node holds the lock" not in ended[0][1]
    [launch] = read_launches(str(out))  # one record for the run's launch, by the node that holds the lock
    assert launch["nodes"] == 2 and launch["outcome"] == "completed" and launch["gpus"] == 0
    assert _same_drafter(out, base_out)


def test_checkpoints_of_another_run_are_not_resumed(inputs, baseline, tmp_path):
    """A run folder reused by a run of another plan or target (a flow retried after its data changed, a reused
    --run-name) must not continue those weights on its own data and export them as its drafter: it stops, naming
    the folder, before training; the same settings (the attention kernel aside) resume as before."""
    base_out, _, _ = baseline
    out = tmp_path / "out"
    shutil.copytree(base_out / "checkpoints", out / "checkpoints")
    other = _config(tmp_path, inputs, "other", {**ALL_ANCHORS, "block_size": 3})
    run = torchrun(inputs, out, other)
    assert run.returncode != 0 and "holds the checkpoints of another run (model.block_size 4 -> 3)" in run.output, \
        run.output[-3000:]
    assert not (out / "drafter").exists()
    same = _config(tmp_path, inputs, "same", {**ALL_ANCHORS, "attention": "sdpa"})
    run = torchrun(inputs, out, same)
    assert run.returncode == 0 and _summary(run.output)["start_step"] == 7, run.output[-3000:]


def test_missing_shard_is_a_clear_error_naming_the_file(inputs, tmp_path):
    tok = tmp_path / "tokenized"
    shutil.copytree(inputs.tokenized, tok)
    (tok / "part-00002.parquet").unlink()
    config = _config(tmp_path, inputs, "c")
    broken = type(inputs)(str(tok), inputs.plan, inputs.target, inputs.root)
    run = torchrun(broken, tmp_path / "out", config)
    assert run.returncode != 0
    assert re.search(r"ShardError: .*part-00002\.parquet: missing part file", run.output)


def test_plan_for_another_world_size_or_other_shards_is_refused_before_work(inputs, tmp_path):
    config = _config(tmp_path, inputs, "c")
    run = torchrun(inputs, tmp_path / "out", config, nproc=1)
    assert run.returncode != 0
    assert "was made for world_size 2, but this launch has 1 processes" in run.output
    assert not (tmp_path / "out").exists()  # nothing was started
    other = type(inputs)(write_shards(tmp_path / "other", 96, seed=1), inputs.plan, inputs.target, inputs.root)
    run = torchrun(other, tmp_path / "out", config)
    assert run.returncode != 0 and "fingerprint" in run.output and "re-run `dflash plan" in run.output


def test_launch_train_streams_lines_and_returns_the_summary(inputs, tmp_path):
    """launch_train from token shards on an object store (memory:// here, which the rank processes could not even
    see): they are copied to a temporary local folder for the run, which is gone afterwards."""
    one = build_inputs(inputs.root, world_size=1)  # same shards and target, a plan for one process
    config = _config(tmp_path, one, "c", checkpoint_every=100)
    remote = f"memory://bucket-{tmp_path.name}/tokenized"
    fs = fsspec.filesystem("memory")
    fs.put(f"{one.tokenized}/", f"{remote}/", recursive=True)
    lines: list[str] = []
    summary = launch_train(remote, one.plan, str(tmp_path / "out"), config, nproc_per_node=1,
                           on_line=lines.append, timeout_s=600)
    assert summary["world_size"] == 1 and summary["steps"] == summary["num_steps"] > 0
    assert summary["final_loss"] is not None and lines[-1].startswith("{")
    copied = next(line for line in lines if line.startswith("copying the token shards"))
    local = copied.rsplit(" to ", 1)[1]
    assert f"from {remote} to" in copied and Path(local).name.startswith("dflash-tokenized-")
    assert not Path(local).exists() and copied in (tmp_path / "out" / "train.log").read_text()
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == [f"step-{summary['num_steps']}"]
    # the same launch again (a retried flow run whose training had finished) trains nothing and reports the run
    again = launch_train(remote, one.plan, str(tmp_path / "out"), config, nproc_per_node=1,
                         on_line=lambda _: None, timeout_s=600)
    assert again["steps"] == 0 and again["start_step"] == summary["num_steps"]
    for key in ("final_loss", "final_acc", "accept_len", "val_loss", "val_accept_len"):
        assert again[key] == summary[key], key  # not nulls
    # both launches are in the run's ledger; on this CPU machine they held no GPU
    ledger = read_launches(str(tmp_path / "out"))
    assert [(r["outcome"], r["start_step"], r["steps"], r["gpus"]) for r in ledger] == [
        ("completed", 0, summary["num_steps"], 0), ("completed", summary["num_steps"], 0, 0)]
    assert summary["cost"]["launches"] == 1 and again["cost"]["launches"] == 2
    assert again["cost"]["gpu_hours"] == 0 and again["cost"]["steps_redone"] == 0
    assert again["cost"]["wall_s"] == pytest.approx(sum(r["wall_s"] for r in ledger))


def test_a_run_folder_on_an_object_store_is_mirrored_and_a_killed_run_resumes_from_it(inputs, tmp_path):
    """--out on an object store (memory:// here, which the ranks cannot see): the ranks train in a local folder
    pushed to it; a run killed at step 5 leaves its step-3 checkpoint and metrics there, and the next launch
    (its staging folder gone, as on a fresh pod) resumes from them and ends with the bytes of an uninterrupted
    local run."""
    one = build_inputs(inputs.root, world_size=1)
    config = _config(tmp_path, one, "c")  # a checkpoint every 3 steps, 2 kept
    base = tmp_path / "local"
    launch_train(one.tokenized, one.plan, str(base), config, on_line=lambda _: None, timeout_s=600)
    remote, fs = f"memory://runs-{tmp_path.name}/run", fsspec.filesystem("memory")
    lines: list[str] = []
    with pytest.raises(TrainingFailed):
        launch_train(one.tokenized, one.plan, remote, config, on_line=lines.append, timeout_s=600,
                     env={"DFLASH_FAULT": "kill@5"})
    staged = next(line for line in lines if "is on an object store" in line)
    assert not Path(staged.split("the ranks write ", 1)[1].split(",", 1)[0]).exists()
    assert fs.exists(f"{remote}/checkpoints/step-3/meta.json") and not fs.exists(f"{remote}/drafter")
    assert fs.cat_file(f"{remote}/metrics.jsonl").count(b"\n") >= 3
    summary = launch_train(one.tokenized, one.plan, remote, config, on_line=lines.append, timeout_s=600)
    assert "resuming from its checkpoints/step-3" in lines[-1] or any("resuming from its checkpoints/step-3" in x
                                                                         for x in lines)
    assert summary["start_step"] == 3 and summary["drafter"] == f"{remote}/drafter"
    # the ledger on the store holds both launches: the killed one (pushed at its end), then the resume
    ledger = [json.loads(x) for x in fs.cat_file(f"{remote}/launches.jsonl").decode().splitlines()]
    assert [r["outcome"] for r in ledger] == ["failed", "completed"]
    assert ledger[0]["error"].startswith("training ") and ledger[1]["steps_redone"] == 2
    assert summary["cost"]["launches"] == 2 and summary["cost"]["failed_launches"] == 1
    assert summary["cost"]["steps_redone"] == 2
    assert any(x.startswith("this run was launched 1 time(s) before (1 failed; the last failed: training ")
               for x in lines)  # the resume says so first
    assert summary["metrics"] == f"{remote}/metrics.jsonl"
    records = [json.loads(x) for x in fs.cat_file(f"{remote}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records] == [r["step"] for r in _metrics(base)]  # each step once
    assert [r["loss"] for r in records] == [r["loss"] for r in _metrics(base)]
    assert fs.cat_file(f"{remote}/drafter/model.safetensors") == (base / "drafter" / "model.safetensors").read_bytes()
    steps = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{remote}/checkpoints", detail=False))
    assert steps == sorted(p.name for p in (base / "checkpoints").iterdir())  # pruned as the run prunes
    assert fs.cat_file(f"{remote}/train.log").decode().count("is on an object store") == 2  # both launches


@pytest.fixture
def wandb_service_here(tmp_path):
    """A W&B service of this process, as a flow's process has after a promotion logged its artifact: WANDB_SERVICE
    set. Started and stopped here unless a test before started one."""
    import wandb

    started = not os.environ.get("WANDB_SERVICE")
    if started:
        wandb.init(mode="offline", dir=str(tmp_path / "here"), project="t").finish()
    assert os.environ.get("WANDB_SERVICE")
    yield
    if started:
        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)  # teardown stops the service but leaves the variable naming it


def test_wandb_has_every_step_once_after_a_run_on_an_object_store_is_killed_and_resumed(inputs, tmp_path,
                                                                                           wandb_service_here):
    """As on a local disk (test_wandb_has_every_step_once_after_rank_0_is_killed_and_the_run_resumed), with the
    run folder on an object store: the resume pulls the killed launch's W&B log (no record: killed before W&B's
    first block), so it logs the kept steps 0-2 again, and the empty folder goes from the store. Before, the pull
    left wandb/ on the store, the resume took metrics.jsonl's steps for W&B's, and W&B never got steps 0-2; the
    empty folder stayed there and stopped `wandb sync`. The launching process has a W&B service of its own
    (wandb_service_here): the killed rank's run must not stay open in it, or the resume gets "run ID ... is in
    use" and no W&B run (launch.worker_env; a test file run before this one in the same pytest worker made CI
    fail so)."""
    from dflash_core.monitor.sinks import wandb_file_steps

    one = build_inputs(inputs.root, world_size=1)
    config = _config(tmp_path, one, "wandb-store", wandb={"mode": "offline", "project": "t"})
    remote, fs = f"memory://runs-{tmp_path.name}/run", fsspec.filesystem("memory")
    with pytest.raises(TrainingFailed):
        launch_train(one.tokenized, one.plan, remote, config, on_line=lambda _: None, timeout_s=600,
                     env={"DFLASH_FAULT": "kill@5"})
    assert len(fs.glob(f"{remote}/wandb/offline-run-*/run-*.wandb")) == 1  # the killed launch's, pushed at its end
    summary = launch_train(one.tokenized, one.plan, remote, config, on_line=lambda _: None, timeout_s=600)
    assert summary["start_step"] == 3
    assert "killed before W&B wrote a record" in fs.cat_file(f"{remote}/train.log").decode()
    logs = fs.glob(f"{remote}/wandb/offline-run-*/run-*.wandb")
    w_and_b = [line for line in fs.cat_file(f"{remote}/train.log").decode().splitlines() if "W&B" in line]
    assert len(logs) == 1, (fs.find(f"{remote}/wandb"), w_and_b)  # the resumed launch's: the empty one is gone
    local = tmp_path / "run.wandb"
    fs.get_file(logs[0], str(local))
    steps = [json.loads(x)["step"] for x in fs.cat_file(f"{remote}/metrics.jsonl").decode().splitlines()
             if json.loads(x).get("kind", "train") == "train"]
    assert steps == list(range(len(steps))) and len(steps) > 5
    assert [step for kind, step in wandb_file_steps(local) if kind == "train"] == steps  # each once, 0-2 included
    fs.rm(remote, recursive=True)


def test_a_failed_launch_says_the_failing_ranks_error_first_and_keeps_the_log(inputs, tmp_path):
    one = build_inputs(inputs.root, world_size=1)
    tok = tmp_path / "tokenized"
    shutil.copytree(one.tokenized, tok)
    (tok / "part-00001.parquet").unlink()
    config = _config(tmp_path, one, "c")
    out = tmp_path / "out"
    with pytest.raises(TrainingFailed) as info:
        launch_train(str(tok), one.plan, str(out), config, nproc_per_node=1, on_line=lambda _: None, timeout_s=600)
    first = str(info.value).splitlines()[0]
    assert first.startswith("training failed on rank 0: ShardError: ") and "part-00001.parquet" in first
    assert f"full log: {out / 'train.log'}" in first
    assert info.value.exit_code == 2  # a part file missing is bad input (a ShardError), found by a rank
    assert "Traceback" in (out / "train.log").read_text()


def test_a_plan_on_an_object_store_is_copied_for_the_ranks(inputs, tmp_path):
    """Token shards and the plan folder both on an object store (memory:// here, which the rank processes cannot
    see), the run folder local: the launcher checks the plan where it is, gives the ranks a local copy of it
    (like the shards), and deletes both copies afterwards."""
    one = build_inputs(inputs.root, world_size=1)
    config = _config(tmp_path, one, "c", checkpoint_every=100)
    bucket, fs = f"memory://plan-bucket-{tmp_path.name}", fsspec.filesystem("memory")
    fs.put(f"{one.tokenized}/", f"{bucket}/tokenized/", recursive=True)
    fs.put(f"{one.plan}/", f"{bucket}/plan/", recursive=True)
    lines: list[str] = []
    summary = launch_train(f"{bucket}/tokenized", f"{bucket}/plan", str(tmp_path / "out"), config,
                           nproc_per_node=1, on_line=lines.append, timeout_s=600)
    assert summary["world_size"] == 1 and summary["steps"] == summary["num_steps"] > 0
    copied = next(line for line in lines if line.startswith("copying the plan files"))
    local = copied.rsplit(" to ", 1)[1]
    assert f"from {bucket}/plan to" in copied and Path(local).name.startswith("dflash-plan-")
    assert not Path(local).exists() and copied in (tmp_path / "out" / "train.log").read_text()
    assert any(line.startswith("copying the token shards") for line in lines)
    assert (tmp_path / "out" / "drafter" / "model.safetensors").exists()
