"""The promotion gate: first drafter promoted, a worse one not, atomic swap under injected failures, W&B model."""

import json
import math
import os
import socket
import threading
import time
import uuid

import fsspec
import pytest
from common.models import save_tiny_qwen3, tiny_drafter, tiny_target
from scipy import stats

from dflash_app.config import load_config
from dflash_core import atomic_dir, publish
from dflash_core.model.export import ExportError, save_dflash
from dflash_core.model.paired import paired_gain
from dflash_core.promotion import gate, store
from dflash_core.promotion.gate import decide, promote_if_better
from dflash_core.promotion.store import promoted_drafter, read_promoted


def _drafter(folder, marker: str) -> str:
    """A folder in the serving format (contents are opaque bytes to the store)."""
    fs, root = fsspec.core.url_to_fs(folder)
    fs.makedirs(root, exist_ok=True)
    for name, text in (("config.json", json.dumps({"marker": marker})), ("model.safetensors", marker * 100)):
        with fs.open(f"{root}/{name}", "w") as fh:
            fh.write(text)
    return folder


def _sharded(drafter, folder: str) -> list[str]:
    """A real drafter saved as two shards and the index naming them, as larger published drafters are (and as
    today's production drafter may be copied into promoted/drafter by hand); its file names."""
    from safetensors.torch import load_file, save_file

    save_dflash(drafter, folder)
    tensors = load_file(f"{folder}/model.safetensors")
    os.remove(f"{folder}/model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, f"{folder}/{file}")
    with open(f"{folder}/model.safetensors.index.json", "w") as fh:
        json.dump({"metadata": {}, "weight_map": {k: file for file, part in shards.items() for k in part}}, fh)
    return sorted(["config.json", "model.safetensors.index.json", *shards])


def _read(uri: str) -> str:
    with fsspec.open(uri, "r") as fh:
        return fh.read()


def _scores(tau, incumbent_tau=None, root=None) -> dict:
    """Scores as gate.measure returns them: measured against what `root` holds promoted now (None: nothing)."""
    incumbent = read_promoted(root) if root else None
    return {"tau": tau, "incumbent_tau": incumbent_tau, "incumbent_run": incumbent and incumbent["run"],
            "incumbent_id": store.incumbent_id(root, incumbent) if root else None, "eval_set": {"data": "prompts.jsonl", "limit": 4,
                                                             "max_new_tokens": 16}}


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    return str(tmp_path / "store") if request.param == "local" else f"memory://promo-{uuid.uuid4().hex}"


def _cfg(root: str, **overrides):
    return load_config("tiny-cpu", {"storage.root": root, "wandb.mode": "disabled", **overrides})


def test_first_drafter_is_promoted_a_worse_one_is_not(root, tmp_path):
    cfg = _cfg(root, **{"eval.min_gain": 0.05})
    first = promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    assert first["promoted"] and first["reason"] == "nothing was promoted yet"
    record = read_promoted(root)
    assert record["run"] == "runs/a" and record["tau"] == 1.4 and record["incumbent_tau"] is None
    assert record["eval_set"]["limit"] == 4 and "time" in record
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "A"}
    before = _read(f"{root}/promoted/promoted.json")

    worse = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass",
                              _scores(1.42, 1.4, root))
    assert not worse["promoted"] and "does not beat" in worse["reason"]  # better, but by less than min_gain
    assert _read(f"{root}/promoted/promoted.json") == before
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "A"}

    better = promote_if_better(cfg, "runs/c", _drafter(f"{root}/runs/c/drafter", "C"), "pass",
                               _scores(1.6, 1.4, root))
    assert better["promoted"] and read_promoted(root)["incumbent_tau"] == 1.4
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "C"}
    fs, path = fsspec.core.url_to_fs(f"{root}/promoted")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path.rsplit("/", 1)[0], detail=False)) == ["promoted", "runs"]


@pytest.mark.parametrize(("verdict", "tau", "incumbent", "expected"), [
    ("pass", 1.5, None, True),
    ("warn", 1.9, None, False),  # only a clean stability verdict promotes
    ("fail", 1.9, 1.0, False),
    ("pass", None, None, False),  # no decoding steps: nothing to compare
    ("pass", 1.5, 1.5, False),  # a tie is not a gain
    ("pass", 1.51, 1.5, True),
])
def test_decide(verdict, tau, incumbent, expected):
    assert decide(verdict, tau, incumbent, 0.0)[0] is expected


def test_the_paired_gain_is_a_one_sided_t_test_over_the_same_responses():
    new = [2.0, 2.5, None, 3.1, 2.2, 2.9]
    old = [1.8, 2.4, 1.9, 2.6, 2.3, 2.5]  # the third response had no step under the new drafter: left out
    gain = paired_gain(new, old, 0.05, 0.95)
    diffs = [0.2, 0.1, 0.5, -0.1, 0.4]
    want = stats.ttest_1samp(diffs, 0.05, alternative="greater")
    assert gain["pairs"] == 5 and gain["mean"] == pytest.approx(0.22)
    assert gain["p_value"] == pytest.approx(want.pvalue)
    low = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.90).low  # two-sided 90% = one-sided 95% bound
    assert gain["lower"] == pytest.approx(low)
    assert paired_gain([2.0, 2.0], [1.5, 1.5], 0.0, 0.95)["p_value"] == 0.0  # no spread: the gain is exact
    assert paired_gain([2.0], [1.5, 1.5], 0.0, 0.95)["note"].startswith("the drafters decoded different")


