"""Recording a run to JSON Lines and reading it back.

A recording is one JSON object per line:

* line 1, the header: ``{"format": "llmlab.recording", "version": 1, "config": {...},
  "components": {...}, "snapshot": {...}}``: the engine's settings, its policies by name,
  and the :class:`~llmlab.observe.events.EngineSnapshot` the recording starts from;
* one line per :class:`~llmlab.observe.events.StepEvent`, ``{"step": {...}}``: request
  arrivals (prompt length, ``max_tokens``, priority, user) ride in ``arrived``;
* the footer, written by :meth:`Recorder.close`: ``{"end": {"steps": N}}``.

A path ending in ``.gz`` is written and read gzip-compressed.

A recording survives the process that writes it being killed: lines are flushed at least
once a second (a compressed file with a sync flush, so what was written decompresses
without the end of the stream), and :func:`load` reads every complete line of a file cut
anywhere, marking the recording ``complete=False, truncated=True``.

Fields at their default value are left out (an all-``None`` ``scheduled_users`` is the
common case), so a few thousand steps of a busy engine take a few MB. Floats are written
with ``repr`` precision, so a replay sees exactly the numbers the live run saw.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pathlib
import time
import zlib
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np

from llmlab.cache.kv_cache_manager import CacheSnapshot
from llmlab.observe.events import Arrival, EngineSnapshot, StepEvent
from llmlab.kvpress.schedule import Compaction
from llmlab.models.expert_load import ExpertLoad
from llmlab.scheduler.batch import Admission

FORMAT = "llmlab.recording"
VERSION = 1
_FLUSH_EVERY_S = 1.0

_EVENT_FIELDS = {f.name: f for f in attrs.fields(StepEvent)}
# Written even at their default value (the rest may be left out).
_REQUIRED = tuple(
    name
    for name, f in _EVENT_FIELDS.items()
    if f.default is attrs.NOTHING and name not in ("scheduled_users", "scheduled_priorities")
)
_PAIRS = ("scheduled", "finished", "sampled", "swapped_out", "swapped_in")
_BLOCKS = (
    "blocks_allocated",
    "blocks_freed",
    "blocks_prefix_hit",
    "blocks_evicted",
    "blocks_forked",
    "blocks_cached",
    "offload_blocks_evicted",
)
# (block, block) pairs between the device pool and the offload tier.
_BLOCK_PAIRS = ("blocks_spilled", "blocks_loaded")


# -- encoding ------------------------------------------------------------------------


def event_to_json(event: StepEvent) -> dict[str, Any]:
    """A ``StepEvent`` as a JSON-ready dict, defaults left out."""
    out: dict[str, Any] = {}
    for name, field in _EVENT_FIELDS.items():
        value = getattr(event, name)
        if name == "scheduled_users":
            if all(u is None for u in value):
                continue
        elif name == "scheduled_priorities":
            if not any(value):
                continue
        elif field.default is not attrs.NOTHING and value == field.default:
            continue
        if name in ("admitted", "arrived"):
            value = [attrs.asdict(item) for item in value]
        elif name == "kv_compacted":
            value = [_compaction_to_json(c) for c in value]
        elif name == "expert_load":
            value = {"layers": list(value.layers), "counts": [list(r) for r in value.counts],
                     "top_k": value.top_k}
        elif name == "block_tables":
            value = [[rid, list(table)] for rid, table in value]
        elif isinstance(value, tuple):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        out[name] = value
    return out


def event_from_json(data: dict[str, Any]) -> StepEvent:
    """The inverse of :func:`event_to_json`; raises ``ValueError`` naming a bad field
    (``TypeError`` when ``data`` is not a dict)."""
    if not isinstance(data, dict):
        raise TypeError(f"a step must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_EVENT_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        try:
            kwargs[name] = _decode_field(name, value)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"field {name!r}: {exc}") from None
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    n = len(kwargs.get("scheduled", ()))
    kwargs.setdefault("scheduled_users", (None,) * n)
    kwargs.setdefault("scheduled_priorities", (0,) * n)
    return StepEvent(**kwargs)


def _decode_field(name: str, value: Any) -> Any:
    if name in _PAIRS:
        return tuple((str(a), int(b) if name != "finished" else str(b)) for a, b in value)
    if name in _BLOCK_PAIRS:
        return tuple((int(a), int(b)) for a, b in _list(value))
    if name in _BLOCKS or name in ("num_computed", "scheduled_priorities", "kv_dropped"):
        return tuple(int(v) for v in _list(value))
    if name in ("preempted", "aborted"):
        return tuple(str(v) for v in _list(value))
    if name == "scheduled_users":
        return tuple(None if v is None else str(v) for v in _list(value))
    if name == "block_tables":
        return tuple((str(rid), tuple(int(b) for b in table)) for rid, table in _list(value))
    if name == "speculated":
        return tuple((str(rid), int(d), int(a)) for rid, d, a in _list(value))
    if name == "admitted":
        return tuple(Admission(**item) for item in _list(value))
    if name == "arrived":
        return tuple(Arrival(**item) for item in _list(value))
    if name == "kv_compacted":
        return tuple(_compaction_from_json(item) for item in _list(value))
    if name == "expert_load":
        return _expert_load_from_json(value)
    if name in ("wall_time_s", "model_time_s", "start_time_s", "end_time_s", "kv_usage"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _compaction_to_json(compaction: Compaction) -> dict[str, Any]:
    """A KV press compaction as a dict; ``error`` only when the press failed."""
    out = {
        "request_id": compaction.request_id,
        "context_len": compaction.context_len,
        "before": list(compaction.before),
        "kept": list(compaction.kept),
    }
    if compaction.error is not None:
        out["error"] = compaction.error
    return out


def _compaction_from_json(item: Any) -> Compaction:
    if not isinstance(item, dict):
        raise TypeError(f"a compaction must be a JSON object, got {type(item).__name__}")
    unknown = sorted(set(item) - {"request_id", "context_len", "before", "kept", "error"})
    if unknown:
        raise ValueError(f"unknown compaction field(s) {unknown}")
    error = item.get("error")
    return Compaction(
        request_id=str(item["request_id"]),
        context_len=int(item["context_len"]),
        before=tuple(int(v) for v in _list(item["before"])),
        kept=tuple(int(v) for v in _list(item["kept"])),
        error=None if error is None else str(error),
    )


def _expert_load_from_json(item: Any) -> ExpertLoad:
    if not isinstance(item, dict):
        raise TypeError(f"an expert load must be a JSON object, got {type(item).__name__}")
    if set(item) != {"layers", "counts", "top_k"}:
        raise ValueError(
            f"an expert load has the fields ['counts', 'layers', 'top_k'], got {sorted(item)}"
        )
    return ExpertLoad(layers=_list(item["layers"]),
                      counts=[_list(row) for row in _list(item["counts"])],
                      top_k=item["top_k"])


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def snapshot_to_json(snapshot: EngineSnapshot) -> dict[str, Any]:
    refs = np.asarray(snapshot.kv.ref_counts)
    held = np.flatnonzero(refs)
    return {
        "step_index": snapshot.step_index,
        "block_size": snapshot.block_size,
        "num_blocks": snapshot.num_blocks,
        # Sparse: most blocks of a fresh pool hold nothing.
        "refs": [[int(b), int(refs[b])] for b in held],
        "cached": np.flatnonzero(snapshot.kv.cached).tolist(),
        "tables": {rid: list(t) for rid, t in snapshot.kv.block_tables.items()},
        "num_computed": dict(snapshot.num_computed),
        "num_free_blocks": snapshot.kv.num_free_blocks,
        "num_waiting": snapshot.num_waiting,
        "num_running": snapshot.num_running,
        "time_s": snapshot.time_s,
        # Only when a KV press compacted a request (older recordings have none).
        **({"kv_dropped": dict(snapshot.kv_dropped)} if snapshot.kv_dropped else {}),
        **{  # host tiers, only when there are any
            name: list(value) if isinstance(value, tuple) else value
            for name in _HOST_SNAPSHOT_FIELDS
            if (value := getattr(snapshot, name))
        },
    }


_HOST_SNAPSHOT_FIELDS = (
    "num_swap_blocks", "num_swap_blocks_used", "num_offload_blocks", "offload_cached",
)


def snapshot_from_json(data: dict[str, Any]) -> EngineSnapshot:
    n = int(data["num_blocks"])
    refs = np.zeros(n, np.int32)
    for block, count in data["refs"]:
        refs[int(block)] = int(count)
    cached = np.zeros(n, bool)
    cached[[int(b) for b in data["cached"]]] = True
    kv = CacheSnapshot(
        ref_counts=refs,
        cached=cached,
        block_tables={str(r): tuple(int(b) for b in t) for r, t in data["tables"].items()},
        num_free_blocks=int(data["num_free_blocks"]),
    )
    return EngineSnapshot(
        step_index=int(data["step_index"]),
        block_size=int(data["block_size"]),
        num_blocks=n,
        kv=kv,
        num_computed={str(r): int(c) for r, c in data["num_computed"].items()},
        num_waiting=int(data["num_waiting"]),
        num_running=int(data["num_running"]),
        time_s=float(data["time_s"]),
        num_swap_blocks=int(data.get("num_swap_blocks", 0)),
        num_swap_blocks_used=int(data.get("num_swap_blocks_used", 0)),
        num_offload_blocks=int(data.get("num_offload_blocks", 0)),
        offload_cached=tuple(int(b) for b in data.get("offload_cached", ())),
        kv_dropped={str(r): int(d) for r, d in data.get("kv_dropped", {}).items()},
    )


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    to_dict = getattr(value, "to_dict", None)  # e.g. SpeculativeConfig, as vLLM spells it
    if callable(to_dict):
        return _jsonable(to_dict())
    return str(value)


def _name(component: object) -> str:
    """A component's registry name, else its class name."""
    name = getattr(component, "name", None)
    return name if isinstance(name, str) else type(component).__name__


