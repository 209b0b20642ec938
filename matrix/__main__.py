"""`python -m matrix` is the `matrix` command."""

from matrix.cli import main

main()
