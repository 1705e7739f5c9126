"""Analytic FLOPs of a step (hand counts and torch's own matmul counter), the peak table, tflops/mfu records."""

import pytest
import torch
from common.models import random_batch, tiny_drafter, tiny_target
from torch.utils.flop_counter import FlopCounterMode

from dflash_core.model.flops import (
    FlopShape,
    attention_flops,
    drafter_step_flops,
    layer_matmul_flops,
    target_forward_flops,
)
from dflash_core.runtime.batch import PlanRow, collate
from dflash_core.runtime.efficiency import (
    FlopMeter,
    SteadyRate,
    device_peak_tflops,
    intra_op_threads,
    missing_peak_note,
    peak_for_name,
)

# the tiny models of model_support: hidden 64, 4 heads, 2 kv heads, head_dim 16, MLP 128, vocab 100
TINY = FlopShape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100, draft_layers=2,
                 target_layers_run=3, num_features=2, block_size=4)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_layer_and_attention_by_hand():
    # q, o: 2 * 3 tokens * 64 * 64 each; k, v: 2 * 5 tokens * 64 * 32 each; MLP: 3 * 2 * 3 * 64 * 128
    assert layer_matmul_flops(TINY, 3, 5) == 2 * (2 * 3 * 64 * 64) + 2 * (2 * 5 * 64 * 32) + 3 * (2 * 3 * 64 * 128)
    assert layer_matmul_flops(TINY, 3, 5) == 237568
    assert attention_flops(TINY, 10) == 2 * 2 * 4 * 16 * 10  # Q K^T and P V, 4 heads of 16


def test_target_forward_by_hand():
    # lengths 3 and 2: 5 tokens, causal pairs 6 + 3; three layers run
    per_layer = (2 * 5 * 64 * 64 * 2) + (2 * 5 * 64 * 32 * 2) + (2 * 5 * 64 * 128 * 3) + 2 * 2 * 4 * 16 * 9
    assert target_forward_flops(TINY, [3, 2]) == 3 * per_layer == 1112832


def test_a_drafter_of_its_own_layout_counts_the_targets_layers_by_the_targets_layout(target):
    """model.draft_* give the drafter another layout than the target's: the target's forward is counted with the
    target's heads and MLP, the drafter's step with its own."""
    from dflash_core.model.flops import target_layer_layout

    own = tiny_drafter(target, draft_heads=8, draft_kv_heads=2, draft_head_dim=8, draft_intermediate_size=32)
    shape = FlopShape.of(own, target_layer_layout(target.config))
    assert (shape.heads, shape.head_dim, shape.intermediate) == (8, 8, 32)
    assert shape.target is not None and (shape.target.heads, shape.target.head_dim, shape.target.intermediate) == \
        (4, 16, 128)
    per_layer = (2 * 5 * 64 * 64 * 2) + (2 * 5 * 64 * 32 * 2) + (2 * 5 * 64 * 128 * 3) + 2 * 2 * 4 * 16 * 9
    assert target_forward_flops(shape, [3, 2]) == shape.target_layers_run * per_layer
    assert target_forward_flops(shape, [3, 2]) != target_forward_flops(FlopShape.of(own), [3, 2])
    assert FlopShape.of(tiny_drafter(target), target_layer_layout(target.config)).target is None  # the same layout


