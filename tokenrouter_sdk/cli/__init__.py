"""The ``tokenrouter`` command and its subcommands, one file each: `main` (the parser, ``demo``,
``bench``, ``info``), `eval`, `serve`, `train`, `distill` and `lm_eval` (lm-evaluation-harness
with the ``tokenrouter`` model type); the flags they share are in `common`. Nothing outside
this package imports it."""

from .main import main

__all__ = ["main"]
