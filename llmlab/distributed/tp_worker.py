"""One tensor-parallel rank's side: the process groups every rank joins, the batch
broadcast, and :func:`worker_main`, the loop of ranks 1..N-1.

Rank 0 (:mod:`llmlab.distributed.tp_executor`) starts the workers, as processes or as Ray
actors (:mod:`llmlab.distributed.ray_workers`); both launchers run :func:`worker_main`,
so it lives here, below them both.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

import attrs
import torch
import torch.distributed as dist

from llmlab.distributed.parallel_state import TensorParallel

logger = logging.getLogger(__name__)

# A worker waits for the next batch as long as the engine is idle; death is noticed by
# closed connections, not by this timeout.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


def collective_backend(config: Any, device: torch.device) -> str:
    """``config.collective_backend`` resolved: NCCL on CUDA, gloo elsewhere."""
    if config.collective_backend != "auto":
        return config.collective_backend
    return "nccl" if device.type == "cuda" else "gloo"


def process_groups(store, rank: int, size: int, backend: str, timeout: datetime.timedelta,
                   device: torch.device):
    """The two groups of one tensor-parallel engine: the model's and the batches'."""
    data_store = dist.PrefixStore("data/", store)
    if backend == "nccl":
        torch.cuda.set_device(device)
        data = dist.ProcessGroupNCCL(data_store, rank, size)
    else:
        data = dist.ProcessGroupGloo(data_store, rank, size, timeout)
    control = dist.ProcessGroupGloo(
        dist.PrefixStore("control/", store), rank, size, _CONTROL_TIMEOUT
    )
    return data, control


def broadcast_object(group, obj: Any = None, *, send: bool) -> Any:
    """Pickle ``obj`` on rank 0 and broadcast it: its length, then its bytes."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if send:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        length = torch.tensor([len(payload)], dtype=torch.int64)
        group.broadcast([length], options).wait()
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        group.broadcast([data], options).wait()
        return obj
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast([length], options).wait()
    data = torch.empty(int(length.item()), dtype=torch.uint8)
    group.broadcast([data], options).wait()
    return pickle.loads(data.numpy().tobytes())


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started this worker is gone (never an orphan)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def worker_main(rank: int, size: int, host: str, port: int, plan: Any,
                parent_pid: int | None = None, cuda_index: int | None = None) -> None:
    """A worker rank: join the group, build this rank's part of the engine, then execute
    every batch rank 0 broadcasts until it broadcasts None. Any failure ends the process
    (rank 0 notices its connections closing).

    On CUDA the rank runs on ``cuda:<cuda_index>``; None means ``cuda:<rank>`` (one
    machine's devices in rank order). A Ray actor passes 0: it sees only its own device.
    """
    # Ctrl-C reaches the whole process group; rank 0 decides when workers stop.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    from llmlab.runner.build import build_rank

    cfg = plan.config
    timeout = datetime.timedelta(seconds=cfg.distributed_timeout_s)
    device = plan.device
    if device.type == "cuda":
        device = torch.device("cuda", rank if cuda_index is None else cuda_index)
        plan = attrs.evolve(plan, device=device)
    store = dist.TCPStore(host, port, size, False, timeout=timeout)
    store.set(f"ready/{rank}", "1")
    data, control = process_groups(
        store, rank, size, collective_backend(cfg, device), timeout, device
    )
    try:
        runner = build_rank(plan, TensorParallel(rank, size, data)).runner
        while True:
            batch = broadcast_object(control, send=False)
            if batch is None:
                break
            runner.execute(batch)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
