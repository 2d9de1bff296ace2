"""The `multihead` console script: ONE root parser, one module per command group.

    serve                     service.cli.serve
    demo                      service.cli.demo
    init-trunk                service.cli.trunk
    quantize                  service.cli.quantize
    register, train, bots     service.cli.bots
    bench                     service.cli.bench   (the code is in the `bench` package)

`service.cli.main` holds the root parser and `main`. Options every command shares are defined
once, in `service.cli.options`: `--store` (env `MULTIHEAD_STORE`, default `checkpoints`),
resolved by `store_dir` for every command, and `--trunk-checkpoint`. Handlers
import TensorFlow lazily so that `multihead --help` answers at once, and return the exit code.
Errors that are the user's to fix (the domain errors of backbone, heads and service, invalid
settings) print one line on stderr and exit 2; anything else is a bug: traceback, exit 1.
"""