def test_responses_to_the_same_prompt_are_one_pair():
    """Server sampling wraps a short suite round (and a file may list a prompt twice): the repeats are one
    measurement, so their gains are averaged into one pair and the test runs over distinct prompts."""
    new = [2.0, 2.5, 3.1, 2.0, 2.5, 2.9]
    old = [1.8, 2.4, 2.6, 1.8, 2.4, 2.5]
    prompts = [0, 1, 2, 0, 1, 3]  # prompts 0 and 1 decoded twice (greedy: the same figures again)
    gain = paired_gain(new, old, 0.0, 0.95, prompts=prompts, old_prompts=prompts)
    diffs = [0.2, 0.1, 0.5, 0.4]
    want = stats.ttest_1samp(diffs, 0.0, alternative="greater")
    assert gain["pairs"] == 4 and gain["repeats"] == 2 and gain["mean"] == pytest.approx(0.3)
    assert gain["p_value"] == pytest.approx(want.pvalue)
    counted_twice = paired_gain(new, old, 0.0, 0.95)  # each response a pair of its own: a falsely tighter bound
    assert counted_twice["pairs"] == 6 and "repeats" not in counted_twice
    assert counted_twice["p_value"] < gain["p_value"] and counted_twice["lower"] > gain["lower"]
    sampled = paired_gain([2.0, 3.0, 2.5, 2.0], [1.5, 1.5, 2.0, 1.0], prompts=[0, 0, 1, 2])  # draws differ: averaged
    assert sampled["pairs"] == 3 and sampled["mean"] == pytest.approx((1.0 + 0.5 + 1.0) / 3)
    assert paired_gain([2.0, 2.2], [1.0, 1.1], prompts=[0, 1], old_prompts=[1, 0])["note"] == (
        "the drafters decoded different prompts: nothing pairs")


def test_the_paired_gain_of_too_few_pairs_says_so_and_an_exact_gain_is_its_own_bound():
    assert paired_gain([2.0, 2.5, 3.0], [1.5, None, 2.0])["pairs"] == 2  # no step under the old drafter: left out
    one = paired_gain([2.0, 2.5], [1.0, None])
    assert one["pairs"] == 1 and one["p_value"] is None and one["note"].startswith("fewer than 2")
    none = paired_gain([None, None], [1.0, 1.0])
    assert none["pairs"] == 0 and none["mean"] is None and none["p_value"] is None
    assert paired_gain([2.0, 3.0], [1.5, 2.5])["lower"] == pytest.approx(0.5)  # no spread


@pytest.mark.parametrize(("p_value", "expected"), [(0.01, True), (0.2, False), (None, False)])
def test_with_a_confidence_a_gain_within_noise_does_not_promote(p_value, expected):
    gain = {"pairs": 16, "mean": 0.1, "lower": 0.02, "p_value": p_value, "confidence": 0.95}
    ok, reason = decide("pass", 1.6, 1.5, 0.0, gain, confidence=0.95)
    assert ok is expected
    assert ("within evaluation noise" in reason) is (p_value == 0.2)
    assert decide("pass", 1.6, 1.5, 0.0, gain)[0] is True  # without a confidence only tau counts
    assert decide("pass", 1.6, None, 0.0, None, confidence=0.95)[0] is True  # the first one needs no test


def test_the_gate_records_the_paired_gain_and_applies_the_configured_confidence(root):
    cfg = _cfg(root, **{"eval.confidence": 0.9})
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    noisy = {**_scores(1.45, 1.4, root), "gain": paired_gain([1.0, 2.0, 1.6], [1.5, 1.2, 1.7], 0.0, 0.9)}
    decision = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", noisy)
    assert not decision["promoted"] and decision["gain"]["pairs"] == 3 and read_promoted(root)["run"] == "runs/a"
    clear = {**_scores(1.9, 1.4, root), "gain": paired_gain([1.9, 2.0, 1.8], [1.4, 1.4, 1.4], 0.0, 0.9)}
    decision = promote_if_better(cfg, "runs/c", _drafter(f"{root}/runs/c/drafter", "C"), "pass", clear)
    assert decision["promoted"] and read_promoted(root)["gain"]["p_value"] < 0.1
    with pytest.raises(Exception, match="confidence"):
        _cfg(root, **{"eval.confidence": 0.3})


def test_a_crash_while_copying_leaves_the_promoted_drafter_intact(root, monkeypatch):
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    before = _read(f"{root}/promoted/promoted.json")
    real_copy, copied = store.copy_file, []

    def dies_on_the_second_file(*args):
        if copied:
            raise OSError("injected: node lost in the middle of the copy")
        copied.append(args)
        real_copy(*args)

    monkeypatch.setattr(store, "copy_file", dies_on_the_second_file)
    with pytest.raises(OSError, match="injected"):
        promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", _scores(2.0, 1.4, root))
    monkeypatch.undo()
    assert _read(f"{root}/promoted/promoted.json") == before
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "A"}
    fs, path = fsspec.core.url_to_fs(f"{root}/promoted")
    assert fs.glob(f"{path}.staged-*")  # the debris of the failed copy ...
    assert read_promoted(root)["run"] == "runs/a"
    assert not fs.glob(f"{path}.staged-*")  # ... is cleaned up by the next reader


def _killed_between_the_two_moves(root: str, monkeypatch) -> list[str]:
    """A promoter swapping a new drafter into `root`'s promoted/ killed between its two renames (the old one
    moved aside, the new one not yet in); returns the moves' destinations."""
    fs, _ = fsspec.core.url_to_fs(root)
    real_mv, moves = type(fs).mv, []

    def second_move_dies(self, path1, path2, **kw):
        moves.append(path2)
        if len(moves) == 2:
            raise OSError("injected: killed between moving the old one aside and the new one in")
        return real_mv(self, path1, path2, **kw)

    monkeypatch.setattr(type(fs), "mv", second_move_dies)
    with pytest.raises(OSError, match="injected"):
        atomic_dir.replace_dir(f"{root}/promoted", lambda staged: _drafter(f"{staged}/drafter", "X"))
    monkeypatch.undo()
    return moves


