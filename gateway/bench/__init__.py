"""Benchmarks: ``kvgate bench <name>`` (each module exposes ``add_arguments(parser)`` and ``run(args)``)."""