def _moe_configs():
    from transformers import DeepseekV3Config, Gemma4TextConfig, GptOssConfig, Qwen3MoeConfig, Qwen3NextConfig

    dense = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 100}
    return {
        # routed experts x their width (Qwen3-Coder-30B-A3B: 8 of 128 x 768)
        "qwen3_moe": (Qwen3MoeConfig(**dense, head_dim=16, intermediate_size=6144, moe_intermediate_size=768,
                                     num_experts=128, num_experts_per_tok=8), 8 * 768),
        # experts as wide as intermediate_size (gpt-oss-20b: 4 of 32 x 2880)
        "gpt_oss": (GptOssConfig(**dense, head_dim=16, intermediate_size=2880, num_local_experts=32,
                                 num_experts_per_tok=4), 4 * 2880),
        # routed + shared experts (DeepSeek-V3 / Kimi K2: 8 routed + 1 shared x 2048)
        "deepseek_v3": (DeepseekV3Config(**dense, intermediate_size=18432, moe_intermediate_size=2048,
                                         n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1),
                        9 * 2048),
        # routed + a shared expert of its own width (Qwen3-Next: 10 x 512 + 512)
        "qwen3_next": (Qwen3NextConfig(**dense, head_dim=16, intermediate_size=5632, moe_intermediate_size=512,
                                       num_experts=512, num_experts_per_tok=10, shared_expert_intermediate_size=512),
                       10 * 512 + 512),
        # a dense MLP beside the experts (Gemma 4 26B-A4B: 2112 + 8 x 704)
        "gemma4": (Gemma4TextConfig(**dense, head_dim=16, intermediate_size=2112, enable_moe_block=True,
                                    num_experts=128, top_k_experts=8, moe_intermediate_size=704), 2112 + 8 * 704),
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "qwen3_next", "gemma4"])
def test_a_mixture_of_experts_targets_layers_are_counted_by_the_experts_a_token_runs(family):
    """The target's MLP FLOPs follow the experts a token is routed to (and shared or dense ones beside them), not
    the config's intermediate_size alone (gpt-oss: 4x more, MiniMax: 8x); a dense target keeps its own."""
    from transformers import Qwen3Config

    from dflash_core.model.flops import target_layer_layout

    config, active = _moe_configs()[family]
    assert target_layer_layout(config)["intermediate_size"] == active
    assert target_layer_layout(Qwen3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16))["intermediate_size"] == 128


def test_drafter_step_by_hand():
    # 10 context tokens, 2 blocks of 4 (8 queries), 30 visible pairs, 5 supervised rows
    fc = 2 * 10 * 128 * 64
    layer = (2 * 8 * 64 * 64 * 2) + (2 * 18 * 64 * 32 * 2) + (2 * 8 * 64 * 128 * 3) + 2 * 2 * 4 * 16 * 30
    head = 2 * 5 * 64 * 100
    forward = fc + 2 * layer + head
    backward = fc + 2 * (2 * layer) + head  # fc: weight grad only; head: input grad only
    assert drafter_step_flops(TINY, 10, 2, 30, 5) == forward + backward


