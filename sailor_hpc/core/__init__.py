"""The data model every package of sailor-hpc speaks, and the torch-free runtime contract.

Data model: errors, validated fields, atomic writes, locking, the model catalog, sites and their
network fits, plans (schema, placement, plan files), the profile archive, sbatch values, TOML output.
Runtime contract (what job script, controller and runtime agree on, without torch): rank roles
(:mod:`.roles`), rank environment and exit codes (:mod:`.dist_env`), the checkpoint directory
protocol (:mod:`.checkpoint`). Sailor's own formats are read in :mod:`.sailor_compat`.
This layer imports nothing else of the project.
"""
