"""The world the hostile-tenant attacks run in: one `multihead serve --auth keys` process on
loopback (HTTP and gRPC) over a store with two tenants, `attacker` (A) and `victim` (B), their
keys and bots; B's closed loop (`Victim`); the server's memory bound (`rss_bound`).

The server runs with short connection limits and tiny storage limits (`SERVER_OPTIONS`), so that
every defence binds within the seconds an attack lasts; A has a quota (`A_RATE`, `A_BURST`),
B none. Used by tests/hostile and by the bench section `isolation`: both start the server
with `bench.load.ServerProcess` (the bench through `Context.server`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

A, B = "attacker", "victim"
A_BOT, B_BOT = "attacker-bot", "victim-bot"
A_WORDY = "attacker-wordy"  # A's bot of WORDY_CLASSES labels of the longest length (answer bomb)
WORDY_CLASSES = 100
CLASSES = 10
OPERATOR_TOKEN = "hostile-operator-token"
MIB = 1 << 20

# A's quota, in images per second and bucket size: the bound that holds its decode bombs (a
# 36-megapixel 16-bit image costs its decoded bytes / 640x480x3, about 78 images).
A_RATE, A_BURST = 4.0, 8

# The server's settings (flag -> value): short connection limits, a small queue, few sockets,
# tiny storage limits, a small answer bound and feature cache. B's closed loop sends one image
# at a time and never reaches any of them.
SERVER_OPTIONS: dict = {
    "auth": "keys",
    "admin-token": OPERATOR_TOKEN,
    "header-timeout-s": 1.0,
    "body-min-rate-bytes-s": 1000,
    "body-grace-s": 0.5,
    "max-websockets": 8,
    "max-answer-bytes": 256 * 1024,
    "max-inflight-bytes": 256 * MIB,
    "max-body-bytes": 20 * MIB,
    "feature-cache-size": 4,  # B's pool of distinct images is larger: B always misses
    "tenant-max-bots": 4,
    "tenant-registrations-per-minute": 6,
    "request-timeout-s": 60,
    "heads-memory-mb": 64,  # the store's heads take well under 1 MiB
}

# Bytes per pixel at most while one image is decoded (`backbone.preprocess`): a 16-bit
# grayscale PNG is held as Pillow's 2 bytes a pixel, then float32 gray (4), its scaled and
# clipped copies (4 + 4) and the float32 RGB array of the whole image (12), before the crop.
DECODE_BYTES_PER_PIXEL = 26
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_PREPROCESS_THREADS = 2
DEFAULT_HEADS_MEMORY_MB = 2048


def rss_bound(idle_rss: int, options: dict) -> int:
    """The most the server's RSS may reach under attack: its RSS when idle (after `warm_up`:
    the trunk's working memory at a full batch is in it) plus the budgets its settings give:
    the in-flight request bytes, the images being decoded (the heavy lane's thread one image
    of at most max-image-pixels, each ordinary decode thread one of at most the heavy lane's
    cost, `DECODE_BYTES_PER_PIXEL` a pixel) and the heads' memory budget."""
    pixels = int(options.get("max-image-pixels", DEFAULT_MAX_IMAGE_PIXELS))
    threads = int(options.get("preprocess-threads", DEFAULT_PREPROCESS_THREADS))
    heads = int(options.get("heads-memory-mb", DEFAULT_HEADS_MEMORY_MB)) * MIB
    from service.core.decoding import HEAVY_DECODE_COST

    # The most pixels an ordinary decode thread holds: the lane's cost in 8-bit gray.
    ordinary = min(pixels, int(HEAVY_DECODE_COST * 640 * 480 * 3))
    return (idle_rss + int(options["max-inflight-bytes"])
            + (pixels + threads * ordinary) * DECODE_BYTES_PER_PIXEL + heads)


# -- the store ----------------------------------------------------------------------------------