def test_a_crash_between_the_two_moves_is_recovered(tmp_path, monkeypatch):
    """On a local disk the swap is two renames: a kill between them leaves no `promoted/`, and the old folder is
    moved back."""
    root = str(tmp_path / "store")
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    moves = _killed_between_the_two_moves(root, monkeypatch)
    fs, _ = fsspec.core.url_to_fs(root)
    assert len(moves) == 2 and not fs.exists(f"{root}/promoted")  # the state a kill there would leave
    assert read_promoted(root)["run"] == "runs/a"  # the old folder was moved back
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "A"}


def test_a_crash_at_any_file_operation_of_an_object_store_swap_keeps_a_whole_promoted_drafter(monkeypatch):
    """On object storage a move is a copy then a delete, so a kill can leave `promoted/` half copied or half
    deleted beside a whole old copy. Killed at every file copy and delete of the swap in turn, a reader then
    finds the old promoted drafter whole (or, killed after the new one was whole, the new one), with its own
    record and files, never a half folder, nothing, or a mix."""
    import itertools

    fs = fsspec.filesystem("memory")
    kinds = {"cp_file": type(fs).cp_file, "rm": type(fs).rm}
    outcomes = set()
    for kind, k in itertools.product(kinds, range(1, 12)):
        root = f"memory://crash-{uuid.uuid4().hex}"
        cfg = _cfg(root)
        promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
        calls: list[str] = []

        def dies(self, *args, _kind=kind, _k=k, calls=calls, **kw):
            calls.append(_kind)
            if calls.count(_kind) == _k:
                raise OSError(f"injected: killed at {_kind} #{_k}")
            return kinds[_kind](self, *args, **kw)

        monkeypatch.setattr(type(fs), kind, dies)
        try:
            atomic_dir.replace_dir(f"{root}/promoted", lambda staged: (
                _drafter(f"{staged}/drafter", "B"), fs.pipe(f"{staged}/promoted.json", b'{"run": "runs/b"}')))
            died = False
        except OSError:
            died = True
        monkeypatch.undo()
        record = read_promoted(root)
        assert record is not None, (kind, k)
        marker = json.loads(_read(f"{promoted_drafter(root)}/config.json"))["marker"]
        weights = _read(f"{promoted_drafter(root)}/model.safetensors")
        assert (record["run"], marker, weights) in {("runs/a", "A", "A" * 100), ("runs/b", "B", "B" * 100)}, \
            (kind, k, record, marker)
        assert not fs.glob(f"{root}/promoted.*") and not fs.glob(f"{root}/promoted.old-*")  # no leftovers
        outcomes.add((died, record["run"]))
    assert (True, "runs/a") in outcomes and (False, "runs/b") in outcomes  # kills before and after it was whole


def _measured_as(monkeypatch, root: str, incumbent_tau: float | None) -> list[str]:
    """The gate's decoding faked: the promoted drafter scores `incumbent_tau`, any other 1.3; returns the list of
    drafter folders measured, in order."""
    measured: list[str] = []

    def tau_of(cfg, target, drafter_dir):
        measured.append(drafter_dir)
        return {"tau": incumbent_tau if drafter_dir == promoted_drafter(root) else 1.3, "per_response": [1.0, 2.0]}

    monkeypatch.setattr(gate, "_tau", tau_of)
    monkeypatch.setattr("dflash_core.model.evaluate.eval_target", lambda *a, **k: None)
    return measured


def test_a_drafter_placed_by_hand_is_an_incumbent_to_beat_and_a_damaged_store_fails_before_training(
        root, monkeypatch):
    """Today's production drafter copied into promoted/drafter without a promoted.json: warm starts already
    start from it, so the gate measures it too and a new drafter must beat it (it was replaced unmeasured as
    'nothing was promoted yet'). A promoted.json whose drafter lost its files stops the run at once, naming
    them (the run trained from scratch and failed measuring the incumbent after the GPU hours)."""
    cfg = _cfg(root)
    _drafter(promoted_drafter(root), "HAND")
    measured = _measured_as(monkeypatch, root, incumbent_tau=1.5)
    scores = gate.measure(cfg, f"{root}/runs/b/drafter")
    assert measured == [f"{root}/runs/b/drafter", promoted_drafter(root)]
    assert scores["incumbent_tau"] == 1.5 and scores["incumbent_run"] == gate.PLACED
    decision = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", scores)
    assert not decision["promoted"] and "does not beat" in decision["reason"]
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "HAND"}
    assert store.resolve_init_from(cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"init_from": "promoted"})})).train.init_from == promoted_drafter(root)

    promote_if_better(cfg, "runs/c", _drafter(f"{root}/runs/c/drafter", "C"), "pass", {
        **gate.measure(cfg, f"{root}/runs/c/drafter"), "tau": 9.0})
    fs, _ = fsspec.core.url_to_fs(root)
    fs.rm(f"{promoted_drafter(root)}/model.safetensors")
    with pytest.raises(store.PromotionError, match="names run runs/c but its drafter lacks model.safetensors"):
        store.check_incumbent(root)


