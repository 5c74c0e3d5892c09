"""Overhead against the floors, each floor measured in the same run, interleaved in rounds.

* ``mesh_hop``: the ZeroMQ hop between sites, in :mod:`bench.floor_hop`.
* ``http_api``: a V2 binary request to the edge HTTP API over an echoing data plane (codec both
  ways, HTTP and HTTPS) vs a bare aiohttp echo server posting the same body; and ``mtls``: the edge API
  with mutual TLS as an agent runs it (``EdgeTls``: the mesh CA, a site certificate, the tenant taken from
  the client certificate, revocation checked per connection) vs a bare aiohttp HTTPS echo that also
  requires client certificates (``CERT_REQUIRED``) from the same CA.
* ``sdk_local``: ``mesh.AsyncClient`` -> ``EdgeHttpServer`` -> ``Batcher`` -> ONNX Runtime on a real
  digits model vs ORT ``session.run`` plus the bare HTTP echo of the same body.

Latency is one request in flight; throughput is a closed loop at a fixed concurrency, bounded in
count and time. Both side and floor share one event loop, as they would in an agent.
"""

from __future__ import annotations

import contextlib
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

from bench.common import (
    Panel,
    RunContext,
    closed_loop_rate,
    compute_model,
    digits_model,
    digits_rows,
    interleave,
    plot_panels,
    ratio,
    summarize,
    target,
    write_result,
)
from edge_agent.batching import Batcher
from edge_agent.http_api import EdgeHttpServer, make_app
from edge_agent.mtls import EdgeTls
from mesh.client import AsyncClient
from mesh.errors import UnknownTask
from mesh.pki.identity import Identity
from mesh.pki.local import LocalPki
from mesh.types import InferRequest, InferResponse, TaskSignature, TensorSpec, Timing
from mesh.v2 import codec as codec
from mesh.v2.body import HEADER_LENGTH
from variant_store.runtimes import open_runtime

__all__ = ["CONCURRENCY", "PAYLOADS", "EchoDataPlane", "ModelDataPlane", "echo_handler", "latency_row",
           "mutual_tls", "payload", "plot_rows", "run_http_api", "run_sdk_local", "self_signed", "throughput_row"]

PAYLOADS = {"1 KB": 1024, "100 KB": 100 * 1024}
CONCURRENCY = 8
Call = Callable[[], Awaitable[object]]


def payload(nbytes: int) -> np.ndarray:
    return np.random.default_rng(nbytes).random((1, nbytes // 4), dtype=np.float32)


async def echo_handler(req: InferRequest) -> InferResponse:
    return InferResponse(request_id=req.request_id, outputs={"y": req.inputs["x"]}, site="bench",
                         variant="echo", accuracy=1.0, reason="local_ok", tenant=req.tenant)


# ------------------------------------------------------------------ http


class _OneTaskPlane:
    """What both bench data planes share: one task, always ready."""

    task: str
    signature: TaskSignature

    def task_signature(self, task: str) -> TaskSignature:
        if task != self.task:
            raise UnknownTask(f"no task {task!r}")
        return self.signature

    def tasks(self) -> list[str]:
        return [self.task]

    def ready(self) -> bool:
        return True


class EchoDataPlane(_OneTaskPlane):
    """A data plane with no model: it answers every query with its own input (output ``y``)."""

    site = "bench"

    def __init__(self, task: str = "echo") -> None:
        self.task = task
        spec = (-1, -1)
        self.signature = TaskSignature(task, (TensorSpec("x", "float32", spec),), (TensorSpec("y", "float32", spec),))

    async def infer(self, req: InferRequest) -> InferResponse:
        return await echo_handler(req)



def self_signed(workdir: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS contexts around a fresh EC P-256 certificate for 127.0.0.1."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tiermesh-bench")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem, key_pem = workdir / "cert.pem", workdir / "key.pem"
    cert_pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_pem, key_pem)
    client = ssl.create_default_context(cafile=str(cert_pem))
    return server, client


MTLS_SITE, MTLS_TENANT = Identity("site", "bench-edge"), Identity("tenant", "bench")


def mutual_tls(workdir: Path) -> tuple[ssl.SSLContext, EdgeTls, ssl.SSLContext]:
    """A mesh CA under ``workdir`` with a site and a tenant certificate: (the bare floor's server context,
    requiring client certificates from that CA; the edge's ``EdgeTls``; the tenant's client context)."""
    pki = LocalPki.under(workdir)
    pki.init()
    pki.issue(MTLS_SITE, addresses=["127.0.0.1"])
    pki.issue(MTLS_TENANT)
    paths = pki.paths
    floor = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(paths.ca_cert))
    floor.verify_mode = ssl.CERT_REQUIRED
    floor.load_cert_chain(paths.cert(MTLS_SITE), paths.key(MTLS_SITE))
    client = ssl.create_default_context(cafile=str(paths.ca_cert))
    client.load_cert_chain(paths.cert(MTLS_TENANT), paths.key(MTLS_TENANT))
    return floor, EdgeTls(paths, MTLS_SITE.name), client


