"""A throw-away PostgreSQL server for the tests and the benchmark's `replicas` section
(PostgreSQL 15 binaries of the Debian package).

    server = PgServer()          # initdb + pg_ctl start, 127.0.0.1 on a free port, trust auth
    server.url                   # postgresql://postgres@127.0.0.1:<port>/postgres
    server.stop(); server.start(); server.restart(); server.kill()   # kill: SIGKILL, a crash
    server.cleanup()             # stop and delete the data directory

The server refuses to run as root and the tests run as root: then `initdb`, `pg_ctl` and so the
server run as the unprivileged user `nobody` (Python's `subprocess(user=, group=)`), in a temp
directory under /tmp that this user owns (pytest's tmp_path lies in a root-only directory that
`nobody` cannot enter). Not root: the binaries run directly, as the current user.

The server is tuned for tests (`fsync=off`, `full_page_writes=off`): that only risks data when
the machine itself crashes. A killed server (`kill()`) loses no acknowledged commit, because
`synchronous_commit` stays on: commits reach the OS before they are acknowledged.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DEFAULT_BINDIR = "/usr/lib/postgresql/15/bin"
BINDIR_ENV = "MULTIHEAD_PG_BINDIR"
UNPRIVILEGED_USER = "nobody"
SUPERUSER = "postgres"


class PgServerError(RuntimeError):
    """The test server could not be set up (missing binaries, initdb or start failed)."""


def find_bindir() -> Path:
    """The directory holding `initdb`, `pg_ctl` and `postgres`; PgServerError if absent."""
    bindir = Path(os.environ.get(BINDIR_ENV) or DEFAULT_BINDIR)
    missing = [n for n in ("initdb", "pg_ctl", "postgres") if not (bindir / n).is_file()]
    if missing:
        raise PgServerError(
            f"PostgreSQL server binaries not found: {', '.join(missing)} missing in {bindir}. "
            "Install the Debian package `postgresql` (PostgreSQL 15; `make test` installs it) "
            f"or point ${BINDIR_ENV} at another bin directory.")
    return bindir


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    """One PostgreSQL cluster in a temporary directory, started on construction."""

    def __init__(self, bindir: str | os.PathLike | None = None, *, start: bool = True,
                 durable: bool = False) -> None:
        # durable: fsync on, as a production server runs (the benchmark compares stores so).
        self.durable = durable
        self.bindir = Path(bindir) if bindir is not None else find_bindir()
        self.port = free_port()
        self._as_user: dict = {}
        if os.geteuid() == 0:
            pw = pwd.getpwnam(UNPRIVILEGED_USER)
            self._as_user = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        self.base = Path(tempfile.mkdtemp(prefix="multihead-pg-"))
        self.datadir = self.base / "data"
        self.socket_dir = self.base  # the unix socket lives next to the data directory
        self.logfile = self.base / "server.log"
        if self._as_user:
            os.chown(self.base, self._as_user["user"], self._as_user["group"])
        os.chmod(self.base, 0o700)
        try:
            self._run("initdb", "-D", self.datadir, "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                      "--locale=C", "--no-sync", "--no-instructions")
            if start:
                self.start()
        except BaseException:
            self.cleanup()
            raise

    @property
    def url(self) -> str:
        return self.url_for(SUPERUSER)

    def url_for(self, dbname: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server and wait until it accepts connections (same port every time)."""
        options = " ".join([
            f"-p {self.port}", "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={self.socket_dir}",
            *([] if self.durable else ["-c fsync=off", "-c full_page_writes=off"]),
            "-c max_connections=200", "-c shared_buffers=32MB",
        ])
        self._run("pg_ctl", "start", "-D", self.datadir, "-l", self.logfile, "-w", "-t", "60",
                  "-o", options)

    def stop(self) -> None:
        """A fast shutdown: open sessions are ended, the server is gone when this returns."""
        if self.running():
            self._run("pg_ctl", "stop", "-D", self.datadir, "-m", "fast", "-w", "-t", "60")

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL the postmaster and every child process: a crash, no shutdown of any kind."""
        pid = self._postmaster_pid()
        if pid is None:
            return
        victims = [pid, *self._children(pid)]
        for p in victims:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in victims):
            if time.monotonic() > deadline:
                raise PgServerError(f"PostgreSQL processes {victims} survived SIGKILL")
            time.sleep(0.02)
        # The dead postmaster may stay a zombie until PID 1 reaps it, and a zombie's pid still
        # answers kill(pid, 0): the next start would take its lock files for a live server's.
        (self.datadir / "postmaster.pid").unlink(missing_ok=True)
        (self.socket_dir / f".s.PGSQL.{self.port}.lock").unlink(missing_ok=True)

    def running(self) -> bool:
        pid = self._postmaster_pid()
        return pid is not None and _alive(pid)

    def ensure_running(self) -> None:
        if not self.running():
            self.start()

    def cleanup(self) -> None:
        """Stop (or kill) the server and delete its directory. Idempotent."""
        try:
            if self.datadir.exists() and self.running():
                try:
                    self.stop()
                except PgServerError:
                    self.kill()
        finally:
            shutil.rmtree(self.base, ignore_errors=True)

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self.logfile.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    # -- helpers -------------------------------------------------------------------------------

    def _run(self, tool: str, *args) -> None:
        cmd = [str(self.bindir / tool), *(str(a) for a in args)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C",
               "HOME": str(self.base), "TZ": "UTC"}
        # pg_ctl's children inherit the pipes: send their output to a file, never to a pipe
        # that we would wait on until the server exits.
        with open(self.base / f"{tool}.out", "ab") as out:
            if self._as_user:
                os.chown(out.name, self._as_user["user"], self._as_user["group"])
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, env=env, cwd=self.base,
                                  timeout=120, **self._as_user)
        if proc.returncode != 0:
            output = (self.base / f"{tool}.out").read_text(errors="replace")[-3000:]
            raise PgServerError(f"{tool} {' '.join(map(str, args[:1]))} failed "
                                f"(exit {proc.returncode}):\n{output}\n{self.log_tail()}")

    def _postmaster_pid(self) -> int | None:
        try:
            first = (self.datadir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _children(pid: int) -> list[int]:
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 1 and int(fields[1]) == pid:
                out.append(int(entry.name))
        return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie is dead; its parent (pg_ctl's or ours) reaps it