def test_a_sharded_drafter_placed_by_hand_is_measured_kept_and_warm_started_from(tmp_path, monkeypatch):
    """Today's production drafter placed by hand in shards (index + shards, no model.safetensors, no promoted.json)
    is a drafter like any other: the start check reads it, the gate measures it and keeps it when the new one is
    not better, and warm starts start from it. It was taken for "nothing promoted": replaced unmeasured, the
    warm start trained from scratch, the start check passed."""
    target, root = save_tiny_qwen3(tmp_path / "target"), str(tmp_path / "store")
    files = _sharded(tiny_drafter(tiny_target()), promoted_drafter(root))
    store.check_incumbent(root, target)  # whole, for this target
    cfg = _cfg(root, **{"eval.min_gain": 100.0})
    measured = _measured_as(monkeypatch, root, incumbent_tau=1.0)
    new_dir = _drafter(str(tmp_path / "runs" / "b" / "drafter"), "B")
    scores = gate.measure(cfg, new_dir)
    assert measured == [new_dir, promoted_drafter(root)] and scores["incumbent_run"] == gate.PLACED
    decision = promote_if_better(cfg, "runs/b", new_dir, "pass", scores)
    assert not decision["promoted"] and "does not beat the promoted drafter's 1.0000 by more than 100.0" in \
        decision["reason"]
    assert sorted(os.listdir(promoted_drafter(root))) == files and read_promoted(root) is None
    warm = cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": "promoted"})})
    assert store.resolve_init_from(warm).train.init_from == promoted_drafter(root)
    os.remove(f"{promoted_drafter(root)}/model-00002-of-00002.safetensors")  # a copy that did not finish:
    with pytest.raises(store.PromotionError, match=r"model-00002-of-00002.safetensors: missing .*copy the drafter "
                                                   r"placed there by hand again"):
        store.check_incumbent(root, target)  # refused at the start, not taken for "nothing promoted"


def test_a_sharded_drafter_is_promoted_whole_and_found_again_by_its_retry(tmp_path):
    """Promoting a sharded drafter copies config.json, the index and every shard it names (not config.json and a
    model.safetensors it does not have); a retry of the run finds it promoted, byte for byte."""
    root, run = str(tmp_path / "store"), str(tmp_path / "runs" / "a")
    files = _sharded(tiny_drafter(tiny_target()), f"{run}/drafter")
    decision = promote_if_better(_cfg(root), run, f"{run}/drafter", "pass", _scores(1.4))
    assert decision["promoted"] and sorted(os.listdir(promoted_drafter(root))) == files
    assert store.missing_files(root) == [] and store.holds(root, f"{run}/drafter")
    os.remove(f"{promoted_drafter(root)}/model-00001-of-00002.safetensors")
    assert not store.holds(root, f"{run}/drafter")
    assert store.missing_files(root) == ["model-00001-of-00002.safetensors"]


