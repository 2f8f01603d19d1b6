"""Admission under a flood: how fast a full ``llmlab serve`` says 429, and whether a small
request still gets through.

The server (``llmlab serve``, the built-in model unless ``--model``) runs as a user runs
it, in a child process, with ``--max-queued-sequences BOUND``. Then, from raw asyncio
sockets (a connection each, so nothing here pools or queues requests):

1. **busy**: ``BOUND`` streamed requests that generate ``--busy-tokens`` tokens each fill
   the server (their streams are read to the end in the background);
2. **flood**: ``--connections`` more connections send a completion each, all at once, and
   stay open after their answer; the time from a request's last byte to its status line
   is its latency;
3. **probe**: with all of them still open, ``--probes`` requests one after another, each
   on a fresh connection: the latency of a 429 while the server is flooded and busy;
4. **work flood**: ``--n-requests`` requests with ``n=--n`` (as many sequences each,
   ``--work-tokens`` tokens), then one small request, retried after each 429's
   ``Retry-After`` as a client does: its time to finish. ``--work-only`` runs just this
   phase; ``--scheduling-policy`` is passed to the server.

Prints the latency percentiles of each phase and the status counts. Run:

    python -m benchmarks.admission_flood                    # 5,000 connections, bound 4096
    python -m benchmarks.admission_flood --bound 64 --connections 2000 --busy-tokens 400
    python -m benchmarks.admission_flood --work-only --work-tokens 32 [--scheduling-policy sjf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

READ_LIMIT = 2**20


def request_bytes(path: str, body: dict, host: str = "127.0.0.1") -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    return head.encode() + data


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers of one HTTP/1.1 response."""
    status = int((await reader.readline()).split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            return status, headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    chunks = []  # chunked transfer encoding (a stream)
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return b"".join(chunks)
        chunks.append(await reader.readexactly(size))
        await reader.readline()


async def one_request(host: str, port: int, payload: bytes, *, keep: list | None = None,
                      read: bool = True) -> tuple[int, float, dict[str, str], bytes]:
    """(status, seconds from the last byte sent to the status line, headers, body). With
    ``keep``, the connection stays open (appended to it) instead of being closed."""
    reader, writer = await asyncio.open_connection(host, port, limit=READ_LIMIT)
    try:
        writer.write(payload)
        await writer.drain()
        start = time.perf_counter()
        status, headers = await read_head(reader)
        latency = time.perf_counter() - start
        body = await read_body(reader, headers) if read else b""
    except BaseException:
        writer.close()  # cancelled (a client that leaves) or failed: the server sees it go
        raise
    if keep is not None:
        keep.append(writer)
    else:
        writer.close()
    return status, latency, headers, body


async def flood(host: str, port: int, payload: bytes, connections: int, keep: list,
                connect_batch: int = 500):
    """``connections`` requests at once (connected in batches of ``connect_batch``, under
    the listen backlog), each left open: ``[(status, latency_s, headers, body)]``."""
    opened = []
    for first in range(0, connections, connect_batch):
        batch = await asyncio.gather(*(
            asyncio.open_connection(host, port, limit=READ_LIMIT)
            for _ in range(min(connect_batch, connections - first))))
        opened.extend(batch)

    async def send(reader, writer):
        writer.write(payload)
        await writer.drain()
        start = time.perf_counter()
        status, headers = await read_head(reader)
        latency = time.perf_counter() - start
        body = await read_body(reader, headers)
        keep.append(writer)
        return status, latency, headers, body

    return await asyncio.gather(*(send(r, w) for r, w in opened))


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    p = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return f"p50 {p(0.5):.1f} ms, p90 {p(0.9):.1f} ms, p99 {p(0.99):.1f} ms, max {ordered[-1] * 1e3:.1f} ms"


async def busy_streams(host: str, port: int, count: int, tokens: int, model: str) -> list:
    """``count`` streamed requests generating ``tokens`` each, read in the background."""
    payload = request_bytes("/v1/completions", {
        "model": model, "prompt": "Once upon a time", "max_tokens": tokens,
        "ignore_eos": True, "stream": True})

    async def drain():
        return await one_request(host, port, payload)

    return [asyncio.create_task(drain()) for _ in range(count)]


async def wait_full(host: str, port: int, timeout_s: float = 120.0) -> None:
    """Until ``/health`` says the server is at capacity."""
    deadline = time.monotonic() + timeout_s
    get = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    while time.monotonic() < deadline:
        status, _, _, body = await one_request(host, port, get)
        if status == 503 and b"capacity" in body:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the server never filled up")


async def run(host: str, port: int, *, bound: int, connections: int, probes: int,
              busy_tokens: int, n: int, n_requests: int, model: str, work_tokens: int = 8,
              work_only: bool = False) -> dict:
    small = {"model": model, "prompt": "Once upon a time", "max_tokens": 4}
    results: dict = {}
    if not work_only:
        await _flood_phases(host, port, bound, connections, probes, busy_tokens, model, small,
                            results)
    # The work flood: requests of n sequences each, then a small one.
    big = {**small, "n": n, "max_tokens": work_tokens, "ignore_eos": True, "temperature": 1.0}
    payload = request_bytes("/v1/completions", big)
    work = [asyncio.create_task(one_request(host, port, payload)) for _ in range(n_requests)]
    await asyncio.sleep(1.0)
    start = time.perf_counter()
    newcomer = await _until_admitted(host, port, {**small, "max_tokens": 1})
    results["newcomer_s"] = time.perf_counter() - start
    results["newcomer"] = newcomer
    results["work"] = await asyncio.gather(*work)
    return results


async def _flood_phases(host, port, bound, connections, probes, busy_tokens, model, small,
                        results) -> None:
    busy = await busy_streams(host, port, bound, busy_tokens, model)
    await wait_full(host, port)
    kept: list = []
    answers = await flood(host, port, request_bytes("/v1/completions", small), connections,
                          kept)
    results["flood"] = answers
    results["probe"] = [
        await one_request(host, port, request_bytes("/v1/completions", small))
        for _ in range(probes)]
    for writer in kept:
        writer.close()
    # The busy streams have served their purpose: disconnecting aborts them (as a client
    # that goes away does), which the server must also survive.
    for task in busy:
        task.cancel()
    results["busy"] = await asyncio.gather(*busy, return_exceptions=True)


async def _until_admitted(host: str, port: int, body: dict):
    """A small request, retried after each 429's Retry-After (as a client does)."""
    while True:
        answer = await one_request(host, port, request_bytes("/v1/completions", body))
        if answer[0] != 429:
            return answer
        await asyncio.sleep(float(answer[2].get("retry-after", "1")))


def report(results: dict) -> str:
    lines = []
    for phase in ("flood", "probe"):
        if phase not in results:
            continue
        answers = results[phase]
        counts: dict[int, int] = {}
        for status, *_ in answers:
            counts[status] = counts.get(status, 0) + 1
        refused = [a[1] for a in answers if a[0] == 429]
        lines.append(f"{phase}: {len(answers)} requests, statuses {counts}; 429 latency "
                     f"{percentiles(refused)}")
    work = results["work"]
    counts = {}
    for status, *_ in work:
        counts[status] = counts.get(status, 0) + 1
    refused = [a[1] for a in work if a[0] == 429]
    lines.append(f"work flood: statuses {counts}; 429 latency {percentiles(refused)}")
    lines.append("the small request after it: status "
                 f"{results['newcomer'][0]} in {results['newcomer_s']:.2f} s "
                 "(429s retried after Retry-After)")
    busy = results.get("busy", ())
    if busy:
        finished = sum(1 for a in busy if isinstance(a, tuple) and a[0] == 200)
        lines.append(f"busy streams: {len(busy)} ({finished} finished, the rest "
                     "disconnected after the probes)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--bound", type=int, default=4096, help="--max-queued-sequences")
    parser.add_argument("--connections", type=int, default=5000)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--busy-tokens", type=int, default=400)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--n-requests", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--work-tokens", type=int, default=8,
                        help="max_tokens of the work flood's requests")
    parser.add_argument("--work-only", action="store_true", help="only the work flood")
    parser.add_argument("--scheduling-policy", default=None)
    args = parser.parse_args()

    import resource

    from tests.server.test_serve_cli import start_server

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    flags = ["--max-queued-sequences", str(args.bound), "--max-num-seqs",
             str(args.max_num_seqs), "--served-model-name", "flood"]
    if args.scheduling_policy:
        flags += ["--scheduling-policy", args.scheduling_policy]
    proc, url = start_server(([args.model] if args.model else []) + flags)
    try:
        host, port = url.removeprefix("http://").split(":")
        results = asyncio.run(run(host, int(port), bound=args.bound,
                                  connections=args.connections, probes=args.probes,
                                  busy_tokens=args.busy_tokens, n=args.n,
                                  n_requests=args.n_requests, model="flood",
                                  work_tokens=args.work_tokens, work_only=args.work_only))
        print(report(results))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
