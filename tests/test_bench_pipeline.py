"""The command lines of bench/: `make bench`'s pipeline scenarios build, the regenerate bench reads its options."""

import pytest

from bench.pipeline import SCENARIOS, Bench, Shape
from bench.regenerate import parse_args as regenerate_args
from dflash_core.runtime.channel import Channel


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_pipeline_scenario_builds_its_stages(name, tmp_path):
    """`python -m bench.pipeline` (the last command of `make bench`) runs every scenario: each shape must give the
    drafter distinct target layers below the target's last, and build all three stages."""
    bench = Bench(tmp_path, Shape(**SCENARIOS[name]), "cpu", "float32", steps=3, replicas=1, threads=1)
    assert len(set(bench.layer_ids)) == SCENARIOS[name]["draft_layers"]
    assert max(bench.layer_ids) < SCENARIOS[name]["target_layers"] - 1
    bench.prefetcher(Channel(1))
    bench.target_loop(Channel(1), Channel(1))
    assert bench.drafter_loop(Channel(1)).model.block_size == SCENARIOS[name]["block_size"]


@pytest.mark.parametrize("argv", [["--records", "600", "throughput"], ["throughput", "--records", "600"],
                                  ["--records", "600"]])
def test_regenerate_throughput_options_count_before_and_after_the_subcommand(argv):
    args = regenerate_args(argv)
    assert args.records == 600
    assert (args.naive_records, args.max_tokens, args.concurrency) == (16, 64, 16)  # the rest keep their defaults


def test_regenerate_throughput_option_after_the_subcommand_wins():
    args = regenerate_args(["--records", "5", "--concurrency", "3", "throughput", "--records", "7"])
    assert (args.mode, args.records, args.concurrency) == ("throughput", 7, 3)