@dataclass
class Tokens:
    """The credentials of the world: A's infer, manage and metrics keys, B's infer key, the
    operator token."""

    a_infer: str
    a_manage: str
    a_metrics: str
    b_infer: str
    operator: str = OPERATOR_TOKEN

    @staticmethod
    def header(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}


def make_store(path: str | Path, seed: int = 0) -> Tokens:
    """A new store at `path`: tenants A (quota `A_RATE`/`A_BURST`) and B, A's bots `A_BOT` and
    `A_WORDY`, B's `B_BOT`, and their keys."""
    import numpy as np

    from store import HeadStore

    rng = np.random.default_rng(seed)

    def head(classes: int, labels: list[str] | None = None):
        weights = rng.normal(0, 0.05, (1536, classes)).astype(np.float32)
        biases = np.zeros(classes, np.float32)
        return weights, biases, labels or [f"class-{i}" for i in range(classes)]

    with HeadStore(path) as store:
        store.add_tenant(A)
        store.add_tenant(B)
        store.set_tenant_limits(A, rate=A_RATE, burst=A_BURST)
        store.register(A_BOT, *head(CLASSES), tenant=A)
        store.register(A_WORDY, *head(WORDY_CLASSES, [f"{i:03d}" + "w" * 253
                                                      for i in range(WORDY_CLASSES)]), tenant=A)
        store.register(B_BOT, *head(CLASSES), tenant=B)
        return Tokens(a_infer=store.add_key(A, "infer")[1], a_manage=store.add_key(A, "manage")[1],
                      a_metrics=store.add_key(A, "metrics")[1],
                      b_infer=store.add_key(B, "infer")[1])


@dataclass
class World:
    """What an attack needs: the server's URLs and process, the credentials, the images (B's
    pool of distinct JPEGs and A's), a scratch directory."""

    url: str
    grpc_address: str
    pid: int
    tokens: Tokens
    jpegs: Sequence[bytes]  # B's closed loop's images, in turn
    scratch: Path
    options: dict = field(default_factory=lambda: dict(SERVER_OPTIONS))
    # The image of B's latest answered request (`Victim.last_image`, set by `run_phase`).
    b_last: Callable[[], bytes] = lambda: b""

    def a_images(self, n: int) -> list[bytes]:
        """A's images: small distinct JPEG uploads (never B's)."""
        return [tiny_jpeg(i) for i in range(n)]


@cache
def tiny_jpeg(seed: int) -> bytes:
    """A distinct 64x64 JPEG."""
    import io

    from PIL import Image

    image = Image.new("RGB", (64, 64), (seed % 256, (seed * 7) % 256, (seed * 13) % 256))
    out = io.BytesIO()
    image.save(out, format="JPEG")
    return out.getvalue()


