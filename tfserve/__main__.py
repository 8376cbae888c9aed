"""`python -m tfserve ...` is `tfserve ...` (for launchers that take a module, such as `torchrun -m tfserve`)."""

from tfserve.cli import main

main()