@pytest.mark.parametrize(("edit", "says"), [
    ({"num_hidden_layers": 3}, r"config.json: `num_hidden_layers` \(3\) must be equal to the number of `layer_types` "
                               r"\(2\)"),
    ({"dflash_config": {"mask_token_id": None}}, r"missing fields \['dflash_config.mask_token_id'\]"),
    ({"layer_types": ["linear_attention"] * 2}, r"\['linear_attention'\] are not DFlash drafter layers"),
    ({"layer_types": None, "num_hidden_layers": 3}, r"model.safetensors: tensor names do not match the config: "
                                                    r"missing \['layers.2.input_layernorm.weight'"),
    ({"intermediate_size": 96}, r"mlp.gate_proj.weight \(128, 64\) != \(96, 64\)"),
], ids=["layer-count", "no-mask-id", "linear-layers", "a-layer-more", "ffn-width"])
def test_an_incumbent_config_the_gate_would_refuse_fails_before_training(tmp_path, edit, says):
    """The start check passed promoted drafters whose config.json load_dflash then refused (no mask token id,
    layer types it does not run, a layer count that is not the layer types' (a raw transformers error that even
    escaped the gate), tensors the config does not make): the night trained, then never promoted or failed. The
    start check now reads config.json as load_dflash does and the weights' headers (no tensor loaded)."""
    target, root = save_tiny_qwen3(tmp_path / "target"), str(tmp_path / "store")
    save_dflash(tiny_drafter(tiny_target()), promoted_drafter(root))
    config = tmp_path / "store" / "promoted" / "drafter" / "config.json"
    raw = json.loads(config.read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            raw[key] = {k: v for k, v in {**raw[key], **value}.items() if v is not None}
        elif value is None:
            del raw[key]
        else:
            raw[key] = value
    config.write_text(json.dumps(raw))
    with pytest.raises(store.PromotionError, match=says):
        store.check_incumbent(root, target)


def test_the_gate_never_replaces_a_drafter_it_could_not_measure_or_serving_is_not_set_for(root, monkeypatch):
    """An incumbent that fails to decode (damaged after the flow's start check) is kept, not treated as absent; a
    better drafter of another block size waits for eval.allow_block_size_change (serving's setting must change
    with it); a retried run that finds its own drafter promoted says so instead of 'not better than itself'."""
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    monkeypatch.setattr("dflash_core.model.evaluate.eval_target", lambda *a, **k: None)
    new_dir = _drafter(f"{root}/runs/b/drafter", "B")

    def decoding(new_block: int, old_block: int = 16, broken: bool = False):
        def tau_of(cfg, target, drafter_dir):
            if drafter_dir != promoted_drafter(root):
                return {"tau": 1.9, "per_response": [1.8, 2.0], "block_size": new_block}
            if broken:
                raise ExportError(f"{drafter_dir}/model.safetensors: not a readable safetensors file")
            return {"tau": 1.4, "per_response": [1.3, 1.5], "block_size": old_block}
        return tau_of

    before = _read(f"{root}/promoted/promoted.json")
    monkeypatch.setattr(gate, "_tau", decoding(16, broken=True))
    scores = gate.measure(cfg, new_dir)
    assert scores["incumbent_tau"] is None and "not a readable safetensors" in scores["incumbent_error"]
    decision = promote_if_better(cfg, "runs/b", new_dir, "pass", scores)
    assert not decision["promoted"] and decision["reason"].startswith("the promoted drafter could not be measured")
    assert f"this run's drafter stays in {new_dir}" in decision["reason"]
    assert _read(f"{root}/promoted/promoted.json") == before

    monkeypatch.setattr(gate, "_tau", decoding(8))
    scores = gate.measure(cfg, new_dir)
    decision = promote_if_better(cfg, "runs/b", new_dir, "pass", scores)
    assert not decision["promoted"] and (decision["block_size"], decision["incumbent_block_size"]) == (8, 16)
    assert "beats the promoted drafter's 1.4000" in decision["reason"]
    assert "but its block size 8 differs from the promoted drafter's 16" in decision["reason"]
    assert _read(f"{root}/promoted/promoted.json") == before
    allowed = promote_if_better(_cfg(root, **{"eval.allow_block_size_change": True}), "runs/b", new_dir, "pass",
                                scores)
    assert allowed["promoted"] and read_promoted(root)["block_size"] == 8

    promoted = _read(f"{root}/promoted/promoted.json")
    monkeypatch.setattr(gate, "_tau", lambda cfg, target, drafter_dir: {"tau": 1.9, "per_response": [1.8, 2.0],
                                                                        "block_size": 8})
    retried = promote_if_better(cfg, "runs/b", new_dir, "pass", gate.measure(cfg, new_dir))
    assert retried["promoted"] and retried["reason"].startswith("this run's drafter is already the promoted one")
    assert retried["promoted_drafter"] == promoted_drafter(root)
    assert _read(f"{root}/promoted/promoted.json") == promoted  # not copied again
    other = _drafter(f"{root}/runs/b2/drafter", "B2")  # same run folder name, other weights: compared as usual
    assert not promote_if_better(cfg, "runs/b", other, "pass", gate.measure(cfg, other))["promoted"]


def test_an_incumbent_the_gate_could_not_measure_fails_before_training(tmp_path):
    """The gate measures the promoted drafter after training; one it cannot load on this run's target (files cut
    short, a record that is no JSON, a drafter for another target) failed the flow after the GPU hours, and every
    night after. It is refused at the start, saying what to restore."""
    target, other = save_tiny_qwen3(tmp_path / "target"), save_tiny_qwen3(tmp_path / "other", hidden=32)
    root = str(tmp_path / "store")
    save_dflash(tiny_drafter(tiny_target()), promoted_drafter(root))  # placed by hand, for `target`
    store.check_incumbent(root, target)  # whole, for this target: not damage
    store.check_incumbent(root)  # no target named: the files alone
    with pytest.raises(store.PromotionError, match=r"trained for another target: hidden_size=64 but the target has "
                                                   r"32; copy the drafter placed there by hand again, or, for a new "
                                                   r"target, give this run its own storage.root"):
        store.check_incumbent(root, other)
    weights = tmp_path / "store" / "promoted" / "drafter" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-10])
    (tmp_path / "store" / "promoted" / "promoted.json").write_text(
        json.dumps({"run": "runs/a", "drafter": "/s/runs/a/drafter"}))
    with pytest.raises(store.PromotionError, match=rf"model.safetensors: {len(whole) - 10} bytes where its header "
                                                   rf"describes {len(whole)}: the file was cut short .* restore it "
                                                   r"from run runs/a's drafter/ folder \(/s/runs/a/drafter\)"):
        store.check_incumbent(root, target)
    weights.write_bytes(b"0123456789")
    with pytest.raises(store.PromotionError, match=r"model.safetensors: not a safetensors file \(10 bytes, no header"):
        store.check_incumbent(root, target)
    weights.write_bytes(whole)
    (tmp_path / "store" / "promoted" / "drafter" / "config.json").write_text("{}")
    with pytest.raises(store.PromotionError, match=r"config.json: architectures must include 'DFlashDraftModel'"):
        store.check_incumbent(root, target)
    (tmp_path / "store" / "promoted" / "promoted.json").write_text("{run: x}")
    with pytest.raises(store.PromotionError, match=r"promoted/promoted.json: not a JSON record \(.*line 1 column 2"):
        read_promoted(root)