@cache
def huge_png(width: int = 6000, height: int = 6000) -> bytes:
    """A real, decodable 16-bit grayscale PNG of width x height (36 megapixels by default) whose
    pixels are zero: about 100 kB, 72 MB decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    packer = zlib.compressobj(9)
    row = b"\0" * (1 + 2 * width)  # filter byte 0, then the row's 16-bit samples
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))


def head_upload(labels: Sequence[str], scratch: Path, name: str,
                candidate: str | None = None) -> tuple[bytes, str]:
    """A `PUT /bots/{id}` body (multipart: a head checkpoint of len(labels) classes, the
    labels file, a `candidate` part if given) and its content type. Writes the checkpoint with
    TensorFlow (once per name)."""
    import numpy as np

    from backbone.checkpoint import write_checkpoint

    prefix = scratch / "uploads" / name / "head.ckpt"
    if not Path(f"{prefix}.index").exists():
        rng = np.random.default_rng(len(labels))
        write_checkpoint(str(prefix), {
            "weights": rng.normal(0, 0.05, (1536, len(labels))).astype(np.float32),
            "biases": np.zeros(len(labels), np.float32)})
    boundary = "hostile-boundary-7d1f"
    body = b""
    if candidate is not None:
        body += (f'--{boundary}\r\nContent-Disposition: form-data; name="candidate"\r\n\r\n'
                 f'{candidate}\r\n').encode()
    for part, filename, data in (
            ("index", "head.ckpt.index", Path(f"{prefix}.index").read_bytes()),
            ("data", "head.ckpt.data-00000-of-00001",
             Path(f"{prefix}.data-00000-of-00001").read_bytes()),
            ("labels", "labels.txt", "".join(f"{label}\n" for label in labels).encode())):
        body += (f'--{boundary}\r\nContent-Disposition: form-data; name="{part}"; '
                 f'filename="{filename}"\r\n\r\n').encode() + data + b"\r\n"
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def warm_up(world: World, images: int = 16) -> None:
    """`images` distinct one-image requests of B at once (a full trunk batch at serve's default
    batch size), so that the trunk's working memory is part of the idle RSS."""
    from bench.load import client_session

    async def run() -> None:
        headers = {**Tokens.header(world.tokens.b_infer), "Content-Type": "image/jpeg"}
        async with client_session(headers=headers) as session:
            async def one(i: int) -> None:
                async with session.post(f"{world.url}/classify/{B_BOT}",
                                        data=tiny_jpeg(1000 + i)) as resp:
                    await resp.read()

            await asyncio.gather(*(one(i) for i in range(images)))

    asyncio.run(run())


# -- B's closed loop ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One request of B's loop: when it was sent, how long it took (s), its status (0: no
    answer, the connection failed)."""

    start: float
    latency_s: float
    status: int
    code: str = ""  # the JSON error body's code of a refusal


class Victim:
    """B's closed loop in a process of its own (so that neither A's client work nor its GIL
    ever delays B's: in a thread of the attacker's process, B's p99 measured A's client):
    one client sending one-image classifications to `B_BOT`, B's images in turn, until
    stopped. `samples` holds every answered request (a thread here reads them from the
    process, a JSON line each); `sent_in(start, end)` cuts them into phases
    (`time.perf_counter` is the machine's monotonic clock, the same in both processes)."""

    def __init__(self, url: str, token: str, jpegs: Sequence[bytes]) -> None:
        self.url, self.token, self.jpegs = url, token, list(jpegs)
        self.samples: list[Sample] = []
        self._process = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._collect, name="victim-samples",
                                        daemon=True)

    def _collect(self) -> None:
        for line in self._process.stdout:
            self.samples.append(Sample(*json.loads(line)))

    def start(self) -> Victim:
        import os
        import pickle
        import subprocess
        import sys

        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "bench.hostile.world"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, cwd=root)
        self._process.stdin.write(pickle.dumps((self.url, self.token, self.jpegs)))
        self._process.stdin.flush()  # stays open: the process stops when it closes
        self._thread.start()
        return self

    def stop(self) -> None:
        import subprocess

        self._stopped.set()
        if self._process is None:
            return
        self._process.stdin.close()
        try:
            self._process.wait(120)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._thread.join(10)

    def wait_served(self, timeout_s: float = 120.0) -> None:
        """Returns once one of B's requests was answered 200 (its first may wait for a cold
        server: its head loaded, a first batch run); AssertionError after `timeout_s`."""
        deadline = time.perf_counter() + timeout_s
        while not any(s.status == 200 for s in list(self.samples)):
            assert time.perf_counter() < deadline, f"B never served: {self.samples[:3]}"
            time.sleep(0.05)

    def sent_in(self, start: float, end: float) -> list[Sample]:
        """The requests sent in [start, end) and answered."""
        return [s for s in list(self.samples) if start <= s.start < end]

    def answered_after(self, moment: float, timeout_s: float) -> None:
        """Waits until every request sent before `moment` is answered (the loop has sent one
        after it), at most `timeout_s`."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline and not self._stopped.is_set():
            if self.samples and self.samples[-1].start >= moment:
                return
            time.sleep(0.02)

    def last_image(self) -> bytes:
        """The image of B's latest finished request."""
        return self.jpegs[(len(self.samples) - 1) % len(self.jpegs)]


