"""bench/efficiency.py runs end to end in its tiny CPU mode (the GPU run is the same code on the recipe shape)."""

import pytest

from bench.efficiency import parse_args, run

pytestmark = pytest.mark.slow


def test_tiny_cpu_run_reports_both_paths_with_equal_losses():
    out = run(parse_args(["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--max-seqs", "2",
                          "--budget-s", "600", "--peak-tflops", "1.0"]))
    assert set(out["paths"]) == {"sdpa", "flex"}
    for result in out["paths"].values():
        assert result["drafter_step_s"] > 0 and result["drafter_tflop"] > 0
        assert result["drafter_mfu"] is not None  # the peak override gives an mfu on CPU
        assert result["max_seqs"] == 2 and result["capped_at"] == 2  # no OOM on CPU: the cap stops the search
    # same drafter init and anchors: the block-sparse path computes the same loss
    assert out["flex_vs_sdpa"]["first_loss_rel_diff"] < 1e-5
    assert 0 < out["analytic"]["visible_fraction"] < 1
