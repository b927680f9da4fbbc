"""Checkpoint-based resizing: a controller that re-plans and resumes a run when its allocation changes.

``sailor-hpc run`` plans from live availability, submits the (het) job and watches the job and the
partitions; when a node of the job is lost, the job is preempted, requeued or hits its time limit, or
more GPUs become idle (and a new plan gains at least ``--min-gain`` after the cost of restarting),
it re-plans on what is free, submits the new plan and the training resumes from the newest
complete checkpoint, which every plan can load. Modules, one job each:

- :mod:`.spec`: what the run was asked (``run.json``);
- :mod:`.journal`: the JSON-lines journal of events and decisions (the controller's only memory);
- :mod:`.records`: the journal's records, one frozen dataclass per kind, and their one codec;
- :mod:`.state`: the run directory, the lock, and the state folded from the journal;
- :mod:`.events`: observations of the job and partitions, and the changes in them;
- :mod:`.progress`: the training's own account, from the job's log (typed events,
  :mod:`sailor_hpc.core.runtime_events`);
- :mod:`.planning`: re-planning on the GPUs free now, checked per node;
- :mod:`.policy`: resize only when it pays for the restart;
- :mod:`.slurm_ops`: find the run's own jobs, request a checkpoint, cancel and wait (jobs are
  :class:`~sailor_hpc.slurm.handle.SlurmJob` handles bound to their cluster; every Slurm command line is in
  :mod:`sailor_hpc.slurm`);
- :mod:`.attempt_job`: the one builder of an attempt's job options, plan file and script;
- :mod:`.context`: what every step shares (journal, state, site, archive, clock, clusters);
- :mod:`.loop`: the controller itself, the one loop of every run over an attempt kind chosen once:
  :mod:`.one_job` (one het job on one cluster, with :mod:`.grow`, a bigger job beside, and :mod:`.inplace`,
  re-planned inside the job) or :mod:`.groups` (one job per cluster);
- :mod:`.story`: the run's history for people.
"""
from __future__ import annotations

from sailor_hpc.controller.loop import Controller
from sailor_hpc.controller.spec import RunSpec, new_run_id
from sailor_hpc.controller.state import RunDir, RunState, fold

__all__ = ["Controller", "RunDir", "RunSpec", "RunState", "fold", "new_run_id"]
