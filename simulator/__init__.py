"""Iteration time, peak memory and cost of heterogeneous training plans (public API in api.py)."""
from simulator.api import SimOptions, SimResult, StageCost, StageEvaluator, StageReport, simulate

__all__ = ["SimOptions", "SimResult", "StageCost", "StageEvaluator", "StageReport", "simulate"]
