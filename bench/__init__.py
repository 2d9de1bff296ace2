"""The benchmark script of multihead (`multihead bench`, `python -m bench`): the shared-trunk
design measured against the naive ones, in one run.

A client of the service: it starts real `multihead serve` processes and talks HTTP to them, and
uses the backbone and heads packages directly for the in-process sections. The server never
imports it. Modules: `cli` (flags and the command), `runner` (the run), `sections` (one module
per section behind one interface: name, run, render, targets), `context` (what the sections of
a run share), `plan`, `load` and `grpc_load` (server processes and load generators), `memory`
(a server's RSS from outside), `report` (targets, bench.json/md/png), `stats`, `markdown`,
`bots`, `pgserver` (a throw-away PostgreSQL server).
"""
