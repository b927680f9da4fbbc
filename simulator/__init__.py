"""Iteration time, throughput, peak memory and cost of heterogeneous training plans (public API in api.py)."""
from simulator.api import SimOptions, SimResult, StageCost, StageEvaluator, StageReport, plan_timeline, simulate

__all__ = ["SimOptions", "SimResult", "StageCost", "StageEvaluator", "StageReport", "plan_timeline", "simulate"]
