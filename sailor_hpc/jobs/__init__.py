"""A plan as a Slurm job: the het sbatch script rendered from ``sbatch_templates`` (:mod:`.render`), the
job's task layout (:mod:`.layout`) and the per-rank wrapper that maps a task to its plan rank
(:mod:`.rank_env`). Talking to Slurm itself is :mod:`sailor_hpc.slurm`'s job."""
