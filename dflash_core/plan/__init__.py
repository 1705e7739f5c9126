"""Plan stage: length buckets, token-budget batches, diversity-first interleaving, balanced ranks."""

from dflash_core.plan.errors import PlanError
from dflash_core.plan.io import read_plan, run_plan
from dflash_core.plan.planner import Plan, make_plan, row_index
from dflash_core.plan.report import format_summary_table

__all__ = ["Plan", "PlanError", "format_summary_table", "make_plan", "read_plan", "row_index", "run_plan"]
