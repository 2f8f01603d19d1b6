"""Serving overhead: ``llmlab serve`` (HTTP + SSE + AsyncEngine) vs offline ``LLM.generate``.

One model (the built-in story model unless ``--model``), one workload of random prompts.
The server runs under uvicorn in a thread of this process on 127.0.0.1. The load generator
is ``llmlab bench serve`` in a child process (``--client process``, the default), as a real
client is: it does not share the server's interpreter lock, though on a small machine it
still shares its cores. ``--client thread`` runs the same client in this process instead,
competing with the server and the engine for one GIL (how this benchmark measured before
issue 27's server work; kept to compare). The client sends every request at once (or at
``--request-rate``), streaming; the same prompts then go through ``LLM.generate`` on an
engine built with the same settings, in this process, after the server has stopped. Both
generate exactly ``--output-len`` tokens per request (``ignore_eos``), greedy.

Prints the bench table (mean TTFT and ITL among it; an ITL is the gap between two text
chunks, and a chunk holds several tokens when the server coalesced a stream's deltas, so
TPOT is the per-token figure) and ``server/offline`` output-token throughput: 1.0 would
mean HTTP, JSON, SSE and the async hand-off cost nothing. Run:

    python benchmarks/serve.py --num-prompts 200 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--client", choices=("process", "thread"), default="process",
                        help="the load generator in a child process (default) or in a "
                             "thread of this one, sharing the server's GIL")
    args = parser.parse_args()

    import uvicorn

    from llmlab import LLM, SamplingParams
    from llmlab.builtin import ensure_builtin_model
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.loadtest import BenchConfig, benchmark, format_report, sample_requests
    from llmlab.entrypoints.server.app import build_app

    model = args.model or str(ensure_builtin_model())
    settings = {"max_num_seqs": args.max_num_seqs, "seed": 0}
    engine = AsyncEngine.from_settings(model, **settings)
    app = build_app(engine, served_model_names=["bench"], freeze_gc=True)  # as `llmlab serve`
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    config = BenchConfig(
        base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", num_prompts=args.num_prompts,
        random_input_len=args.input_len, random_output_len=args.output_len,
        request_rate=args.request_rate, ignore_eos=True, disable_tqdm=True, seed=0,
    )
    requests = sample_requests(config)
    # warm-up: first calls allocate and compile nothing twice in the timed run
    asyncio.run(benchmark(config, requests[:4]))
    if args.client == "thread":
        result = asyncio.run(benchmark(config, requests))
        print(format_report(result))
    else:
        result = _bench_in_child(config, requests)
    server.should_exit = True
    thread.join(30)

    llm = LLM(model, **settings)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    prompts = [r.prompt for r in requests]
    llm.generate(prompts[:4], params, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    offline_s = time.perf_counter() - start
    offline_tps = sum(len(o.outputs[0].token_ids) for o in outs) / offline_s
    server_tps = result["output_throughput"]
    print(f"offline LLM.generate: {offline_s:.2f} s, {offline_tps:.1f} output tok/s")
    print(f"server (HTTP, streaming): {result['duration']:.2f} s, {server_tps:.1f} output tok/s")
    print(f"ratio server/offline output throughput: {server_tps / offline_tps:.2f}")


def _bench_in_child(config, requests) -> dict:
    """``llmlab bench serve`` in a child process on exactly ``requests`` (a JSON dataset of
    their prompts and lengths); prints its report and returns its saved result."""
    with tempfile.TemporaryDirectory() as tmp:
        dataset = os.path.join(tmp, "prompts.json")
        with open(dataset, "w", encoding="utf-8") as f:
            json.dump([{"prompt": r.prompt, "max_tokens": r.output_len} for r in requests], f)
        result_file = os.path.join(tmp, "result.json")
        command = [
            sys.executable, "-m", "llmlab", "bench", "serve", "--base-url", config.base_url,
            "--dataset-name", "json", "--dataset-path", dataset,
            "--num-prompts", str(len(requests)), "--request-rate", str(config.request_rate),
            "--seed", str(config.seed), "--temperature", str(config.temperature),
            "--ignore-eos", "--disable-tqdm", "--result-file", result_file,
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(command, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        # Includes the child's start-up (imports) and its /tokenize-free dataset read.
        print(f"client process CPU: {cpu_s:.2f} s")
        with open(result_file, encoding="utf-8") as f:
            return json.load(f)


if __name__ == "__main__":
    main()