def test_counts_agree_with_torch_matmul_counter(target):
    """torch's FlopCounterMode counts the matmuls of the real forward and backward (attention runs outside mm
    on CPU, and the checkpointed vocab chunks run their forward twice): the analytic count agrees exactly."""
    d = tiny_drafter(target, num_anchors=5, attention="sdpa", target_layer_ids=[0, 2])
    assert FlopShape.of(d) == TINY
    batch = random_batch(2, 24, seed=1)
    with FlopCounterMode(display=False) as counter:
        feats = target.capture(batch["input_ids"], batch["attention_mask"], d.target_layer_ids)
    causal_pairs = 2 * (24 * 25 // 2)
    assert counter.get_total_flops() == target_forward_flops(TINY, [24, 24]) - 3 * attention_flops(TINY, causal_pairs)
    with FlopCounterMode(display=False) as counter:
        out = d(feats, **batch, generator=torch.Generator().manual_seed(0))
        out.weighted_loss_sum.backward()
    rows, pairs = float(out.counted.sum()), float(out.visible_pairs)
    analytic = drafter_step_flops(TINY, 48, out.n_blocks, pairs, rows)
    attention = 3 * TINY.draft_layers * attention_flops(TINY, pairs)  # forward + 2x backward
    recomputed_head = 2 * rows * 64 * 100
    assert counter.get_total_flops() == analytic - attention + recomputed_head


def test_peak_table_matches_device_names():
    assert peak_for_name("NVIDIA H100 80GB HBM3").tflops == 989.4
    assert peak_for_name("NVIDIA H100 PCIe").tflops == 756.0
    assert peak_for_name("NVIDIA H100 NVL").tflops == 835.0
    assert peak_for_name("NVIDIA H200").tflops == 989.4
    assert peak_for_name("NVIDIA H200 NVL").tflops == 835.0
    assert peak_for_name("NVIDIA GH200 480GB").model == "GH200"
    assert peak_for_name("NVIDIA A100-SXM4-80GB").tflops == 312.0
    assert peak_for_name("NVIDIA A10").tflops == 125.0  # not the A100 row
    assert peak_for_name("NVIDIA L40S").tflops == 362.05
    assert peak_for_name("NVIDIA B200").tflops == 2250.0
    assert peak_for_name("NVIDIA H800").tflops == 989.4
    assert peak_for_name("NVIDIA H800 PCIe").tflops == 756.0
    assert peak_for_name("NVIDIA H20").tflops == 148.0  # not the H200 row, nor H200 read as H20
    assert peak_for_name("NVIDIA A800-SXM4-80GB").tflops == 312.0
    assert peak_for_name("NVIDIA GB200").tflops == 2500.0  # not the B200 row
    assert peak_for_name("NVIDIA B300 SXM6 AC").tflops == 2250.0
    assert peak_for_name("NVIDIA L40").tflops == 181.05  # not the L40S row
    assert peak_for_name("NVIDIA L20").tflops == 119.5
    assert peak_for_name("AMD Instinct MI325X").tflops == 1307.4
    assert peak_for_name("NVIDIA GeForce GTX 1080") is None
    assert device_peak_tflops(torch.device("cpu")) is None
    assert device_peak_tflops(torch.device("cpu"), 2.5) == 2.5


def test_gpu_names_resolve_through_the_table_unless_overridden(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Mystery X9")
    assert device_peak_tflops(torch.device("cuda", 0)) is None
    note = missing_peak_note(torch.device("cuda", 0), None)  # what the trainer prints on its main rank
    assert "'NVIDIA Mystery X9' is not in the table" in note and "set train.peak_tflops" in note
    assert missing_peak_note(torch.device("cuda", 0), 400.0) is None
    assert missing_peak_note(torch.device("cpu"), None) is None  # no mfu on CPU is no news
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H20")
    assert device_peak_tflops(torch.device("cuda", 0)) == 148.0
    assert device_peak_tflops(torch.device("cuda", 0), 100.0) == 100.0  # the override wins


def _micro_batch(lengths: list[int]):
    rows = [(torch.arange(n).numpy(), torch.ones(n, dtype=torch.uint8).numpy()) for n in lengths]
    return collate(rows, PlanRow(0, 0, 0, tuple(range(len(lengths)))), seq=0)


def test_meter_records_tflops_and_mfu_only_with_a_peak(target):
    d = tiny_drafter(target, num_anchors=5, attention="sdpa", target_layer_ids=[0, 2])
    batch = _micro_batch([20, 14])
    feats = target.capture(batch.input_ids, batch.attention_mask, d.target_layer_ids)
    out = d(feats, batch.input_ids, batch.loss_mask, batch.attention_mask, torch.Generator().manual_seed(0))
    expected = target_forward_flops(TINY, [20, 14]) + drafter_step_flops(
        TINY, 34, out.n_blocks, float(out.visible_pairs), float(out.counted.sum())
    )
    cpu = FlopMeter.for_model(d, torch.device("cpu"))
    cpu.add(batch, out)
    record = cpu.record(cpu.take().tolist(), 0.5)
    assert record["mfu"] is None
    assert record["tflops"] == pytest.approx(2 * expected / 1e12)
    assert sum(record["step_tflop"].values()) == pytest.approx(expected / 1e12)
    overridden = FlopMeter.for_model(d, torch.device("cpu"), peak_override=1e-6, devices=2)
    overridden.add(batch, out)
    overridden.add(batch, out)  # two micro-batches: twice the work
    counts = overridden.take()
    record = overridden.record(counts.tolist(), 1.0)
    assert record["tflops"] == pytest.approx(2 * expected / 1e12)
    assert record["mfu"] == pytest.approx(2 * expected / 1e12 / (1e-6 * 2))
    assert overridden.take().tolist() == [0.0] * 5  # counts reset each step
    # counts summed over 2 ranks (as StepStats.all_reduce sums them): both ranks' FLOPs, both ranks' peak
    record = overridden.record((2 * counts).tolist(), 1.0, world_size=2)
    assert record["tflops"] == pytest.approx(4 * expected / 1e12)
    assert record["mfu"] == pytest.approx(4 * expected / 1e12 / (1e-6 * 2 * 2))


def test_steady_rate_skips_warmup_steps():
    rate = SteadyRate(warmup=2)
    for seconds in (9.0, 3.0, 1.0, 1.0):
        rate.add({"step_time_s": seconds, "n_tokens": 100, "step_tflop": {"target": 1.0, "drafter": 3.0},
                  "mfu": 0.5})
    assert rate.summary() == {"steady_steps": 2, "steady_compile_steps_skipped": 0, "steady_tokens_per_s": 100.0,
                              "steady_tflops": 4.0, "steady_mfu": 0.5}
    assert SteadyRate(warmup=2).summary()["steady_tokens_per_s"] is None


def test_steady_rate_skips_steps_that_compiled():
    """A step that compiled a new shape (flex attention on CUDA) is one-off: left out of the steady rate."""
    double = torch.compile(lambda x: x * 2)
    rate = SteadyRate(warmup=1)
    record = {"step_time_s": 1.0, "n_tokens": 10}
    for size in (3, 3, 3, 4, 4):  # size 4 is a new shape: that step compiles
        double(torch.ones(size))
        rate.add({**record, "step_time_s": 30.0} if size == 4 and rate.compile_steps == 0 else record)
    summary = rate.summary()
    assert summary["steady_compile_steps_skipped"] == 1 and summary["steady_steps"] == 3
    assert summary["steady_tokens_per_s"] == 10.0


def test_intra_op_threads_leave_room_for_the_pipeline_threads():
    assert intra_op_threads(None, "cpu", 1, None, 2) == 1  # a 2-core machine: one core for loading and target
    assert intra_op_threads(None, "cpu", 1, None, 16) == 15
    assert intra_op_threads(None, "cpu", 4, None, 16) == 3
    assert intra_op_threads(None, "cuda", 1, None, 32) == 4  # a GPU rank launches kernels: a few threads
    assert intra_op_threads(None, "cuda", 8, None, 8) == 1
    assert intra_op_threads(None, "cpu", 1, "3", 16) == 3  # OMP_NUM_THREADS wins over the default
    assert intra_op_threads(6, "cpu", 1, "3", 16) == 6  # train.torch_threads wins over both


def test_the_launcher_keeps_the_users_thread_count_apart_from_the_one_it_gives_torchrun():
    """`dflash train` sets OMP_NUM_THREADS=1 for torchrun (as torchrun does for several ranks); the ranks follow
    only what the user set, so an unset OMP_NUM_THREADS still gets the core share."""
    from dflash_core.runtime.launch import asked_threads, worker_env

    unset = worker_env({"PATH": "/bin"})
    assert unset["OMP_NUM_THREADS"] == "1" and asked_threads(unset) is None
    assert intra_op_threads(None, "cuda", 1, asked_threads(unset), 32) == 4
    asked = worker_env({"OMP_NUM_THREADS": "6"})
    assert asked["OMP_NUM_THREADS"] == "6" and asked_threads(asked) == "6"
    assert asked_threads({"OMP_NUM_THREADS": "1"}) == "1"  # a bare torchrun: its (or the user's) setting
    assert asked_threads({}) is None