def _engine_header(engine) -> dict[str, Any]:
    config = {k: _jsonable(v) for k, v in attrs.asdict(engine.config, recurse=False).items()}
    scheduler = engine.scheduler
    components = {
        "scheduling_policy": _name(scheduler.policy),
        "eviction_policy": _name(scheduler.kv.eviction),
        "executor": _name(engine.executor),
    }
    return {"format": FORMAT, "version": VERSION, "config": config, "components": components}


# -- writing -------------------------------------------------------------------------


def _open(path: pathlib.Path, mode: str):
    """A text file; gzip-compressed when the name ends in ``.gz`` (about 10x smaller)."""
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


class Recorder:
    """A step observer that writes the run to a JSON Lines file (``Engine.record``).

    Lines are buffered and flushed at least once a second, so an interrupted run loses at
    most the last second; :meth:`close` (or leaving a ``with`` block) writes the footer and
    unsubscribes. A recording with no footer still loads (``Recording.complete`` is False).
    """

    def __init__(self, engine, path: str | os.PathLike) -> None:
        self.path = pathlib.Path(path)
        self.num_steps = 0
        self._engine = engine
        self._file: io.TextIOBase | None = _open(self.path, "w")
        self._last_flush = time.monotonic()
        try:
            header = _engine_header(engine)
            header["snapshot"] = snapshot_to_json(engine.observe(self))
            self._write(header)
            self._file.flush()
        except BaseException:
            self.close()
            raise

    def __call__(self, event: StepEvent) -> None:
        if self._file is None:
            return
        self._write({"step": event_to_json(event)})
        self.num_steps += 1
        now = time.monotonic()
        if now - self._last_flush >= _FLUSH_EVERY_S:
            self._file.flush()
            self._last_flush = now

    def close(self) -> None:
        """Stop recording: unsubscribe, write the footer, close the file (idempotent)."""
        if self._file is None:
            return
        try:
            if self in self._engine.observers:
                self._engine.unsubscribe(self)
            self._write({"end": {"steps": self.num_steps}})
        finally:
            self._file.close()
            self._file = None

    def __enter__(self) -> Recorder:  # noqa: PYI034 - Recorder is not meant to be subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")))
        self._file.write("\n")

    def __repr__(self) -> str:
        state = "closed" if self._file is None else "recording"
        return f"Recorder({str(self.path)!r}, {state}, {self.num_steps} steps)"


