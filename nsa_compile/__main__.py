"""`python -m nsa_compile ...` is the `nsa-compile` command."""

from .cli import main

main()