@pytest.mark.slow
def test_promoted_drafter_is_logged_as_a_wandb_model_with_alias_production(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    root, run = str(tmp_path / "store"), tmp_path / "run"
    run.mkdir()
    cfg = load_config("tiny-cpu", {"storage.root": root, "wandb.mode": "offline"})
    logged = {}
    real_init = gate.log_model_artifact

    def spy(*args):
        logged["name"] = real_init(*args)
        return logged["name"]

    monkeypatch.setattr(gate, "log_model_artifact", spy)
    decision = promote_if_better(cfg, str(run), _drafter(str(run / "drafter"), "A"), "pass", _scores(1.4))
    assert decision["wandb_artifact"] == logged["name"] == "dflash-drafter:production"
    offline = [p for p in (run / "wandb").iterdir() if p.name.startswith("offline-run")]
    assert offline and any(p.suffix == ".wandb" for p in offline[0].iterdir())


def test_a_wandb_failure_after_the_swap_is_reported_not_raised(tmp_path, monkeypatch):
    """W&B mirrors the promotion; when logging the model fails the drafter is still promoted, and the decision
    (so the flow result and the promotion page) says that the artifact is missing and why."""
    root, run = str(tmp_path / "store"), tmp_path / "run"
    cfg = load_config("tiny-cpu", {"storage.root": root, "wandb.mode": "offline"})

    def unreachable(*args):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(gate, "log_model_artifact", unreachable)
    decision = promote_if_better(cfg, str(run), _drafter(str(run / "drafter"), "A"), "pass", _scores(1.4))
    assert decision["promoted"] and decision["wandb_artifact"] is None and read_promoted(root)["run"] == str(run)
    assert "W&B model artifact was not logged (ConnectionError: api.wandb.ai unreachable)" in decision["reason"]


def test_a_retried_run_logs_the_wandb_model_its_first_attempt_did_not(tmp_path, monkeypatch):
    """A run that stopped between the promotion swap and the W&B model (a crash, W&B down) is retried: it finds
    its drafter already promoted and now logs the model (with the promoted record) and moves `production`; it
    said nothing and logged nothing before. W&B still down: the retry says the artifact was not logged."""
    root, run = str(tmp_path / "store"), str(tmp_path / "run")
    cfg = load_config("tiny-cpu", {"storage.root": root, "wandb.mode": "offline"})
    logged: list[tuple] = []

    def unreachable(*args):
        raise ConnectionError("api.wandb.ai unreachable")

    monkeypatch.setattr(gate, "log_model_artifact", unreachable)
    first = promote_if_better(cfg, run, _drafter(f"{run}/drafter", "A"), "pass", _scores(1.4))
    assert first["promoted"] and first["wandb_artifact"] is None
    retried = promote_if_better(cfg, run, f"{run}/drafter", "pass", _scores(1.4, 1.4, root))
    assert retried["reason"].startswith("this run's drafter is already the promoted one")
    assert "the W&B model artifact was not logged (ConnectionError" in retried["reason"]
    monkeypatch.setattr(gate, "log_model_artifact", lambda *args: logged.append(args) or "dflash-drafter:production")
    retried = promote_if_better(cfg, run, f"{run}/drafter", "pass", _scores(1.4, 1.4, root))
    assert retried["promoted"] and retried["wandb_artifact"] == "dflash-drafter:production"
    [(_, drafter, record, run_dir)] = logged
    assert (drafter, record, run_dir) == (promoted_drafter(root), read_promoted(root), run)
    disabled = promote_if_better(_cfg(root), run, f"{run}/drafter", "pass", _scores(1.4, 1.4, root))
    assert disabled["promoted"] and disabled["wandb_artifact"] is None and len(logged) == 1


def test_overlapping_runs_never_replace_a_drafter_they_were_not_compared_with(root):
    """Two runs measured against the same promoted drafter A: the first to promote wins; the second, better than A
    but never compared with the first one's drafter, is not promoted (fail closed), and says why."""
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    slow, fast = _scores(1.55, 1.4, root), _scores(1.6, 1.4, root)  # both evaluated while A was promoted
    assert promote_if_better(cfg, "runs/c", _drafter(f"{root}/runs/c/drafter", "C"), "pass", fast)["promoted"]
    late = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", slow)
    assert not late["promoted"] and late["promoted_drafter"] is None
    assert "changed while this run was evaluated (now: run runs/c, tau 1.6; measured against: runs/a)" in late["reason"]
    assert read_promoted(root)["run"] == "runs/c"
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "C"}
    first = _scores(1.7)  # measured when nothing was promoted, but something is now
    assert not promote_if_better(cfg, "runs/d", _drafter(f"{root}/runs/d/drafter", "D"), "pass", first)["promoted"]


def test_a_promotion_under_way_is_left_alone_and_a_stale_lock_is_taken_over(root, monkeypatch):
    """While another run holds promoted.lock (copying its drafter into promoted.staged-*) longer than a promotion
    waits for it, that promotion is refused and readers leave the staged copy alone; a lock its holder stopped
    rewriting LOCK_STALE_S ago (a promoter that crashed, on any host) is taken over."""
    monkeypatch.setattr(store, "LOCK_WAIT_S", 1.0)
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    fs, path = fsspec.core.url_to_fs(f"{root}/promoted")
    lock = f"{path}.lock"

    def hold(since: float, host: str) -> None:
        with fs.open(lock, "w") as fh:
            json.dump({"pid": os.getpid(), "host": host, "stage": "promote", "since": since}, fh)

    hold(time.time(), socket.gethostname())  # held for an instant (a reader repairing): waited for
    threading.Timer(0.3, fs.rm, args=(lock,)).start()
    brief = promote_if_better(cfg, "runs/z", _drafter(f"{root}/runs/z/drafter", "Z"), "pass", _scores(1.5, 1.4, root))
    assert brief["promoted"] and read_promoted(root)["run"] == "runs/z"
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.6, 1.5, root))
    hold(time.time(), socket.gethostname())  # held by a run copying its drafter:
    staged = _drafter(f"{root}/promoted.staged-0123abcd/drafter", "other run's copy")
    assert read_promoted(root)["run"] == "runs/a" and fs.exists(fsspec.core.url_to_fs(staged)[1])
    busy = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", _scores(1.9, 1.6, root))
    assert not busy["promoted"] and "another run is promoting a drafter right now" in busy["reason"]
    assert read_promoted(root)["run"] == "runs/a"
    hold(time.time() - publish.LOCK_STALE_S - 60, "another-host")
    assert promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass",
                             _scores(1.9, 1.6, root))["promoted"]
    assert read_promoted(root)["run"] == "runs/b" and not fs.exists(lock)
    assert not fs.glob(f"{path}.staged-*")  # the crashed promoter's copy is debris now, cleaned


