"""``grpc_api``: the edge's gRPC front (:class:`edge_agent.grpc_api.EdgeGrpcServer`) against its floor, and against
the REST front on large payloads (issue 31), each pair measured in the same run, interleaved in rounds.

* **1 KB latency**: a V2 ``ModelInfer`` (one FP32 tensor in ``raw_input_contents``) through the edge's gRPC front over
  an echoing data plane (``bench.floors.EchoDataPlane``, the one the ``http_api`` scenario serves: the front is
  measured, not a model) vs a bare grpclib server that decodes the same ``ModelInferRequest`` and encodes a
  ``ModelInferResponse`` of the same tensor, with no mesh logic. One grpclib client (``Channel`` and
  ``UnaryUnaryMethod`` with the project's messages) calls both; the system side also turns the array into the
  request and the reply back into an array (the codec is part of the system, as in ``http_api``).
* **4 MB**: the same data plane behind both fronts at once (as an agent runs them): ``ModelInfer`` over gRPC vs
  ``POST /v2/models/echo/infer`` with the binary tensor extension (``Inference-Header-Content-Length``), each
  client encoding the array and decoding the reply; latency one in flight, throughput a closed loop.

Both plain and mutual TLS (the edge with ``EdgeTls``, the tenant from the client certificate, as an agent runs it;
the bare echo requiring client certificates of the same CA), as ``http_api`` measures REST.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.const import Cardinality, Handler
from grpclib.encoding.proto import ProtoCodec
from grpclib.server import Server, Stream

from bench.common import (
    Panel,
    RunContext,
    closed_loop_rate,
    interleave,
    plot_panels,
    ratio,
    run_standalone,
    summarize,
    target,
    write_result,
)
from bench.floors import CONCURRENCY, MTLS_TENANT, EchoDataPlane, mutual_tls, payload
from edge_agent.grpc_api import EdgeGrpcServer
from edge_agent.http_api import EdgeHttpServer
from edge_agent.mtls import EdgeTls
from mesh.pki.local import LocalPki
from mesh.v2 import codec
from mesh.v2 import grpc_messages as oip
from mesh.v2.body import HEADER_LENGTH

__all__ = ["LARGE", "SMALL", "BareEcho", "run_grpc_api"]

SMALL, LARGE = 1024, 4 << 20
TASK = "echo"
METHOD = f"/{oip.PACKAGE}.{oip.SERVICE}/ModelInfer"
SLO = {"latency_ms": 10_000.0}
Call = Callable[[], Awaitable[object]]
ArrayCall = Callable[[], Awaitable[np.ndarray]]


class BareEcho:
    """The floor: a grpclib ``ModelInfer`` that decodes the request and answers its tensor as output ``y``, with
    ``parameters`` (set to those of the edge's reply, its answer is a message of the same fields and size)."""

    def __init__(self) -> None:
        self.parameters: list[oip.ParametersEntry] = []

    def __mapping__(self) -> dict[str, Handler]:
        return {METHOD: Handler(self.infer, Cardinality.UNARY_UNARY, oip.ModelInferRequest, oip.ModelInferResponse)}

    async def infer(self, stream: Stream[Any, Any]) -> None:
        req = await stream.recv_message()
        assert req is not None
        outs = [oip.InferOutputTensor(name="y", datatype=t.datatype, shape=t.shape) for t in req.inputs]
        await stream.send_message(oip.ModelInferResponse(model_name=req.model_name, id=req.id, outputs=outs,
                                                         parameters=self.parameters,
                                                         raw_output_contents=req.raw_input_contents))


@contextlib.asynccontextmanager
async def _bare_echo(tls: ssl.SSLContext | None, echo: BareEcho) -> AsyncIterator[int]:
    # proto given: grpclib sets TCP_NODELAY only on sockets that say IPPROTO_TCP (0 here stalled each call 40 ms)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = Server([echo], codec=ProtoCodec())
    await server.start(sock=sock, ssl=tls)
    try:
        yield port
    finally:
        server.close()
        await server.wait_closed()


def _request(arr: np.ndarray) -> oip.ModelInferRequest:
    return oip.ModelInferRequest(
        model_name=TASK, inputs=[oip.InferInputTensor(name="x", datatype="FP32", shape=list(arr.shape))],
        raw_input_contents=[arr.tobytes()], parameters=oip.entries(SLO))


def _array(resp: oip.ModelInferResponse) -> np.ndarray:
    t = resp.outputs[0]
    return np.frombuffer(resp.raw_output_contents[0], dtype=np.float32).reshape(t.shape)


def _infer(channel: Channel) -> UnaryUnaryMethod[oip.ModelInferRequest, oip.ModelInferResponse]:
    return UnaryUnaryMethod(channel, METHOD, oip.ModelInferRequest, oip.ModelInferResponse)


def _grpc_system(method: UnaryUnaryMethod[oip.ModelInferRequest, oip.ModelInferResponse],
                 arr: np.ndarray) -> ArrayCall:
    async def call() -> np.ndarray:
        return _array(await method(_request(arr)))
    return call


def _rest_system(session: aiohttp.ClientSession, url: str, arr: np.ndarray) -> ArrayCall:
    async def call() -> np.ndarray:
        body, hlen = codec.encode_infer_request({"x": arr}, SLO)
        assert hlen is not None
        async with session.post(url, data=body, headers={"Content-Type": "application/octet-stream",
                                                         HEADER_LENGTH: str(hlen)}) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"POST {url}: HTTP {resp.status}: {data[:200]!r}")
            hl = resp.headers.get(HEADER_LENGTH)
        out: np.ndarray = codec.decode_infer_response(data, int(hl) if hl else None).outputs["y"]
        return out
    return call