@contextlib.asynccontextmanager
async def _site(app: web.Application, tls: ssl.SSLContext | None) -> AsyncIterator[str]:
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
        await site.start()
        port = int(runner.addresses[0][1])
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _bare_echo_app() -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read(), content_type="application/octet-stream")

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/echo", echo)
    return app


@contextlib.asynccontextmanager
async def _edge(dp: Any, tls: ssl.SSLContext | EdgeTls | None) -> AsyncIterator[str]:
    """The edge HTTP API: ``EdgeHttpServer`` for HTTP and mutual TLS (``EdgeTls``, as an agent runs it);
    for plain HTTPS its app on our own TLS site (one-way TLS: the tenant comes from the header)."""
    if tls is None or isinstance(tls, EdgeTls):
        async with EdgeHttpServer(dp, "127.0.0.1", tls=tls) as srv:
            yield srv.url
    else:
        async with _site(make_app(dp), tls) as url:
            yield url


def _session(tls: ssl.SSLContext | None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16, ssl=tls if tls else False),
                                 timeout=aiohttp.ClientTimeout(total=30))


def _post(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> Call:
    async def call() -> bytes:
        async with session.post(url, data=body, headers=headers) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"POST {url}: HTTP {resp.status}: {data[:200]!r}")
            return data
    return call