def test_identical_drafters_show_no_significant_gain():
    """Every response gained exactly the same (here nothing): no spread, and a gain of 0 is not above min_gain 0."""
    gain = paired_gain([2.0, 3.5, 4.0], [2.0, 3.5, 4.0])
    assert gain["mean"] == 0.0 and gain["p_value"] == 1.0
    assert paired_gain([2.5, 4.0], [2.0, 3.5], min_gain=0.5)["p_value"] == 1.0  # exactly min_gain: not above it
    assert paired_gain([2.5, 4.0], [2.0, 3.5], min_gain=0.25)["p_value"] == 0.0


# --- what a mutation audit of the gate and the store found unpinned ----------------------------------------------

@pytest.mark.parametrize("incumbent", [None, 1.0])
@pytest.mark.parametrize("tau", [math.nan, math.inf])
def test_a_non_finite_tau_never_promotes(tau, incumbent):
    """A NaN tau (no decoding step) compares False with everything: without the isfinite check it was promoted
    as 'nothing was promoted yet', or over an incumbent (nan <= x is False)."""
    ok, reason = decide("pass", tau, incumbent, 0.0)
    assert ok is False and "has no tau" in reason


def test_with_a_confidence_a_gain_that_was_never_computed_does_not_promote(root):
    """eval.confidence set, an incumbent, but no paired gain in the scores: the gain cannot be tested, so the
    drafter is not promoted (a default of 'p = 0' would promote it on tau alone)."""
    assert decide("pass", 1.6, 1.5, 0.0, None, confidence=0.95)[0] is False
    cfg = _cfg(root, **{"eval.confidence": 0.95})
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    decision = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass",
                                 _scores(1.9, 1.4, root))  # no "gain" key
    assert not decision["promoted"] and "cannot be tested" in decision["reason"]
    assert read_promoted(root)["run"] == "runs/a"


def test_another_runs_byte_identical_drafter_is_compared_not_reported_as_already_promoted(root):
    """Only a retry of the promoting run is 'already the promoted one'; another run whose drafter happens to be
    byte-identical is compared as usual (it must not report promoted=True for a promotion it never made)."""
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    twin = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "A"), "pass", _scores(1.4, 1.4, root))
    assert not twin["promoted"] and "does not beat" in twin["reason"] and twin["promoted_drafter"] is None
    assert read_promoted(root)["run"] == "runs/a"


def test_a_retry_whose_drafter_changed_with_the_same_size_is_compared_not_taken_for_the_promoted_one(root):
    """A retried run (same run folder) whose drafter was rewritten since its first attempt promoted: a drafter of
    the same architecture has files of exactly the same sizes, so only the content tells them apart. It is
    compared as usual (worse here: not promoted), not reported as 'already the promoted one'."""
    cfg = _cfg(root)
    drafter = _drafter(f"{root}/runs/a/drafter", "A")
    promote_if_better(cfg, "runs/a", drafter, "pass", _scores(1.4))
    _drafter(drafter, "Z")  # same sizes, other bytes
    assert not store.holds(root, drafter)
    retried = promote_if_better(cfg, "runs/a", drafter, "pass", _scores(1.3, 1.4, root))
    assert not retried["promoted"] and "does not beat" in retried["reason"]
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "A"}


@pytest.mark.parametrize("incumbent_block", [None, 16])
def test_a_better_drafter_of_the_same_block_size_or_the_first_one_is_promoted(root, incumbent_block):
    """The block-size guard only refuses a *different* block size: the first drafter (no incumbent block size)
    and a better one with the incumbent's block size are promoted."""
    cfg = _cfg(root)
    if incumbent_block:
        promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass",
                          {**_scores(1.4), "block_size": 16})
    scores = {**_scores(1.6, 1.4 if incumbent_block else None, root), "block_size": 16,
              "incumbent_block_size": incumbent_block}
    decision = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", scores)
    assert decision["promoted"] and "block size" not in decision["reason"]
    assert read_promoted(root)["run"] == "runs/b" and read_promoted(root)["block_size"] == 16


def test_measure_pairs_the_gain_as_new_minus_old_over_distinct_prompts(root, monkeypatch):
    """measure() passes the new drafter's per-response tau first and both drafters' prompt ids to the paired
    test: a swapped order reports a better drafter's gain as negative (and blocks it under eval.confidence);
    dropping the prompt ids counts repeated prompts as independent pairs (a falsely tight p-value that can
    promote a gain within noise)."""
    cfg = _cfg(root, **{"eval.confidence": 0.9})
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    prompts = [0, 1, 2, 0, 1, 3]
    new = [2.0, 2.5, 3.1, 2.0, 2.5, 2.9]
    old = [1.8, 2.4, 2.6, 1.8, 2.4, 2.5]

    def tau_of(cfg, target, drafter_dir):
        mine = old if drafter_dir == promoted_drafter(root) else new
        return {"tau": sum(mine) / len(mine), "per_response": list(mine), "per_response_prompts": list(prompts)}

    monkeypatch.setattr(gate, "_tau", tau_of)
    monkeypatch.setattr("dflash_core.model.evaluate.eval_target", lambda *a, **k: None)
    new_dir = _drafter(f"{root}/runs/b/drafter", "B")
    scores = gate.measure(cfg, new_dir)
    want = paired_gain(new, old, 0.0, 0.9, prompts=prompts, old_prompts=prompts)
    assert scores["gain"]["pairs"] == 4 and scores["gain"]["repeats"] == 2
    assert scores["gain"]["mean"] == pytest.approx(0.3) and scores["gain"]["p_value"] == pytest.approx(want["p_value"])
    decision = promote_if_better(cfg, "runs/b", new_dir, "pass", scores)
    assert decision["promoted"] and read_promoted(root)["gain"]["mean"] == pytest.approx(0.3)


