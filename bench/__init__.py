"""The benchmark script of multihead (`multihead bench`, `python -m bench`): the shared-trunk
design measured against the naive ones, in one run.

A client of the service: it starts real `multihead serve` processes and talks HTTP to them, and
uses the backbone and heads packages directly for the in-process sections. The server never
imports it. Modules: `cli` (flags and the command), `runner` (the run and its sections), `load`
(server processes and load generators), `report` (targets, bench.json/md/png), `stats`.
"""