def _v2_body(inputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    body, hlen = codec.encode_infer_request(inputs, {"latency_ms": 10_000.0})
    assert hlen is not None
    return body, {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(hlen)}


async def run_http_api(ctx: RunContext) -> Path:
    rounds, per_round = ctx.pick(8, 20), ctx.pick(80, 150)
    tp_total, tp_rounds = ctx.pick(600, 3000), ctx.pick(3, 5)
    rows: list[dict[str, Any]] = []
    dp = EchoDataPlane()
    with tempfile.TemporaryDirectory(prefix="tiermesh-bench-") as tmp:
        server_tls, client_tls = self_signed(Path(tmp))
        floor_mtls, edge_mtls, client_mtls = mutual_tls(Path(tmp) / "mtls")
        cases: list[tuple[str, ssl.SSLContext | None, ssl.SSLContext | EdgeTls | None, ssl.SSLContext | None,
                          dict[str, int]]] = [
            ("http", None, None, None, PAYLOADS), ("https", server_tls, server_tls, client_tls, PAYLOADS),
            ("mtls", floor_mtls, edge_mtls, client_mtls, {"1 KB": PAYLOADS["1 KB"]})]
        for scheme, ftls, etls, ctls, payloads in cases:
            async with _site(_bare_echo_app(), ftls) as floor_url, _edge(dp, etls) as edge_url, \
                    _session(ctls) as session:
                for label, nbytes in payloads.items():
                    arr = payload(nbytes)
                    body, headers = _v2_body({"x": arr})
                    floor = _post(session, f"{floor_url}/echo", body, headers)

                    async def system(arr: np.ndarray = arr,
                                     url: str = f"{edge_url}/v2/models/echo/infer") -> np.ndarray:
                        # the codec is part of the system: encode here, decode the reply
                        b, h = _v2_body({"x": arr})
                        async with session.post(url, data=b, headers=h) as resp:
                            data = await resp.read()
                            hl = resp.headers.get(HEADER_LENGTH)
                        return codec.decode_infer_response(data, int(hl) if hl else None).outputs["y"]

                    out = await system()
                    if not np.array_equal(out, arr):
                        raise AssertionError("edge HTTP echo returned different bytes")
                    name = f"{scheme} {label}"
                    rows.append(await latency_row(name, {"floor": floor, "system": system}, rounds, per_round))
                    rows.append(await throughput_row(name, {"floor": floor, "system": system},
                                                      tp_total, tp_rounds))
    targets = [target(f"edge HTTP API / bare aiohttp echo, median latency, {r['case']}", r["ratio"], 1.4,
                      unit="x") for r in rows if r["metric"] == "latency" and not r["case"].startswith("mtls")]
    targets += [target(f"mTLS edge API / bare aiohttp HTTPS echo with client certificates, median latency, "
                       f"{r['case'].removeprefix('mtls ')}", r["ratio"], 1.4, unit="x")
                for r in rows if r["metric"] == "latency" and r["case"].startswith("mtls")]
    plot_rows(ctx, "http_api", "Edge HTTP API (V2 binary) vs bare aiohttp echo", rows)
    return write_result(ctx, "http_api", rows, targets, notes=(
        "system = one aiohttp ClientSession: encode V2 binary request, POST /v2/models/echo/infer to the edge "
        "HTTP API over an echoing data plane, decode the reply; floor = POST of the same body to a bare aiohttp "
        "echo handler. HTTPS: self-signed EC P-256 certificate, TLS on both, 127.0.0.1. mtls: a mesh CA (LocalPki) "
        "with a site and a tenant certificate; the edge is EdgeHttpServer with EdgeTls (tenant from the client "
        "certificate, verdict cached per keep-alive connection); the floor is the bare echo with CERT_REQUIRED "
        "against the same CA; one client context presents the tenant certificate to both."))


# ------------------------------------------------------------------ sdk + model


class ModelDataPlane(_OneTaskPlane):
    """One site, one task, one real ONNX variant: ``open_runtime`` + ``Batcher``, as an agent hosts it."""

    site = "bench-edge"

    def __init__(self, model_path: Path, *, task: str = "digit-classification", max_batch: int = 1,
                 max_window_ms: float = 4.0,
                 compute_ms: Callable[[ModelDataPlane], Callable[[int], float]] | None = None) -> None:
        self.task = task
        self.runtime = open_runtime("onnx", model_path, providers=["CPUExecutionProvider"])
        self.runtime.load_sync()
        self.input_name = self.runtime.input_specs[0].name
        self.signature = TaskSignature(task, tuple(self.runtime.input_specs), tuple(self.runtime.output_specs))
        self.variant = f"{model_path.stem}.onnx.fp32"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-ort")
        # the batcher's profile: fitted on digit-like rows unless ``compute_ms`` fits one for this model
        profile = compute_ms(self) if compute_ms is not None else compute_model(self.runtime.infer_sync,
                                                                                self.input_name)
        self.batcher = Batcher(self.variant, self.runtime.infer_sync, executor=self._pool, compute_ms=profile,
                               max_batch=max_batch, max_window_ms=max_window_ms, site=self.site)

    def start(self) -> None:
        self.batcher.start()

    async def close(self) -> None:
        await self.batcher.stop()
        self._pool.shutdown(wait=True)
        self.runtime.unload_sync()

    async def infer(self, req: InferRequest) -> InferResponse:
        res = await self.batcher.submit(req.inputs, req.deadline)
        return InferResponse(request_id=req.request_id, outputs=res.outputs, site=self.site, variant=self.variant,
                             accuracy=0.95, reason="local_ok", tenant=req.tenant,
                             timing=Timing(queue_ms=res.queue_ms, compute_ms=res.compute_ms),
                             hops=[*req.hops, self.site])



async def run_sdk_local(ctx: RunContext) -> Path:
    import onnxruntime as ort

    rounds, per_round = ctx.pick(8, 20), ctx.pick(80, 150)
    tp_total, tp_rounds = ctx.pick(600, 3000), ctx.pick(3, 5)
    path, provenance = digits_model(["mlp-tiny.onnx"], (64,))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    rows: list[dict[str, Any]] = []
    cases = [("1 row", 1, 1), ("32 rows", 32, 1), ("1 row, window 4 ms", 1, 32)]
    for case, n, max_batch in cases:
        dp = ModelDataPlane(path, max_batch=max_batch)
        dp.start()
        x = digits_rows(n)
        body, headers = _v2_body({dp.input_name: x})
        try:
            async with _site(_bare_echo_app(), None) as floor_url, EdgeHttpServer(dp) as edge, \
                    _session(None) as session, AsyncClient(edge.url) as client:
                echo = _post(session, f"{floor_url}/echo", body, headers)

                async def direct(x: np.ndarray = x, name: str = dp.input_name) -> object:
                    return sess.run(None, {name: x})

                async def sdk(x: np.ndarray = x, client: AsyncClient = client) -> object:
                    return await client.infer("digit-classification", x, latency_ms=10_000.0)

                got = (await client.infer("digit-classification", x, latency_ms=10_000.0)).output()
                np.testing.assert_allclose(got, sess.run(None, {dp.input_name: x})[0], rtol=1e-4, atol=1e-5)
                calls: dict[str, Call] = {"ort": direct, "echo": echo, "system": sdk}
                samples = await interleave(calls, rounds=rounds, per_round=per_round)
                o, e, s = (summarize(samples[k]) for k in ("ort", "echo", "system"))
                floor_med, floor_p99 = o["median_us"] + e["median_us"], o["p99_us"] + e["p99_us"]
                rows.append({"case": case, "metric": "latency", "unit": "µs", "floor": round(floor_med, 1),
                             "system": s["median_us"], "ratio": ratio(s["median_us"], floor_med),
                             "floor_p99": round(floor_p99, 1), "system_p99": s["p99_us"], "n": s["n"],
                             "ort_median_us": o["median_us"], "echo_median_us": e["median_us"]})
                if max_batch == 1:
                    ort_rate = 1e6 / max(o["mean_us"], 1e-3)  # direct calls are serial on the loop
                    tp = await throughput_row(case, {"floor": echo, "system": sdk}, tp_total, tp_rounds)
                    # floor: every request costs one echo and one ORT run, so their times add
                    tp["floor"] = round(1.0 / (1.0 / tp["floor"] + 1.0 / ort_rate), 1)
                    tp["ratio"] = ratio(tp["floor"], tp["system"])
                    rows.append(tp)
        finally:
            await dp.close()
    targets = [target(f"SDK at the edge / (ORT run + bare HTTP echo), median latency, {r['case']}", r["ratio"],
                      1.5, unit="x") for r in rows if r["metric"] == "latency"]
    plot_rows(ctx, "sdk_local", "SDK served locally at an edge vs ORT session.run + bare HTTP echo", rows)
    return write_result(ctx, "sdk_local", rows, targets, notes=(
        f"model: {provenance}. system = mesh.AsyncClient.infer -> EdgeHttpServer -> data plane -> "
        "edge_agent.batching.Batcher (max_batch=1 unless the case says otherwise) -> onnxruntime (1 intra-op "
        "thread, executor); floor = median of InferenceSession.run called directly plus median of a bare aiohttp "
        "echo of the same V2 body. The 'window 4 ms' case (Batcher max_batch=32, max_window_ms=4, as "
        "edge_agent.host configures it) shows what a lone request pays while the batcher waits for companions."))


# ------------------------------------------------------------------ rows and plots


async def latency_row(case: str, calls: dict[str, Call], rounds: int, per_round: int) -> dict[str, Any]:
    samples = await interleave(calls, rounds=rounds, per_round=per_round)
    f, s = summarize(samples["floor"]), summarize(samples["system"])
    return {"case": case, "metric": "latency", "unit": "µs", "floor": f["median_us"], "system": s["median_us"],
            "ratio": ratio(s["median_us"], f["median_us"]), "floor_p99": f["p99_us"], "system_p99": s["p99_us"],
            "n": s["n"]}


async def throughput_row(case: str, calls: dict[str, Call], total: int, rounds: int) -> dict[str, Any]:
    """Requests/s at ``CONCURRENCY``; ``ratio`` is floor/system, so > 1 means slower, as for latency."""
    rates: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(rounds):
        for label in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
            rates[label].append(await closed_loop_rate(calls[label], total=max(1, total // rounds),
                                                       concurrency=CONCURRENCY, time_cap_s=20.0))
    f, s = float(np.median(rates["floor"])), float(np.median(rates["system"]))
    return {"case": case, "metric": f"throughput (c={CONCURRENCY})", "unit": "req/s", "floor": round(f, 1),
            "system": round(s, 1), "ratio": ratio(f, s), "n": total}


def plot_rows(ctx: RunContext, name: str, title: str, rows: list[dict[str, Any]]) -> None:
    lat = [r for r in rows if r["metric"] == "latency"]
    tput = [r for r in rows if r["metric"].startswith("throughput")]
    panels = [Panel("median latency (one in flight)", "µs", [r["case"] for r in lat],
                    {"floor": [r["floor"] for r in lat], "system": [r["system"] for r in lat]},
                    bar_text={"system": [f"{r['ratio']:.2f}x" for r in lat]})]
    if tput:
        panels.append(Panel(f"throughput at concurrency {CONCURRENCY}", "requests/s", [r["case"] for r in tput],
                            {"floor": [r["floor"] for r in tput], "system": [r["system"] for r in tput]}))
    plot_panels(ctx.results_dir / f"{name}.png", title, panels)
