"""Fixtures of the DeepSpeed tests: the planner tests' tiny-gpt archive and the runtime tests' dataset."""
from tests.megatron_patch.conftest import shipped_data
from tests.planner.conftest import tiny_archive

__all__ = ["shipped_data", "tiny_archive"]
