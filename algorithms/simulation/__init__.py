"""geoloco.algorithms.simulation: hosts of the round engine on a virtual clock.

The single-process simulator (plain, data-parallel, streaming, regional and event-driven
asynchronous rounds), its network clock and failure model, and the planner. They drive the same
engine, strategies and privacy modules as the coordinator and the sites do, so nothing below
this package imports it (the layers are written down in ``pyproject.toml``).
"""
