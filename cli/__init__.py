"""The `multihead` console script: ONE root parser, one module per command group.

    serve                     cli.serve
    demo                      cli.demo
    init-trunk                cli.trunk
    quantize                  cli.quantize
    register, train, bots     cli.bots
    tenants, keys, audit      cli.tenants
    store                     cli.store   (copy, backup, restore, check: `store.ops`)
    bench                     cli.bench   (the code is in the `bench` package)

`cli.main` holds the root parser and `main`. Options every command shares are defined
once, in `cli.options`: `--store` (env `MULTIHEAD_STORE`, default `checkpoints`),
resolved by `store_dir` for every command, and `--trunk-checkpoint`. Handlers
import TensorFlow lazily so that `multihead --help` answers at once, and return the exit code.
Errors that are the user's to fix (the domain errors of backbone, heads and service, invalid
settings) print one line on stderr and exit 2; anything else is a bug: traceback, exit 1.
"""
