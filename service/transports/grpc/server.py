"""The gRPC transport: a grpc.aio server on `--grpc-port`, in the serving process, over the same
`Service` (engine, cross-bot batcher, store, readiness, in-flight budget) as the aiohttp app.

    KServe v2 / Triton   inference.GRPCInferenceService           (service.transports.grpc.kserve)
    TF Serving           tensorflow.serving.PredictionService,
                         tensorflow.serving.ModelService
                         (service.transports.grpc.tfserving)


Lifecycle (a `Listener` of the HTTP transport, `service.transports.common.lifecycle`): `open()`
binds the port at start-up, so a port
in use fails
the start like the HTTP one does; the services' modules (which import TensorFlow through the
generated TF Serving messages) are loaded in the background after the trunk's TensorFlow import,
then the server starts: the HTTP health routes do not wait for it, and a client that connects
meanwhile is answered once it has started (a second or two after TensorFlow is imported).
`begin_stop()` when the HTTP server stops accepting: new calls are refused with UNAVAILABLE
(code `shutting_down`) and the calls in flight get `request_timeout_s` to finish, the same drain
the HTTP side has; then the server stops (calls still running are cancelled, their rows
withdrawn). `close()` waits for that, before the `Service` drains its engine.

Credentials before the message: `gate.Credentials` (the first server interceptor) refuses a
call that needs a credential and has none accepted with UNAUTHENTICATED before its message is
read. Message size: `max_body_bytes` is the largest request message (beyond it gRPC answers
RESOURCE_EXHAUSTED before any handler runs): what ModelInfer and Predict need for
`max_images_per_request` images within the REST body limit; grpc has one receive limit per
server, not per method, so `gate.MessageCaps` (the next interceptor) caps every other RPC's
message at `gate.SMALL_MESSAGE_BYTES` before it is parsed (RESOURCE_EXHAUSTED,
`payload_too_large`). Calls in flight: at most `max_grpc_calls`, by tenant (`common.Rpcs`).
The generated code comes from the packages of the `grpc` extra (`tritonclient`,
`tensorflow-serving-api`).
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from backbone.tfimport import import_tensorflow
from service.core.errors import ServiceError
from service.transports.grpc.common import MethodNames, Rpcs
from service.transports.grpc.gate import Credentials, MessageCaps

if TYPE_CHECKING:  # pragma: no cover
    from service.core.service import Service

log = logging.getLogger(__name__)

# The packages whose generated modules the services use (the `grpc` extra).
STUB_PACKAGES = ("tritonclient", "tensorflow_serving")
EXTRA_HINT = "pip install 'multihead[grpc]'"


def listen_address(host: str, port: int) -> str:
    """`host:port` as gRPC parses it (an IPv6 literal in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _registrations() -> tuple[list[Callable[[grpc.aio.Server, Rpcs], list[str]]],
                              dict[str, str]]:
    """The services' `register` functions, and their RPCs' REST twins by RPC name (imports
    their generated modules: blocking)."""
    from service.transports.grpc import kserve as grpc_kserve
    from service.transports.grpc import tfserving as grpc_tfserving

    return ([grpc_kserve.register, grpc_tfserving.register],
            {**grpc_kserve.ENDPOINT_NAMES, **grpc_tfserving.ENDPOINT_NAMES,
             # answered as their REST verbs are, under Predict's endpoint (`tfserving`)
             "Classify": grpc_tfserving.ENDPOINT_NAMES["Predict"],
             "Regress": grpc_tfserving.ENDPOINT_NAMES["Predict"]})


class GrpcServer:
    """The gRPC listener of one process (see the module doc).

    Attributes:
        port: the bound port once `open()` returned (the chosen one when the setting is 0).
        services: the full names of the services served, once started.
    """

    def __init__(self, service: Service) -> None:
        self.service = service
        self.port: int | None = None
        self.services: list[str] = []
        self._server: grpc.aio.Server | None = None
        self._address = ""
        self._rpcs = Rpcs(service)
        self._names: dict[str, str] = {}  # RPC -> its REST twin's endpoint name (`Credentials`)
        self.credentials: Credentials | None = None
        self._start_task: asyncio.Task | None = None
        self._stop_task: asyncio.Task | None = None

    async def open(self) -> None:
        """Binds the port and starts serving in the background.

        Raises:
            ServiceError: the grpc extra is not installed, or the port cannot be bound.
        """
        settings = self.service.settings
        assert settings.grpc_port is not None, "open() needs a grpc_port"
        missing = [name for name in STUB_PACKAGES if importlib.util.find_spec(name) is None]
        if missing:
            await self._fail(f"--grpc-port needs the grpc extra ({', '.join(missing)} not "
                             f"installed): {EXTRA_HINT}")
        # The credentials first: a call refused there never has its message read.
        self.credentials = Credentials(self._rpcs, self._names)
        self._server = grpc.aio.server(interceptors=[
            self.credentials, MessageCaps(self._rpcs, self._names), MethodNames()], options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            # Without it a second server could bind the same port on Linux, silently.
            ("grpc.so_reuseport", 0),
        ])
        self._address = listen_address(settings.host, settings.grpc_port)
        try:
            self.port = self._server.add_insecure_port(self._address)
        except RuntimeError:
            self._server = None
            await self._fail(f"cannot listen for gRPC on {self._address} (port in use, or "
                             f"address not local)")
        self._start_task = asyncio.get_running_loop().create_task(self._start(),
                                                                  name="multihead-grpc-start")
        self._start_task.add_done_callback(self._log_start_failure)

    async def _fail(self, message: str) -> None:
        """Raises ServiceError(message), once TensorFlow's import is over.

        NOTE: `multihead serve` imports TensorFlow in a thread at start-up, with fd 2 captured
        to filter CUDA probe noise; an error raised meanwhile would exit the process before
        stderr is given back, and its one-line message would be lost.
        """
        await asyncio.get_running_loop().run_in_executor(
            None, import_tensorflow, self.service.settings.device)
        raise ServiceError(message)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        # NOTE: the TF Serving messages import TensorFlow; the trunk's quiet import goes first
        # (it is usually under way already, and this waits for it through its lock).
        await loop.run_in_executor(None, import_tensorflow, self.service.settings.device)
        registrations, names = await loop.run_in_executor(None, _registrations)
        self._names.update(names)
        assert self._server is not None
        for register in registrations:
            self.services += register(self._server, self._rpcs)
        await self._server.start()
        log.info("gRPC on %s (port %s): %s", self._address, self.port, ", ".join(self.services))

    def _log_start_failure(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the gRPC server on %s failed to start", self._address,
                      exc_info=task.exception())

    async def wait_started(self) -> None:
        """Returns once the server serves; raises what made its start fail."""
        assert self._start_task is not None, "open() first"
        await asyncio.shield(self._start_task)

    def begin_stop(self) -> None:
        """Stops accepting calls now; the calls in flight get `request_timeout_s` to finish."""
        if self._server is not None and self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(
                self._stop(), name="multihead-grpc-stop")

    async def _stop(self) -> None:
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._start_task
        assert self._server is not None
        # NOTE: the server keeps accepting connections meanwhile, so that a new call gets a
        # clear UNAVAILABLE (shutting_down) rather than a reset connection; grpc's own graceful
        # stop would cancel calls arriving during its grace instead.
        drained = await self._rpcs.drain(self.service.settings.request_timeout_s)
        if not drained:
            log.warning("gRPC: %d call(s) still running after %.0f s; cancelling them",
                        self._rpcs.in_flight, self.service.settings.request_timeout_s)
        await self._server.stop(grace=None)
        log.info("gRPC on %s stopped", self._address)

    async def close(self) -> None:
        """`begin_stop()` if not begun, and waits until the calls in flight are done."""
        self.begin_stop()
        if self._stop_task is not None:
            await self._stop_task
