"""megatron_patch: the heterogeneous training runtime (megatron-core 0.16.1 + the patch in ``patch.py``).

Torch-free modules (importable on a login node): ``roles`` (rank -> pipeline/stage/TP role),
``env`` (rank and rendezvous from Slurm/torchrun, exit codes), ``options``, ``checkpoint``
(manifest, ``latest_complete``) and ``launch`` (its ``--dry-run``). Everything else needs torch.
See README.md in this directory for the architecture.
"""
