"""The planner tests' tiny-gpt archive, for the DeepSpeed plan-space tests."""
from tests.planner.conftest import tiny_archive

__all__ = ["tiny_archive"]