def test_a_promoted_json_deleted_while_the_run_was_evaluated_is_a_conflict(root):
    """The run was measured against runs/a; meanwhile promoted.json was deleted, leaving runs/a's drafter as one
    placed by hand (as the store's own error message suggests): it was never compared with the new one, so it is
    not replaced (fail closed), not taken for 'nothing promoted'."""
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    scores = _scores(1.9, 1.4, root)
    fs, path = fsspec.core.url_to_fs(f"{root}/promoted/promoted.json")
    fs.rm(path)
    decision = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", scores)
    assert not decision["promoted"] and "changed while this run was evaluated" in decision["reason"]
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "A"}


def test_a_re_promotion_of_the_same_run_name_is_a_conflict(root):
    """record_id tells promotions apart by run AND time: the run measured against runs/a's promotion at one time
    must not replace runs/a's later promotion (other weights, same tau) that it was never compared with."""
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    scores = _scores(1.9, 1.4, root)
    record = read_promoted(root)
    fs, path = fsspec.core.url_to_fs(f"{root}/promoted/promoted.json")
    fs.pipe(path, json.dumps({**record, "time": "2999-01-01T00:00:00+00:00"}).encode())  # promoted again
    decision = promote_if_better(cfg, "runs/b", _drafter(f"{root}/runs/b/drafter", "B"), "pass", scores)
    assert not decision["promoted"] and "changed while this run was evaluated" in decision["reason"]
    assert read_promoted(root)["time"].startswith("2999")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json"])
def test_any_file_of_a_drafter_placed_by_hand_makes_it_an_incumbent(root, monkeypatch, name):
    """A drafter folder holding any one of config.json, model.safetensors or the shard index (a copy by hand
    that did not finish) is an incumbent: measured (or refused), never replaced as 'nothing was promoted yet'."""
    fs, path = fsspec.core.url_to_fs(promoted_drafter(root))
    fs.makedirs(path, exist_ok=True)
    fs.pipe(f"{path}/{name}", b"{}")
    assert store.drafter_present(root)
    _measured_as(monkeypatch, root, incumbent_tau=1.5)
    cfg = _cfg(root)
    new_dir = _drafter(f"{root}/runs/b/drafter", "B")
    scores = gate.measure(cfg, new_dir)
    assert scores["incumbent_run"] == gate.PLACED and scores["incumbent_tau"] == 1.5
    decision = promote_if_better(cfg, "runs/b", new_dir, "pass", scores)
    assert not decision["promoted"] and "nothing was promoted yet" not in decision["reason"]
    assert fs.cat(f"{path}/{name}") == b"{}"


def test_an_online_wandb_run_logs_the_promoted_model(tmp_path, monkeypatch):
    """With wandb.mode online (and a key) the promoted drafter is logged as the `production` model too, not only
    offline: skipping it would leave `production` on the previous drafter while the decision says nothing."""
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    logged = []
    monkeypatch.setattr(gate, "log_model_artifact", lambda *args: logged.append(args) or "dflash-drafter:production")
    root, run = str(tmp_path / "store"), str(tmp_path / "run")
    cfg = _cfg(root, **{"wandb.mode": "online"})
    decision = promote_if_better(cfg, run, _drafter(f"{run}/drafter", "A"), "pass", _scores(1.4))
    assert decision["promoted"] and decision["wandb_artifact"] == "dflash-drafter:production" and len(logged) == 1


@pytest.mark.parametrize(("tau", "says"), [(None, "decoded no step"), (math.nan, "its tau is nan")],
                         ids=["none", "nan"])
def test_an_incumbent_that_decodes_no_step_is_not_replaced_unmeasured(root, monkeypatch, tau, says):
    """The promoted drafter loads but its tau is None (no decoding step on the prompts) or NaN (which compares
    False with everything: tau <= nan + min_gain is False): that is no figure to beat, not "nothing was promoted
    yet" (it was replaced with no comparison)."""
    cfg = _cfg(root)
    promote_if_better(cfg, "runs/a", _drafter(f"{root}/runs/a/drafter", "A"), "pass", _scores(1.4))
    _measured_as(monkeypatch, root, incumbent_tau=tau)
    new = _drafter(f"{root}/runs/b/drafter", "B")
    scores = gate.measure(cfg, new)
    assert says in scores["incumbent_error"]
    decision = promote_if_better(cfg, "runs/b", new, "pass", scores)
    assert not decision["promoted"] and "could not be measured" in decision["reason"]
    assert read_promoted(root)["run"] == "runs/a"
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "A"}


def test_a_drafter_placed_by_hand_while_a_run_measured_nothing_is_a_conflict(root, monkeypatch):
    """Nothing was promoted when the run was measured; a drafter copied in by hand since (today's production
    drafter) was never compared with the new one: not replaced."""
    cfg = _cfg(root)
    _measured_as(monkeypatch, root, incumbent_tau=9.0)
    new = _drafter(f"{root}/runs/b/drafter", "B")
    scores = gate.measure(cfg, new)
    assert scores["incumbent_id"] is None and scores["incumbent_tau"] is None
    _drafter(promoted_drafter(root), "HAND")
    decision = promote_if_better(cfg, "runs/b", new, "pass", scores)
    assert not decision["promoted"] and "now: a drafter placed by hand" in decision["reason"]
    assert json.loads(_read(f"{promoted_drafter(root)}/config.json")) == {"marker": "HAND"}
    again = promote_if_better(cfg, "runs/b", new, "pass", gate.measure(cfg, new))  # measured against it: refused
    assert not again["promoted"] and "does not beat" in again["reason"]
