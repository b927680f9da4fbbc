"""Local Slurm test cluster: install.sh, start.sh, stop.sh and the Python helper :mod:`tests.slurm.cluster`."""