async def _victim_loop(url: str, token: str, jpegs: Sequence[bytes], stop: threading.Event,
                       out) -> None:
    """`Victim`'s process: the closed loop until `stop`, each answered request written to
    `out` as a JSON line of a `Sample`'s fields."""
    from bench.load import client_session

    target = f"{url}/classify/{B_BOT}"
    headers = {**Tokens.header(token), "Content-Type": "image/jpeg"}
    async with client_session(limit=1) as session:
        i = 0
        while not stop.is_set():
            data = jpegs[i % len(jpegs)]
            i += 1
            start = time.perf_counter()
            try:
                async with session.post(target, data=data, headers=headers) as resp:
                    body = await resp.read()
                    status, code = resp.status, ""
                    if status != 200:
                        code = body[:200].decode(errors="replace")
            except Exception as exc:  # noqa: BLE001 - a failed connection is B refused
                status, code = 0, type(exc).__name__
            out.write(json.dumps([start, time.perf_counter() - start, status, code]) + "\n")
            out.flush()


def _victim_main() -> None:
    """`python -m bench.hostile.world`: (url, token, jpegs) pickled on stdin, then the loop
    until stdin closes."""
    import pickle
    import sys

    url, token, jpegs = pickle.load(sys.stdin.buffer)
    stop = threading.Event()

    def wait_for_close() -> None:
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=wait_for_close, daemon=True).start()
    asyncio.run(_victim_loop(url, token, jpegs, stop, sys.stdout))


# -- one attack beside the victim -------------------------------------------------------------


@dataclass
class Phase:
    """One phase of a run: B's requests during it, A's outcome (None: B alone), the server's
    RSS peak over it."""

    name: str
    samples: list[Sample]
    outcome: object | None = None
    rss_peak: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def victim_beside(world: World, *, warm_images: int = 16,
                  settle_s: float = 1.0) -> Iterator[tuple[Victim, int]]:
    """The server warmed up (`warm_up`), its idle RSS settled, then B's loop running and served
    once: (B's `Victim`, the idle RSS). B stops when the block ends."""
    from bench.memory import settle_rss

    warm_up(world, warm_images)
    idle = asyncio.run(settle_rss(world.pid, settle_s))
    victim = Victim(world.url, world.tokens.b_infer, world.jpegs).start()
    try:
        victim.wait_served()
        yield victim, idle
    finally:
        victim.stop()


def run_phase(world: World, victim: Victim, name: str, seconds: float, attack=None,
              drain_s: float = 120.0) -> Phase:
    """B's loop (running) measured for `seconds` alone (attack None), or while `attack` runs
    for `seconds` (and until A's last call is answered); the server's RSS sampled meanwhile.
    B's requests of the phase are those SENT in it: once it ends, B's request in flight is
    waited for (up to `drain_s`), so a request stalled past the phase still counts; a phase
    that none was sent in runs on until one was."""
    from bench.memory import RssSampler

    world.b_last = victim.last_image
    start = time.perf_counter()
    with RssSampler(world.pid, 0.05) as sampler:
        if attack is None:
            time.sleep(seconds)
            outcome = None
        else:
            outcome = asyncio.run(attack.run(world, seconds))
        end = time.perf_counter()
        victim.answered_after(end, drain_s)
        if not victim.sent_in(start, end):
            # One request sent before the phase spanned all of it (a loaded machine: seen for
            # the 2 s alone phase): the phase runs on to hold the next one.
            end = time.perf_counter()
            victim.answered_after(end, drain_s)
    return Phase(name, victim.sent_in(start, end), outcome, sampler.peak, end - start)


if __name__ == "__main__":
    _victim_main()