async def _small_row(case: str, calls: dict[str, Call], ctx: RunContext) -> dict[str, Any]:
    """1 KB latency, one in flight: the edge (``system``) against the bare echo answering the same message
    (``floor``), and the bare echo answering the tensor alone (``bare``), interleaved."""
    samples = await interleave(calls, rounds=ctx.pick(10, 20), per_round=ctx.pick(100, 200))
    f, b, s = (summarize(samples[k]) for k in ("floor", "bare", "system"))
    return {"case": case, "metric": "latency", "unit": "µs", "floor": f["median_us"], "system": s["median_us"],
            "ratio": ratio(s["median_us"], f["median_us"]), "floor_p99": f["p99_us"], "system_p99": s["p99_us"],
            "bare_no_params": b["median_us"], "ratio_to_bare": ratio(s["median_us"], b["median_us"]), "n": s["n"]}


async def _large_rows(case: str, calls: dict[str, Call], floor: Call, nbytes: int,
                      ctx: RunContext) -> list[dict[str, Any]]:
    """4 MB over REST and gRPC: latency one in flight (and the bare grpclib echo's, ``floor``, to tell the front's
    share from grpclib's), then requests/s and MB/s at ``CONCURRENCY``."""
    samples = await interleave({**calls, "floor": floor}, rounds=ctx.pick(3, 6), per_round=ctx.pick(6, 15),
                               warmup=3, time_cap_s=20.0)
    r, g, f = (summarize(samples[k]) for k in ("rest", "grpc", "floor"))
    rows: list[dict[str, Any]] = [{
        "case": case, "metric": "latency", "unit": "µs", "floor": f["median_us"], "rest": r["median_us"],
        "grpc": g["median_us"], "grpc/rest": ratio(g["median_us"], r["median_us"]), "rest_p99": r["p99_us"],
        "grpc_p99": g["p99_us"], "n": g["n"]}]
    total, rounds = ctx.pick(96, 240), ctx.pick(3, 4)
    rates: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(rounds):
        for label in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
            rates[label].append(await closed_loop_rate(calls[label], total=max(1, total // rounds),
                                                       concurrency=CONCURRENCY, time_cap_s=15.0))
    rest, grpc = float(np.median(rates["rest"])), float(np.median(rates["grpc"]))
    mb = nbytes / 1e6
    rows.append({"case": case, "metric": f"throughput (c={CONCURRENCY})", "unit": "req/s", "rest": round(rest, 1),
                 "grpc": round(grpc, 1), "grpc/rest": ratio(grpc, rest), "rest_MB_s": round(rest * mb, 1),
                 "grpc_MB_s": round(grpc * mb, 1), "n": total})
    return rows


def _grpc_client_context(ca: Path, cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    return ctx


async def run_grpc_api(ctx: RunContext) -> Path:
    lat_rows: list[dict[str, Any]] = []
    big_rows: list[dict[str, Any]] = []
    dp = EchoDataPlane(TASK)
    small, large = payload(SMALL), payload(LARGE)
    with tempfile.TemporaryDirectory(prefix="tiermesh-bench-grpc-") as tmp:
        floor_mtls, edge_mtls, rest_client = mutual_tls(Path(tmp))
        floor_mtls.set_alpn_protocols(["h2"])
        paths = LocalPki.under(Path(tmp)).paths
        grpc_client = _grpc_client_context(paths.ca_cert, paths.cert(MTLS_TENANT), paths.key(MTLS_TENANT))
        cases: list[tuple[str, ssl.SSLContext | None, EdgeTls | None, ssl.SSLContext | None,
                          ssl.SSLContext | None]] = [
            ("plain", None, None, None, None), ("mtls", floor_mtls, edge_mtls, rest_client, grpc_client)]
        for scheme, ftls, etls, rtls, gtls in cases:
            # the REST front first: with TLS it starts the credentials both fronts share, as in an agent
            echo, bare = BareEcho(), BareEcho()
            async with _bare_echo(ftls, echo) as floor_port, _bare_echo(ftls, bare) as bare_port, \
                    EdgeHttpServer(dp, "127.0.0.1", tls=etls) as rest, \
                    EdgeGrpcServer(dp, "127.0.0.1", tls=etls) as grpc, \
                    aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16, ssl=rtls if rtls else False),
                                          timeout=aiohttp.ClientTimeout(total=60)) as session:
                channels = [Channel("127.0.0.1", port, ssl=gtls, codec=ProtoCodec())
                            for port in (floor_port, bare_port, grpc.port)]
                try:
                    floor_m, bare_m, edge_m = (_infer(ch) for ch in channels)
                    # the floor answers the fields of the edge's reply (where / which / why), so both send a
                    # message of the same size; "bare" answers the tensor alone
                    echo.parameters = (await edge_m(_request(small))).parameters
                    for arr in (small, large):  # the fronts echo these very bytes
                        if not (np.array_equal(await _grpc_system(edge_m, arr)(), arr)
                                and np.array_equal(await _rest_system(session, f"{rest.url}/v2/models/{TASK}/infer",
                                                                      arr)(), arr)):
                            raise AssertionError("an edge front returned different bytes")
                    lat_rows.append(await _small_row(f"{scheme} 1 KB", {
                        "floor": _grpc_system(floor_m, small), "bare": _grpc_system(bare_m, small),
                        "system": _grpc_system(edge_m, small)}, ctx))
                    big_rows += await _large_rows(f"{scheme} 4 MB", {
                        "rest": _rest_system(session, f"{rest.url}/v2/models/{TASK}/infer", large),
                        "grpc": _grpc_system(edge_m, large)}, _grpc_system(floor_m, large), LARGE, ctx)
                finally:
                    for ch in channels:
                        ch.close()
    targets = [target(f"edge gRPC front / bare grpclib echo, median latency, {r['case']}", r["ratio"], 1.3, unit="x")
               for r in lat_rows]
    _plot(ctx, lat_rows, big_rows)
    wins = ", ".join(f"{r['case']}: {'gRPC' if r['grpc/rest'] > 1 else 'REST'} "
                     f"(gRPC at {r['grpc/rest']:.2f}x REST's req/s)" for r in big_rows if r["unit"] == "req/s")
    return write_result(ctx, "grpc_api", lat_rows + big_rows, targets, notes=(
        "1 KB rows: system = one grpclib client (Channel + UnaryUnaryMethod, the project's messages): array -> "
        "ModelInferRequest (raw_input_contents), ModelInfer on EdgeGrpcServer over bench.floors.EchoDataPlane, "
        "reply -> array; floor = the same client and call to a bare grpclib server that decodes the request and "
        "answers a ModelInferResponse of the same tensor and the same parameters (those of the edge's reply: the "
        "same fields and size); bare_no_params = the same bare server answering the tensor alone (ratio_to_bare: "
        "what the reply's where / which / why costs besides the front). 4 MB rows: the same data plane behind "
        "EdgeHttpServer and EdgeGrpcServer at once; rest = aiohttp POST /v2/models/echo/infer with the binary tensor "
        "extension (encode + decode on the client), grpc = the system call above, floor = the bare grpclib echo's "
        "(same reply fields); grpc/rest > 1 means gRPC is slower in latency and faster in throughput. MB/s counts "
        "the request tensor (the reply carries as many). mtls: a mesh CA (LocalPki), EdgeTls on both fronts (tenant "
        "from the certificate), the bare echo with "
        f"CERT_REQUIRED against the same CA. The faster front at 4 MB (throughput): {wins}."))


def _plot(ctx: RunContext, lat: list[dict[str, Any]], big: list[dict[str, Any]]) -> None:
    tput = [r for r in big if r["unit"] == "req/s"]
    plot_panels(ctx.results_dir / "grpc_api.png", "Edge gRPC front vs bare grpclib echo, and vs REST at 4 MB", [
        Panel("1 KB median latency (one in flight)", "µs", [r["case"] for r in lat],
              {"bare echo": [r["floor"] for r in lat], "gRPC front": [r["system"] for r in lat]},
              bar_text={"gRPC front": [f"{r['ratio']:.2f}x" for r in lat]}),
        Panel(f"4 MB throughput at concurrency {CONCURRENCY}", "MB/s", [r["case"] for r in tput],
              {"REST binary": [r["rest_MB_s"] for r in tput], "gRPC": [r["grpc_MB_s"] for r in tput]},
              bar_text={"gRPC": [f"{r['grpc/rest']:.2f}x" for r in tput]})])


if __name__ == "__main__":
    import sys

    run_standalone("grpc_api", "--quick" in sys.argv[1:], run_grpc_api)