# -- reading -------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Recording:
    """A recording read back by :func:`load`.

    Attributes:
        path: where it was read from.
        config / components: the engine's settings and policy names, as recorded.
        snapshot: the state the recording starts from.
        events: every step event, in order.
        complete: whether the footer was there (False: the run stopped before ``close``).
        truncated: the file was cut (mid-line, or a compressed stream without its end):
            what was read is every complete line before the cut.
    """

    path: pathlib.Path
    config: dict[str, Any]
    components: dict[str, str]
    snapshot: EngineSnapshot
    events: tuple[StepEvent, ...]
    complete: bool
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[StepEvent]:
        return iter(self.events)

    def __repr__(self) -> str:
        tail = "" if self.complete else ", truncated" if self.truncated else ", incomplete"
        return f"Recording({str(self.path)!r}, {len(self.events)} steps{tail})"


def load(path: str | os.PathLike) -> Recording:
    """Read a recording written by :meth:`Engine.record <llmlab.engine.engine.Engine.record>`.

    A file cut anywhere after its header (a killed run) loads its complete lines, marked
    ``truncated``. Raises ``ValueError`` naming the file and line for anything that is not
    a recording: a complete line that is not JSON, a first line that is not a recording
    header (or a file cut inside it), a step with an unknown or malformed field, lines
    after the footer.
    """
    path = pathlib.Path(path)
    events: list[StepEvent] = []
    header: dict[str, Any] | None = None
    snapshot = None
    complete = False
    lines, truncated, rest = _complete_lines(path)
    if truncated and not lines:
        try:
            rest.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: line 1: cannot be read: {exc}") from None
        if not rest.lstrip().startswith(b'{"format"'):
            raise ValueError(f"{path}: line 1: not an llmlab recording")
        raise ValueError(f"{path}: line 1: the file is cut inside its header")
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path}: line {lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{where}: cannot be read: {exc}") from None
        if not line.strip():
            continue
        if complete:
            raise ValueError(f"{where}: content after the end of the recording")
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc.msg}") from None
        if header is None:
            header, snapshot = _read_header(data, where)
            continue
        if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in (
            "step",
            "end",
        ):
            keys = list(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"{where}: expected {{'step': ...}} or {{'end': ...}}, got {keys}")
        if "end" in data:
            complete = True
            continue
        try:
            events.append(event_from_json(data["step"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad step event: {exc}") from None
    if header is None:
        raise ValueError(f"{path}: line 1: empty file, not an llmlab recording")
    return Recording(
        path=path,
        config=header.get("config", {}),
        components=header.get("components", {}),
        snapshot=snapshot,
        events=tuple(events),
        complete=complete,
        truncated=truncated,
    )


def _complete_lines(path: pathlib.Path) -> tuple[list[bytes], bool, bytes]:
    """The file's complete lines (without their newline), whether it was cut, and what
    follows the last newline: a last line with no newline, or a compressed stream that
    ends early, is dropped."""
    raw = path.read_bytes()
    cut = False
    if path.suffix == ".gz":
        raw, cut = _gunzip_prefix(raw, path)
    lines = raw.split(b"\n")
    if lines[-1]:
        cut = True  # a line without its newline: cut while it was written
    return lines[:-1], cut, lines[-1]


def _gunzip_prefix(data: bytes, path: pathlib.Path) -> tuple[bytes, bool]:
    """Everything a gzip stream decompresses to up to where it ends or is cut (the writer
    sync-flushes, so a cut loses only what followed the last flush); True if cut."""
    out = []
    while data:
        stream = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out.append(stream.decompress(data))
        except zlib.error as exc:
            raise ValueError(f"{path}: not a readable gzip stream: {exc}") from None
        if not stream.eof:
            return b"".join(out), True
        data = stream.unused_data  # another gzip member follows (or nothing)
    return b"".join(out), False


def _read_header(data: Any, where: str) -> tuple[dict[str, Any], EngineSnapshot]:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(
            f"{where}: not an llmlab recording (the first line must be a header with "
            f"format {FORMAT!r}, got {got!r})"
        )
    if data.get("version") != VERSION:
        raise ValueError(
            f"{where}: recording format version {data.get('version')!r} is not supported "
            f"(this llmlab reads version {VERSION})"
        )
    try:
        snapshot = snapshot_from_json(data["snapshot"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{where}: bad snapshot in the header: {exc!r}") from None
    return data, snapshot
