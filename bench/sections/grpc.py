"""Section `grpc`: one server with `--grpc-port`, three clients of it: REST /classify, KServe v2
ModelInfer and TF Serving Predict; latency at 1 client and images/s at 16 (the clients and the
load are in `bench.grpc_load`). Skipped, saying why, without the `grpc` extra."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.context import Context
from bench.result import Result, Skipped
from bench.sections.base import Results, Section


@dataclass
class GrpcResult(Result):
    grpc_ready_after_http_s: float | None = None
    # protocol -> {"c1": point, "c<concurrency>": point}
    protocols: dict[str, dict] = field(default_factory=dict)
    concurrency: int = 16
    bots: int | None = None
    load_average_before: list[float] = field(default_factory=list)
    load_average_after: list[float] = field(default_factory=list)
    server: dict = field(default_factory=dict)


def run(context: Context) -> GrpcResult | Skipped:
    from bench import grpc_load
    from bench.load import free_port

    why_not = grpc_load.grpc_available()
    if why_not:
        return Skipped(why_not)
    plan = context.plan
    store, bots = context.bot_store("grpc", plan.bots)
    server = context.start(context.server("grpc", store, **{"feature-cache-size": 0,
                                                             "grpc-port": free_port()}))
    try:
        return GrpcResult.from_json(grpc_load.run(
            server, context.jpegs, bots, zipf_s=plan.zipf_s, seed=plan.seed,
            requests_c1=plan.closed_requests(1), concurrency=16,
            requests_cn=plan.closed_requests(16)))
    finally:
        server.stop()


def render(result: GrpcResult | Skipped, results: Results) -> str:
    from bench.grpc_load import LABELS

    if isinstance(result, Skipped):
        return "\n".join(["## gRPC vs REST", "", f"Skipped: {result.skipped}", ""])
    n = result.concurrency
    nan = math.nan
    out = [f"## gRPC vs REST: one server, {result.bots} bots, feature cache off", ""]
    out += ["| protocol | p50 ms, 1 client | p95 ms, 1 client | images/s, "
            f"{n} clients | p50 ms, {n} clients | server: mean batch, trunk ms/image | errors |",
            "|---|---|---|---|---|---|---|"]
    for protocol, points in result.protocols.items():
        one, many = points["c1"], points.get(f"c{n}", {})
        out.append(f"| {LABELS.get(protocol, protocol)} | {one['p50_ms']:.1f} | "
                   f"{one['p95_ms']:.1f} | {many.get('throughput_images_per_s', nan):.2f} | "
                   f"{many.get('p50_ms', nan):.1f} | {many.get('server_mean_batch', nan):.1f}, "
                   f"{many.get('server_trunk_ms_per_image', nan):.0f} | "
                   f"{one['errors'] + many.get('errors', 0)} |")
    out += ["", f"Load average (1, 5, 15 min) before {result.load_average_before}, after "
                f"{result.load_average_after}: the machine is shared, other processes count.",
            ""]
    return "\n".join(out)


SECTION = Section("grpc", GrpcResult, run, render)
