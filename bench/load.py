"""The benchmark's outside view of the service: a real `multihead serve` process on loopback,
and HTTP load against it (closed loop at fixed concurrency, open loop with Poisson arrivals).

Nothing here imports TensorFlow or the service; aiohttp is imported by the load functions only.
"""
from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.prometheus import Histogram, histograms, unlabelled
from bench.stats import ZipfSampler, poisson_arrivals, rss_bytes, summarize

# -- images ---------------------------------------------------------------------------------


def make_jpeg(seed: int, size: tuple[int, int] = (640, 480), quality: int = 90) -> bytes:
    """A distinct photo-like JPEG: colour blocks, a gradient, soft shapes and sensor noise.

    At 640x480 and quality 90 it is about 100-200 kB, the size of a phone upload scaled down.
    """
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(10_000 + seed)
    width, height = size
    blocks = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    big = np.kron(blocks, np.ones((height // 6 + 1, width // 8 + 1, 1), np.uint8))[:height, :width]
    ramp = np.linspace(0, 60, width, dtype=np.float32)[None, :, None]
    image = Image.fromarray(np.clip(big + ramp, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(10, 120))
        draw.ellipse([x0 - r, y0 - r, x0 + r, y0 + r],
                     fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    image = image.filter(ImageFilter.GaussianBlur(2))
    pixels = np.asarray(image, np.float32) + rng.normal(0, 6, (height, width, 3))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def make_jpegs(count: int, size: tuple[int, int] = (640, 480)) -> list[bytes]:
    return [make_jpeg(i, size) for i in range(count)]


# -- the server process -------------------------------------------------------------------


# How often a starting server's /healthz and /readyz are asked: every POLL_S for the first
# POLL_FAST_FOR_S (a restart with a saved graph is ready in 1-3 s: its time to ready is
# measured to POLL_S), then every POLL_SLOW_S. A first start measures the trunk's batch
# profile (`backbone.profile`), which every later server of the run loads; at 50 requests a
# second the polls took the cores from it: measured on 2 Xeon cores (OpenVINO bf16), a batch
# of 16 profiled at 191-196 ms polled every 20 ms, 180-185 every 0.5 s (176-180 in the servers).
POLL_S, POLL_FAST_FOR_S, POLL_SLOW_S = 0.02, 3.0, 0.25


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def multihead_command(subcommand: str) -> list[str]:
    """`multihead <subcommand>` of this interpreter's environment: the console script when
    installed, else `python -m cli <subcommand>` (the same entry point)."""
    script = Path(sys.executable).with_name("multihead")
    if script.exists():
        return [str(script), subcommand]
    return [sys.executable, "-m", "cli", subcommand]


def serve_command() -> list[str]:
    """`multihead serve` of this interpreter's environment (`multihead_command`)."""
    return multihead_command("serve")


def child_env() -> dict[str, str]:
    """The environment of the `multihead` processes the benchmark starts: this one without
    MULTIHEAD_* settings (the flags say everything), TF's info logs off, unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIHEAD_")}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONUNBUFFERED"] = "1"
    return env


_LIVE: set[ServerProcess] = set()


def stop_all_servers() -> None:
    """Stops every server this process started and did not stop yet (interrupts, errors)."""
    for server in list(_LIVE):
        server.stop()


class ServerError(RuntimeError):
    """The server process exited or did not become ready in time."""


@dataclass
class ServerProcess:
    """One `multihead serve` process on 127.0.0.1 and a free port.

    Args:
        name: used for its log file `<log_dir>/server-<name>.log`.
        store: the store directory (its registered bots are served).
        trunk_checkpoint: the trunk checkpoint prefix (`--trunk-checkpoint`).
        options: extra `serve` flags, e.g. {"batch-policy": "per_group"}; True -> bare flag.
    """

    name: str
    store: str
    trunk_checkpoint: str
    log_dir: str
    options: dict = field(default_factory=dict)
    log_level: str = "WARNING"
    port: int = 0
    healthz_s: float | None = None
    ready_s: float | None = None
    _timings: dict = field(default_factory=dict)
    _trunk: dict = field(default_factory=dict)
    _proc: subprocess.Popen | None = None
    _log: object = None

    def __hash__(self) -> int:
        return id(self)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return Path(self.log_dir) / f"server-{self.name}.log"

    def command(self) -> list[str]:
        cmd = serve_command() + ["--host", "127.0.0.1", "--port", str(self.port),
                                 "--store", self.store, "--trunk-checkpoint",
                                 self.trunk_checkpoint, "--log-level", self.log_level]
        for key, value in self.options.items():
            if value is True:
                cmd.append(f"--{key}")
            elif value is False:
                cmd.append(f"--no-{key}")
            else:
                cmd += [f"--{key}", str(value)]
        return cmd

    def start(self, timeout_s: float = 300.0) -> ServerProcess:
        """Starts the process and waits for /readyz 200; records seconds to /healthz and /readyz
        from just before the process was spawned, and the server's own timings from the body of
        that 200 (see `server_timings`)."""
        self.port = free_port()
        self.healthz_s = self.ready_s = None
        self._timings, self._trunk = {}, {}
        env = child_env()
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(self.command())}\n".encode())
        self._log.flush()
        t0 = time.monotonic()
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env)
        _LIVE.add(self)
        try:
            while True:
                now = time.monotonic()
                if self._proc.poll() is not None:
                    raise ServerError(f"server '{self.name}' exited with code "
                                      f"{self._proc.returncode}: {self.log_tail()}")
                if now - t0 > timeout_s:
                    raise ServerError(f"server '{self.name}' not ready after {timeout_s:.0f} s: "
                                      f"{self.log_tail()}")
                if self.healthz_s is None and _get_status(f"{self.url}/healthz") == 200:
                    self.healthz_s = time.monotonic() - t0
                if self.healthz_s is not None:
                    # The operator's full /readyz (a server with keys shows the rest only
                    # the readiness): the trunk's runtime and precision, the timings.
                    status, body = _get(f"{self.url}/readyz",
                                        token=self.options.get("admin-token"))
                    if status == 200:
                        self.ready_s = time.monotonic() - t0
                        self._timings = _readyz_timings(body)
                        self._trunk = _readyz_trunk(body)
                        return self
                    if b'"failed"' in body:
                        raise ServerError(f"server '{self.name}' failed to load: "
                                          f"{body.decode(errors='replace')[:300]}")
                time.sleep(POLL_S if now - t0 < POLL_FAST_FOR_S else POLL_SLOW_S)
        except BaseException:
            self.stop()
            raise

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text("utf-8", errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def server_timings(self) -> dict[str, float]:
        """The server's own start-up timings, as its /readyz answered when it became ready:
        `import_s`, `build_s`, `restore_s`, `warmup_s` and `ready_s` (seconds from the app's
        start to ready). Only the keys the server reported (none from a server whose /readyz
        has no "timings"); empty before `start()` has seen ready."""
        return dict(self._timings)

    def trunk_info(self) -> dict:
        """The trunk the server runs, as its /readyz answered when it became ready (`weights`,
        `device`, `runtime`, `precision`, ...); empty before `start()` has seen ready."""
        return dict(self._trunk)

    def runtime(self) -> str:
        """"<runtime>-<precision>" of the server's trunk, e.g. "tf-bf16" (a server whose
        /readyz does not say runs the TF fp32 trunk)."""
        info = self._trunk
        return f"{info.get('runtime', 'tf')}-{info.get('precision', 'fp32')}"

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (graceful: drain, close), then SIGKILL if it does not exit in time."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None
        _LIVE.discard(self)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _get(url: str, timeout_s: float = 2.0, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def _readyz_timings(body: bytes) -> dict[str, float]:
    """The numeric entries of "timings" in a /readyz JSON body ({} when absent or not JSON)."""
    try:
        timings = json.loads(body).get("timings")
    except (ValueError, AttributeError):
        return {}
    if not isinstance(timings, dict):
        return {}
    return {str(k): float(v) for k, v in timings.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _readyz_trunk(body: bytes) -> dict:
    """The "trunk" object of a /readyz JSON body ({} when absent or not JSON)."""
    try:
        trunk = json.loads(body).get("trunk")
    except (ValueError, AttributeError):
        return {}
    return dict(trunk) if isinstance(trunk, dict) else {}


def _get_status(url: str) -> int:
    return _get(url)[0]


async def scrape_metrics(url: str) -> tuple[dict[str, Histogram], dict[str, float]]:
    """Histograms and unlabelled gauges/counters of GET {url}/metrics."""
    async with client_session() as session:
        async with session.get(f"{url}/metrics") as response:
            if response.status != 200:
                raise ServerError(f"GET {url}/metrics answered {response.status}")
            text = await response.text()
    return histograms(text), unlabelled(text)


# -- load -------------------------------------------------------------------------------------


@dataclass
class Record:
    start: float  # perf_counter time the request was sent (open loop: its scheduled time)
    end: float
    status: int

    @property
    def latency_s(self) -> float:
        return self.end - self.start


class Workload:
    """What each request sends: the next image of a pool (cycled, so consecutive requests carry
    distinct images) to a bot drawn with Zipf popularity."""

    def __init__(self, jpegs: Sequence[bytes], bot_ids: Sequence[str], zipf_s: float = 1.0,
                 seed: int = 0) -> None:
        if not jpegs or not bot_ids:
            raise ValueError("a workload needs at least one image and one bot")
        self.jpegs = list(jpegs)
        self.bot_ids = list(bot_ids)
        self.sampler = ZipfSampler(len(bot_ids), zipf_s, seed)
        self._images: Iterator[int] = itertools.cycle(range(len(self.jpegs)))

    def next(self) -> tuple[str, bytes]:
        return self.bot_ids[self.sampler.sample()], self.jpegs[next(self._images)]


async def post_image(session, url: str, data: bytes) -> int:
    async with session.post(url, data=data, headers={"Content-Type": "image/jpeg"}) as response:
        await response.read()
        return response.status


def client_session(limit: int = 0, headers: dict[str, str] | None = None):
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=300), headers=headers)


def _point_stats(records: list[Record], window: tuple[float, float] | None) -> dict:
    ok = [r for r in records if r.status == 200]
    if window is None:
        measured = ok
        begin = min((r.start for r in records), default=0.0)
        end = max((r.end for r in records), default=0.0)
        completed = len(ok)
    else:
        begin, end = window
        measured = [r for r in ok if r.start >= begin]
        completed = sum(1 for r in ok if begin < r.end <= end)
    span = end - begin
    stats = summarize([r.latency_s for r in measured])
    return {
        "requests": len(measured),
        "errors": sum(1 for r in records if r.status != 200),
        "error_statuses": sorted({r.status for r in records if r.status != 200}),
        "throughput_images_per_s": completed / span if span > 0 else float("nan"),
        "window_s": span,
        **{k: v for k, v in stats.items() if k != "n"},
    }


async def closed_loop(url: str, workload: Workload, concurrency: int, requests: int,
                      progress: Callable[[int], None] | None = None,
                      headers: dict[str, str] | None = None) -> dict:
    """`concurrency` clients, each sending its next request as soon as the last one answered.

    The first `concurrency` requests warm the loop up; the window runs from the moment they
    have all completed to the moment the last request is sent (so neither the ramp-up nor the
    drain, when fewer clients are left, counts). Throughput = completions inside the window /
    its length; latencies = every request sent inside it. `headers` go with every request
    (an API key).
    """
    total = requests + concurrency
    records: list[Record] = []
    issued = 0
    last_issue = [0.0]

    async with client_session(limit=concurrency, headers=headers) as session:
        async def client() -> None:
            nonlocal issued
            while issued < total:
                issued += 1
                if issued == total:
                    last_issue[0] = time.perf_counter()
                bot_id, data = workload.next()
                await _record_post(session, f"{url}/classify/{bot_id}", data,
                                   time.perf_counter(), records, progress)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    ends = sorted(r.end for r in records)
    begin = ends[concurrency - 1]
    end = max(last_issue[0], begin)
    out = _point_stats(records, (begin, end))
    out.update(mode="closed", concurrency=concurrency)
    return out


async def open_loop(url: str, workload: Workload, rate_per_s: float, count: int, seed: int = 0,
                    progress: Callable[[int], None] | None = None) -> dict:
    """Requests arriving as a Poisson process, whatever the server's state (open loop).

    Latency runs from each request's SCHEDULED time, so a server that falls behind is charged
    for the queueing it causes (no coordinated omission).
    """
    arrivals = poisson_arrivals(rate_per_s, count, seed)
    records: list[Record] = []

    async with client_session() as session:
        async def one(scheduled: float, bot_id: str, data: bytes) -> None:
            await _record_post(session, f"{url}/classify/{bot_id}", data, scheduled, records,
                               progress)

        t0 = time.perf_counter()
        tasks = []
        for at in arrivals:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            bot_id, data = workload.next()
            tasks.append(asyncio.create_task(one(t0 + at, bot_id, data)))
        await asyncio.gather(*tasks)
    out = _point_stats(records, None)
    out.update(mode="open", rate_per_s=rate_per_s, concurrency=None)
    return out


async def _record_post(session, url: str, data: bytes, start: float, records: list,
                       progress: Callable[[int], None] | None) -> None:
    """POSTs one image and appends its Record (latency from `start`; status -1 on a transport
    error: a failed request is a data point, not a crash)."""
    try:
        status = await post_image(session, url, data)
    except Exception:  # noqa: BLE001
        status = -1
    records.append(Record(start, time.perf_counter(), status))
    if progress is not None:
        progress(1)


async def sequential(url: str, requests: Sequence[tuple[str, bytes]],
                     progress: Callable[[int], None] | None = None) -> list[Record]:
    """Sends the (path, image) requests one after the other; path like "/classify/acme"."""
    return await concurrent(url, requests, 1, progress)


async def concurrent(url: str, requests: Sequence[tuple[str, bytes]], concurrency: int,
                     progress: Callable[[int], None] | None = None) -> list[Record]:
    """Sends the (path, image) requests with at most `concurrency` in flight."""
    records = []
    queue = list(reversed(requests))
    async with client_session(limit=concurrency) as session:
        async def worker() -> None:
            while queue:
                path, data = queue.pop()
                await _record_post(session, f"{url}{path}", data, time.perf_counter(), records,
                                   progress)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records
