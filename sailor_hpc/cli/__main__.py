"""``python -m sailor_hpc.cli``: the CLI where no ``sailor-hpc`` script is installed (a checkout on PYTHONPATH)."""
from sailor_hpc.cli import main

main(prog_name="sailor-hpc")
