"""The clients and the load of the `grpc` section: the same server over REST and over gRPC.

One `multihead serve --grpc-port N` process (feature cache off, the service section's bots and
Zipf popularity, the run's 640x480 JPEGs), three clients of it:

    rest          POST /classify/{bot} with the JPEG as the body (aiohttp), as the service section
    grpc_kserve   ModelInfer, BYTES in raw_input_contents, with Triton's `tritonclient.grpc.aio`
    grpc_tfs      TF Serving Predict, DT_STRING, with the `tensorflow-serving-api` stubs on a
                  grpc.aio channel

Measured: latency at 1 client (the protocols take turns request by request, so a machine whose
load changes during the run charges every protocol alike), then closed loops at 16 clients, the
protocols again taking turns, in rounds (images/s = completions inside the windows / their total
length, latencies pooled; each window opens when the loop's first 16 requests have completed and
closes when its last request is sent, as in `bench.load.closed_loop`). The server's own mean
batch size and trunk seconds per image over each protocol's loops say whether a difference is
the protocol's or the machine's.

Needs the `grpc` extra in the benchmark's environment; without it the section records why it was
skipped. Nothing heavy is imported at module level.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bench.load import Record, Workload, client_session, scrape_metrics
from bench.stats import summarize

PROTOCOLS = ("rest", "grpc_kserve", "grpc_tfs")
LABELS = {"rest": "REST `/classify`", "grpc_kserve": "gRPC KServe v2 ModelInfer (tritonclient)",
          "grpc_tfs": "gRPC TF Serving Predict"}
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

Send = Callable[[str, bytes], Awaitable[bool]]


def grpc_available() -> str | None:
    """None when the gRPC clients can be imported, else why not."""
    import importlib.util

    missing = [m for m in ("grpc", "tritonclient", "tensorflow_serving")
               if importlib.util.find_spec(m) is None]
    return f"not installed: {', '.join(missing)} (the grpc extra)" if missing else None


class Clients:
    """One client per protocol, each with a `send(bot, jpeg) -> ok` coroutine."""

    def __init__(self, http_url: str, grpc_address: str) -> None:
        import grpc
        import tritonclient.grpc.aio as triton
        from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

        self._http_url = http_url
        self._triton_module = triton
        self._session = client_session()
        self._triton = triton.InferenceServerClient(grpc_address)
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self._channel = grpc.aio.insecure_channel(grpc_address, options=options)
        self._predict = prediction_service_pb2_grpc.PredictionServiceStub(self._channel).Predict
        self._predict_request = predict_pb2.PredictRequest
        tensor = (predict_pb2.PredictRequest.DESCRIPTOR.fields_by_name["inputs"]
                  .message_type.fields_by_name["value"].message_type)
        self._dt_string = tensor.fields_by_name["dtype"].enum_type.values_by_name[
            "DT_STRING"].number
        self.send: dict[str, Send] = {"rest": self.rest, "grpc_kserve": self.kserve,
                                      "grpc_tfs": self.tfs}

    async def rest(self, bot: str, jpeg: bytes) -> bool:
        async with self._session.post(f"{self._http_url}/classify/{bot}", data=jpeg,
                                      headers={"Content-Type": "image/jpeg"}) as response:
            await response.read()
            return response.status == 200

    async def kserve(self, bot: str, jpeg: bytes) -> bool:
        import numpy as np

        triton = self._triton_module
        image = triton.InferInput("image_bytes", [1], "BYTES")
        image.set_data_from_numpy(np.array([jpeg], dtype=object))
        result = await self._triton.infer(bot, [image], client_timeout=300)
        return result.as_numpy("probabilities") is not None

    async def tfs(self, bot: str, jpeg: bytes) -> bool:
        request = self._predict_request()
        request.model_spec.name = bot
        tensor = request.inputs["image_bytes"]
        tensor.dtype = self._dt_string
        tensor.tensor_shape.dim.add(size=1)
        tensor.string_val.append(jpeg)
        response = await self._predict(request, timeout=300)
        return "probabilities" in response.outputs

    async def wait_grpc(self, timeout_s: float = 120.0) -> float:
        """Seconds until the gRPC side answers ServerReady true."""
        t0 = time.monotonic()
        while True:
            try:
                if await self._triton.is_server_ready(client_timeout=2):
                    return time.monotonic() - t0
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the gRPC side was not ready after {timeout_s:.0f} s")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self._session.close()
        await self._triton.close()
        await self._channel.close()


class InferChannel:
    """A grpc.aio channel for KServe v2 ModelInfer calls that may be refused: `infer(model,
    images, token)` gives the call's status name ("OK", "UNAUTHENTICATED", ...), never raises
    for a refusal. The hostile tenant's gRPC attack (`bench.hostile.attacks`) uses it; an
    async context manager."""

    def __init__(self, grpc_address: str) -> None:
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self._grpc, self._pb = grpc, service_pb2
        self._channel = grpc.aio.insecure_channel(grpc_address, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        self._infer = service_pb2_grpc.GRPCInferenceServiceStub(self._channel).ModelInfer

    async def infer(self, model: str, images: Sequence[bytes], token: str | None,
                    timeout_s: float = 60.0) -> str:
        request = self._pb.ModelInferRequest(model_name=model)
        request.inputs.add(name="image_bytes", datatype="BYTES", shape=[len(images)])
        # A raw BYTES input: each element's length (4 bytes, little-endian), then its bytes.
        request.raw_input_contents.append(b"".join(len(i).to_bytes(4, "little") + i
                                                   for i in images))
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            await self._infer(request, metadata=metadata, timeout=timeout_s)
        except self._grpc.RpcError as exc:
            return exc.code().name
        return "OK"

    async def __aenter__(self) -> InferChannel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self._channel.close()


async def _timed(send: Send, bot: str, data: bytes, records: list[Record]) -> None:
    start = time.perf_counter()
    try:
        ok = await send(bot, data)
    except Exception:  # noqa: BLE001 - a failed request is a data point, not a crash
        ok = False
    records.append(Record(start, time.perf_counter(), 200 if ok else -1))


async def alternating(clients: Clients, workload: Workload, requests: int,
                      progress: Callable[[int], None] | None = None) -> dict[str, dict]:
    """One client: each round sends the same (bot, image) once per protocol, in turn."""
    records: dict[str, list[Record]] = {p: [] for p in PROTOCOLS}
    for _ in range(requests):
        bot, data = workload.next()
        for protocol in PROTOCOLS:
            await _timed(clients.send[protocol], bot, data, records[protocol])
            if progress is not None:
                progress(1)
    out = {}
    for protocol, recs in records.items():
        ok = [r for r in recs if r.status == 200]
        out[protocol] = {"mode": "closed", "concurrency": 1, "requests": len(ok),
                         "errors": len(recs) - len(ok),
                         **{k: v for k, v in summarize([r.latency_s for r in ok]).items()
                            if k != "n"}}
    return out


async def closed_loop(send: Send, workload: Workload, concurrency: int, requests: int,
                      progress: Callable[[int], None] | None = None) -> dict:
    """`concurrency` clients back to back; the window and rates as `bench.load.closed_loop`.
    Returns the window's length, the completions inside it, the latencies of the requests sent
    inside it (s) and the number of failed requests."""
    total = requests + concurrency
    records: list[Record] = []
    issued = 0
    last_issue = 0.0

    async def client() -> None:
        nonlocal issued, last_issue
        while issued < total:
            issued += 1
            if issued == total:
                last_issue = time.perf_counter()
            bot, data = workload.next()
            await _timed(send, bot, data, records)
            if progress is not None:
                progress(1)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    ends = sorted(r.end for r in records)
    begin = ends[concurrency - 1]
    end = max(last_issue, begin)
    ok = [r for r in records if r.status == 200]
    return {"window_s": end - begin,
            "completed": sum(1 for r in ok if begin < r.end <= end),
            "latencies_s": [r.latency_s for r in ok if r.start >= begin],
            "errors": len(records) - len(ok)}


def _pooled(loops: list[dict], concurrency: int) -> dict:
    window = sum(loop["window_s"] for loop in loops)
    latencies = [x for loop in loops for x in loop["latencies_s"]]
    return {"mode": "closed", "concurrency": concurrency, "rounds": len(loops),
            "requests": len(latencies), "errors": sum(loop["errors"] for loop in loops),
            "throughput_images_per_s": (sum(loop["completed"] for loop in loops) / window
                                        if window > 0 else float("nan")),
            "window_s": window,
            **{k: v for k, v in summarize(latencies).items() if k != "n"}}


async def _server_stats(url: str) -> tuple[float, float, float]:
    """(batches, rows, trunk seconds) the server has run so far."""
    histograms, _ = await scrape_metrics(url)
    batch, trunk = histograms["multihead_batch_size"], histograms["multihead_trunk_seconds"]
    return batch.count, batch.sum, trunk.sum


async def compare(http_url: str, grpc_address: str, jpegs: Sequence[bytes],
                  bots: Sequence[str], *, zipf_s: float, seed: int, requests_c1: int,
                  concurrency: int, requests_cn: int, rounds: int = 2,
                  progress: Callable[[str, int], Callable[[int], None] | None] | None = None
                  ) -> dict[str, Any]:
    """The measurements of the section against a running server (see the module doc);
    `requests_cn` measured requests per protocol at `concurrency`, split over `rounds`."""
    clients = Clients(http_url, grpc_address)
    try:
        grpc_ready_s = await clients.wait_grpc()
        warm = Workload(jpegs, bots, zipf_s, seed=seed + 99)
        for protocol in PROTOCOLS:  # connections, thread pools, batch shapes: not measured
            await closed_loop(clients.send[protocol], warm, concurrency, 0)
        # NOTE: each closed loop below also starts with `concurrency` unmeasured requests.
        bar = progress("1 client, protocols in turn", requests_c1 * len(PROTOCOLS)) \
            if progress else None
        one = await alternating(clients, Workload(jpegs, bots, zipf_s, seed=seed), requests_c1,
                                bar)
        results: dict[str, Any] = {"grpc_ready_after_http_s": grpc_ready_s,
                                   "protocols": {p: {"c1": one[p]} for p in PROTOCOLS}}
        loops: dict[str, list[dict]] = {p: [] for p in PROTOCOLS}
        server: dict[str, list[float]] = {p: [0.0, 0.0, 0.0] for p in PROTOCOLS}
        per_round = max(1, requests_cn // rounds)
        for round_index in range(rounds):
            for index, protocol in enumerate(PROTOCOLS):
                bar = progress(f"{protocol} {concurrency} clients, round {round_index + 1}",
                               per_round + concurrency) if progress else None
                workload = Workload(jpegs, bots, zipf_s,
                                    seed=seed + 1 + index + 10 * round_index)
                before = await _server_stats(http_url)
                loops[protocol].append(await closed_loop(
                    clients.send[protocol], workload, concurrency, per_round, bar))
                after = await _server_stats(http_url)
                server[protocol] = [t + a - b for t, a, b in zip(server[protocol], after, before)]
        for protocol in PROTOCOLS:
            batches, rows, trunk_s = server[protocol]
            point = _pooled(loops[protocol], concurrency)
            point.update(server_mean_batch=rows / batches if batches else float("nan"),
                         server_trunk_ms_per_image=1000 * trunk_s / rows if rows
                         else float("nan"))
            results["protocols"][protocol][f"c{concurrency}"] = point
        return results
    finally:
        await clients.close()


def run(server, jpegs: Sequence[bytes], bots: Sequence[str], *, zipf_s: float, seed: int,
        requests_c1: int, concurrency: int, requests_cn: int, rounds: int = 2,
        progress: Callable[[str, int], Callable[[int], None] | None] | None = None) -> dict:
    """The section against `server` (a started `bench.load.ServerProcess` with `grpc-port` in
    its options); returns its results."""
    load_before = os.getloadavg()
    results = asyncio.run(compare(
        server.url, f"127.0.0.1:{server.options['grpc-port']}", jpegs, bots, zipf_s=zipf_s,
        seed=seed, requests_c1=requests_c1, concurrency=concurrency, requests_cn=requests_cn,
        rounds=rounds, progress=progress))
    results.update(concurrency=concurrency, bots=len(bots),
                   load_average_before=[round(x, 2) for x in load_before],
                   load_average_after=[round(x, 2) for x in os.getloadavg()],
                   server={"ready_s": server.ready_s, "pid": server.pid})
    return results
