"""``--dist loadfile`` that hands out test files in the collection's order, one at a time per worker.

pytest-xdist's own loadfile scheduler sorts the files by their number of tests (``--loadscope-reorder``, on by
default), so the Slurm stories (a few tests behind minutes of module fixture) started last and ran on after
the other workers had finished; and it gives a worker its next file while two of its tests are still pending,
so a worker that starts a 1-3-test story takes a second long file at once. This scheduler keeps the order the
workers collected (``tests/conftest.py`` sorts ``LONG_FILES`` first, longest first) and gives a worker its
next file when one test of its current file is left: a worker runs a test only once it knows the next one
(pytest's teardown of a module fixture needs it), so with none left to send it would wait forever.

With four workers or more, the last one is the *waiter*: it runs only ``WAITING_FILES`` (tests that wait on
Slurm's clock: reservations, time limits, the minute-long scheduler pass, with little CPU of their own), which
the others leave to it, and it stops when they are done. The suite is CPU-bound on the 2-core machine, so a
fourth worker that computes slows every test down; one that mostly waits does not.
"""
from __future__ import annotations

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import WorkerController

WAITER_FROM = 4  # workers from which the last one is the waiter


class LongestFirst(LoadFileScheduling):
    """Files in collection order; a worker's next file once a single test of its current one is pending."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # what --no-loadscope-reorder sets: the collection's order
        from tests.conftest import WAITING_FILES
        self.waiting = frozenset(WAITING_FILES)
        self.waiter: WorkerController | None = None

    def schedule(self) -> None:
        # every worker has registered by now (xdist's nodes: its assignment table's keys, which lose a worker
        # when it ends: the waiter is chosen once)
        if len(self.nodes) >= WAITER_FROM and self.waiting:
            self.waiter = self.nodes[-1]
        super().schedule()

    def _suits(self, node: WorkerController, scope: str) -> bool:
        if self.waiter is None or self.waiter not in self.assigned_work:  # none, or it ended (crashed)
            return True
        return (scope in self.waiting) == (node is self.waiter)

    def _next_scope(self, node: WorkerController) -> str | None:
        return next((scope for scope in self.workqueue if self._suits(node, scope)), None)

    def _assign_work_unit(self, node: WorkerController) -> None:
        scope = self._next_scope(node)
        if scope is None:  # nothing left for it (the waiter's files, or the others')
            node.shutdown()
            return
        self.workqueue.move_to_end(scope, last=False)  # xdist's own assignment takes the queue's first file
        super()._assign_work_unit(node)

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if self._next_scope(node) is None:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work.get(node, {})) > 1:
            return
        self._assign_work_unit(node)
