"""``--dist loadfile`` that hands out test files in the collection's order, one at a time per worker.

pytest-xdist's own loadfile scheduler sorts the files by their number of tests (``--loadscope-reorder``, on by
default), so the Slurm stories (a few tests behind minutes of module fixture) started last and ran on after
the other workers had finished; and it gives a worker its next file while two of its tests are still pending,
so a worker that starts a 1-3-test story takes a second long file at once. This scheduler keeps the order the
workers collected (``tests/conftest.py`` sorts ``LONG_FILES`` first, longest first) and gives a worker its
next file when one test of its current file is left: a worker runs a test only once it knows the next one
(pytest's teardown of a module fixture needs it), so with none left to send it would wait forever.
"""
from __future__ import annotations

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController


class LongestFirst(LoadFileScheduling):
    """Files in collection order; a worker's next file once a single test of its current one is pending."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # what --no-loadscope-reorder sets: the collection's order

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)
