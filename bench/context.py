"""The context every section runs in: the plan, the trunk checkpoint, the run's images, its
temp and output directories, the results of the sections run so far, and the way to start
`multihead serve` processes. The runner (`bench.runner`) builds one per run.

Nothing heavy is imported here (no TensorFlow): `multihead --help` imports the sections.
"""
from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from bench.load import ServerProcess
    from bench.result import Result


def say(message: str) -> None:
    """A progress line on stderr (through tqdm, so that it does not break a bar)."""
    from tqdm import tqdm

    tqdm.write(f"[bench] {message}", file=sys.stderr)


class Bar:
    """A tqdm bar (stderr) that is a no-op when progress is off."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            # disable=None: bars only on a terminal (a log file would get every redraw).
            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False,
                             dynamic_ncols=True, disable=None)
        self._lock = threading.Lock()

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Context:
    """What the sections of one run share.

    Attributes:
        plan: the counts and options of the run.
        out_dir: where the reports, the server logs and the error tracebacks go.
        tmp: the run's scratch directory (stores, graph caches), removed at the end.
        prefix: the trunk checkpoint prefix every trunk and server of the run uses.
        jpegs: the run's distinct 640x480 JPEG uploads.
        results: the results of the sections run so far, by section name.
        errors: the sections (or parts) that failed, with the error's first line.
        server_starts: every server start of the run (name, seconds to /healthz and /readyz).
        int8: the run's INT8 trunk once `bench.int8.ensure_int8` has looked (None: not yet).
    """

    plan: Plan
    out_dir: Path
    tmp: Path
    prefix: str = ""
    jpegs: list[bytes] = field(default_factory=list)
    results: dict[str, Result] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    server_starts: list[dict] = field(default_factory=list)
    int8: dict | None = None
    _service_bots: list[str] | None = field(default=None, init=False, repr=False)

    def bar(self, total: int, desc: str) -> Bar:
        """A progress bar (a no-op with `--no-progress`)."""
        return Bar(self.plan.progress, total, desc)

    def image_summary(self) -> str:
        """The run's uploads in words, for the section headers."""
        mean = sum(len(j) for j in self.jpegs) / max(len(self.jpegs), 1)
        return f"640×480 JPEG (~{mean / 1e3:.0f} kB, {len(self.jpegs)} distinct)"

    # -- servers --------------------------------------------------------------------------------

    def server(self, name: str, store: str | Path, *, log_level: str = "WARNING",
               **options: Any) -> ServerProcess:
        """A `multihead serve` process (not started) over `store` with the run's trunk, batch
        size and wait, without API keys, plus `options` (flag name without dashes -> value)."""
        from bench.load import ServerProcess

        # NOTE: without API keys unless asked (`auth="keys"`): the load clients send none.
        opts: dict[str, Any] = {"max-batch-size": self.plan.max_batch_size, "auth": "none"}
        if self.plan.max_wait_ms is not None:
            opts["max-wait-ms"] = self.plan.max_wait_ms
        opts.update(options)
        return ServerProcess(name, str(store), self.prefix, str(self.out_dir), opts,
                             log_level=log_level)

    def start(self, server: ServerProcess) -> ServerProcess:
        """Starts `server`, waits for /readyz 200 and records the start."""
        say(f"starting server '{server.name}' ...")
        server.start()
        self.server_starts.append({"name": server.name, "healthz_s": server.healthz_s,
                                   "ready_s": server.ready_s})
        say(f"server '{server.name}' ready in {server.ready_s:.1f} s (pid {server.pid}, "
            f"port {server.port})")
        return server

    def share_graph_cache(self, store: str | Path) -> None:
        """Points `<store>/trunk/graph_cache` (where `multihead serve` keeps its saved graph) at
        one directory shared by the load servers of this run, so that only the first of them
        builds the graph. Cold starts are measured in the coldstart section, on a fresh store."""
        link = Path(store) / "trunk" / "graph_cache"
        if link.exists() or link.is_symlink():
            return
        shared = self.tmp / "graph-cache-shared"
        shared.mkdir(parents=True, exist_ok=True)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared, target_is_directory=True)

    def bot_store(self, name: str, bots: int) -> tuple[Path, list[str]]:
        """A new store `<tmp>/<name>-store` with `bots` random bots, sharing the run's saved
        graph; returns (store, bot ids)."""
        from bench.bots import register_bots

        store = self.tmp / f"{name}-store"
        ids = register_bots(store, bots, self.plan.classes, self.plan.seed)
        self.share_graph_cache(store)
        return store, ids

    def service_store(self) -> tuple[Path, list[str]]:
        """The store of the service-like sections (`plan.bots` Zipf-popular bots), registered
        once per run and shared by them; returns (store, bot ids)."""
        store = self.tmp / "service-store"
        if self._service_bots is None:
            self._service_bots = self.bot_store("service", self.plan.bots)[1]
        return store, self._service_bots

    # -- errors ---------------------------------------------------------------------------------

    def record_error(self, name: str, exc: BaseException) -> None:
        """Records a failed section (or part of one): its message in `errors`, its traceback in
        `<out_dir>/error-<name>.txt`."""
        message = f"{type(exc).__name__}: {exc}"
        self.errors[name] = message[:2000]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"error-{name}.txt").write_text(
            "".join(traceback.format_exception(exc)), "utf-8")
        say(f"section {name} FAILED: {message[:300]}")
