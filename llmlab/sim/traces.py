"""Real-world request traces, read lazily as workloads for the simulator.

A reader turns a trace file into a :class:`Trace`: an iterable of
:class:`~llmlab.experiments.workloads.WorkloadRequest` in arrival order, read line by line
(a ``.gz`` path through ``gzip``), so a trace of millions of rows never sits in memory.
Each ``iter()`` reads the file again from the top. Arrival times are seconds from the first
request read (so it arrives at 0.0), times ``time_scale``. Traces carry lengths, not text,
so prompts are token ids drawn uniformly from ``[low, vocab_size)``, determined by
``(seed, line number)``: the same file and seed give the same workload.

Formats:

* ``"azure"``: the Azure LLM inference traces (Azure Public Dataset,
  ``AzureLLMInferenceTrace_code.csv`` / ``_conv.csv``, 2023 and 2024; Patel et al.,
  "Splitwise", ISCA 2024; github.com/Azure/AzurePublicDataset). CSV with the header
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is a datetime such as
  ``2023-11-16 18:15:46.6805900`` (seven fractional digits, which ``datetime`` cannot parse,
  so the fraction is read separately).
* ``"mooncake"``: the Mooncake traces (kvcache-ai/Mooncake, ``mooncake_trace.jsonl`` and
  others; Qin et al., "Mooncake", FAST 2025). JSON Lines with ``timestamp`` (ms from the
  trace's start), ``input_length``, ``output_length`` and ``hash_ids``: each id names one
  ``block_tokens``-token block of the prompt, so requests sharing leading ids share that
  prefix. Here a block's tokens are a function of ``(seed, hash id)`` alone, so equal ids give
  identical blocks; the prompt is the blocks in order, cut (or padded with tokens of the
  line's own) to ``input_length``. Recent blocks are kept in a bounded LRU.
* ``"burstgpt"``: BurstGPT (HPMLL/BurstGPT; Wang et al., "BurstGPT", 2024). CSV with the
  header ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``;
  ``Timestamp`` is seconds from the trace's start. Rows with 0 response tokens are failed
  requests; ``model`` keeps only one model's rows.
* ``"recording"``: llmlab's own recordings (:func:`llmlab.observe.recording.load`): every
  arrival, with its prompt length, ``max_tokens`` (``default_max_tokens`` where it was
  None), user and priority. Recordings are small, so this one reads the whole file.

Rows that cannot be requests (0 output tokens, 0 prompt tokens) are skipped and counted in
:attr:`Trace.num_skipped`. Anything wrong in a file raises ``ValueError`` naming the file,
the 1-based line and the field; :func:`read_trace` checks the header and first row at once,
the rest as iteration reaches them.

The files in :data:`SAMPLES` (``llmlab/sim/samples/``) are small *synthetic* traces in these
formats, written by ``samples/make_samples.py``: not real data.
"""

from __future__ import annotations

import collections
import csv
import datetime
import functools
import gzip
import itertools
import json
import math
import os
import pathlib
import re
import zlib
from collections.abc import Callable, Iterator, Mapping

import attrs
import numpy as np

from llmlab.experiments.workloads import Workload, WorkloadRequest
from llmlab.validation import as_choice, as_int, as_real, as_str

FORMATS = ("azure", "mooncake", "burstgpt", "recording")

_SAMPLES_DIR = pathlib.Path(__file__).parent / "samples"
SAMPLES: dict[str, pathlib.Path] = {
    "azure": _SAMPLES_DIR / "azure_conv_sample.csv",
    "mooncake": _SAMPLES_DIR / "mooncake_sample.jsonl",
    "burstgpt": _SAMPLES_DIR / "burstgpt_sample.csv",
}
"""The shipped synthetic sample of each file format."""

_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens")
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_RECORDING_FORMAT = "llmlab.recording"
# Mooncake blocks kept per iteration, in tokens (16 MB of int64): popular prefixes stay.
_BLOCK_CACHE_TOKENS = 1 << 21
# Mixed into a block's seed so block h and line h draw different tokens.
_BLOCK_STREAM = 0x6D6F6F6E


# -- options -----------------------------------------------------------------------------


def _optional_length(field: str) -> Callable[[object], int | None]:
    return functools.partial(as_int, field, min=1, allow_none=True)


@attrs.frozen
class TraceOptions:
    """How every reader turns rows into requests (see :func:`read_trace`)."""

    vocab_size: int = attrs.field(converter=functools.partial(as_int, "vocab_size", min=1))
    low: int = attrs.field(default=2, converter=functools.partial(as_int, "low", min=0))
    seed: int = attrs.field(default=0, converter=functools.partial(as_int, "seed", min=0))
    limit: int | None = attrs.field(
        default=None, converter=functools.partial(as_int, "limit", min=0, allow_none=True)
    )
    time_scale: float = attrs.field(default=1.0, converter=functools.partial(
        as_real, "time_scale", min=0, min_inclusive=False,
        allowed="> 0 (0.5 plays the trace twice as fast)",
    ))
    max_prompt_len: int | None = attrs.field(
        default=None, converter=_optional_length("max_prompt_len"))
    max_output_len: int | None = attrs.field(
        default=None, converter=_optional_length("max_output_len"))

    def __attrs_post_init__(self) -> None:
        if self.low >= self.vocab_size:
            raise ValueError(
                f"low must be an int in [0, vocab_size) = [0, {self.vocab_size}), "
                f"got {self.low}"
            )


# -- reading lines -----------------------------------------------------------------------


@attrs.frozen(slots=True)
class _Row:
    """One trace row. ``line`` is 1-based (a recording's: the arrival's ordinal); ``time_s``
    is on the file's own clock; ``time_text`` is the time as written, for messages."""

    line: int
    time_s: float
    time_text: str
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None
    model: str | None = None
    user: str | None = None
    priority: int = 0


def _error(path: pathlib.Path, line: int, message: str) -> ValueError:
    return ValueError(f"{path}: line {line}: {message}")


def _lines(path: pathlib.Path) -> Iterator[str]:
    """The file's lines, one at a time (``.gz``: decompressed as they are read); a byte
    stream that is not UTF-8 text, or not gzip, raises naming the line it broke on."""
    opener = gzip.open if path.suffix == ".gz" else open
    num_read = 0
    try:
        # newline="": the csv module's own line handling; utf-8-sig drops a leading BOM.
        with opener(path, "rt", encoding="utf-8-sig", newline="") as file:
            for text in file:
                num_read += 1
                yield text
    except (UnicodeDecodeError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _error(path, num_read + 1, f"cannot be read: {exc}") from None


def _first_line(path: pathlib.Path) -> str:
    lines = _lines(path)
    try:
        for text in lines:
            if text.strip():
                return text
    finally:
        lines.close()
    raise _error(path, 1, "empty file (no header)")


def _number(value: object, text: bool) -> float | int | None:
    """``value`` as a number: a CSV field's text (``text=True``), or a JSON number (a JSON
    string is not a number); None when it is not one."""
    if isinstance(value, str) and text:
        for parse in (int, float):
            try:
                return parse(value)
            except ValueError:
                pass
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def _count(path: pathlib.Path, line: int, field: str, value: object, *, text: bool = True
           ) -> int:
    """A token count: a whole number >= 0 (``12``, or ``12.0`` as some exports write it)."""
    number = _number(value, text)
    if number is None or not math.isfinite(number) or number != int(number):
        raise _error(path, line, f"{field} must be a whole number of tokens, got {value!r}")
    if number < 0:
        raise _error(path, line, f"{field} must be >= 0 (a length), got {value!r}")
    return int(number)


def _seconds(path: pathlib.Path, line: int, field: str, value: object, unit_s: float, *,
             text: bool = True) -> float:
    number = _number(value, text)
    if number is None or not math.isfinite(number):
        raise _error(path, line, f"{field} must be a finite number, got {value!r}")
    return float(number) * unit_s


def _csv_rows(path: pathlib.Path, columns: tuple[str, ...], what: str
              ) -> Iterator[tuple[int, dict[str, str]]]:
    """``(line, {column: text})`` for each non-blank data row, after checking the header."""
    lines = _lines(path)
    try:
        yield from _checked_csv(path, csv.reader(lines), columns, what)
    finally:
        lines.close()


def _checked_csv(path: pathlib.Path, reader, columns: tuple[str, ...], what: str
                 ) -> Iterator[tuple[int, dict[str, str]]]:
    header = next(reader, None)
    while header is not None and not any(h.strip() for h in header):
        header = next(reader, None)  # blank lines before the header
    if header is None:
        raise _error(path, 1, "empty file (no header)")
    header = [h.strip() for h in header]
    missing = [c for c in columns if c not in header]
    if missing:
        raise _error(path, reader.line_num, (
            f"the header lacks column(s) {', '.join(map(repr, missing))}: a {what} has "
            f"{', '.join(columns)}; got {', '.join(header)}"
        ))
    index = {c: header.index(c) for c in columns}
    for fields in reader:
        if not any(f.strip() for f in fields):
            continue
        short = [c for c, i in index.items() if i >= len(fields)]
        if short:
            raise _error(path, reader.line_num, (
                f"{len(fields)} field(s) where the header has {len(header)}: no "
                f"{', '.join(map(repr, short))}"
            ))
        yield reader.line_num, {c: fields[i].strip() for c, i in index.items()}


# -- formats -----------------------------------------------------------------------------

_DATETIME = re.compile(
    r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?"
)
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def _datetime_s(path: pathlib.Path, line: int, text: str) -> tuple[int, float]:
    """``(whole seconds since 1970, fraction)``; a time without zone is taken as UTC. Kept
    apart so differences keep all seven fractional digits of Azure's timestamps."""
    match = _DATETIME.fullmatch(text)
    whole = None
    if match is not None:
        date, clock, fraction, zone = match.groups()
        zone = "+00:00" if zone in (None, "Z") else zone if ":" in zone else (
            f"{zone[:3]}:{zone[3:]}")
        try:
            whole = datetime.datetime.fromisoformat(f"{date}T{clock}{zone}")
        except ValueError:
            pass
    if whole is None:
        raise _error(path, line, (
            f"TIMESTAMP must be a date and time such as '2023-11-16 18:15:46.6805900', "
            f"got {text!r}"
        ))
    seconds = (whole - _EPOCH) // datetime.timedelta(seconds=1)
    return seconds, float(f"0.{fraction}") if fraction else 0.0


def _azure_rows(path: pathlib.Path, _: Mapping[str, object]) -> Iterator[_Row]:
    first: int | None = None
    for line, row in _csv_rows(path, _AZURE_COLUMNS, "Azure LLM inference trace"):
        text = row["TIMESTAMP"]
        whole, fraction = _datetime_s(path, line, text)
        first = whole if first is None else first
        yield _Row(
            line, (whole - first) + fraction, text,
            _count(path, line, "ContextTokens", row["ContextTokens"]),
            _count(path, line, "GeneratedTokens", row["GeneratedTokens"]),
        )


def _burstgpt_rows(path: pathlib.Path, _: Mapping[str, object]) -> Iterator[_Row]:
    for line, row in _csv_rows(path, _BURSTGPT_COLUMNS, "BurstGPT trace"):
        text = row["Timestamp"]
        yield _Row(
            line, _seconds(path, line, "Timestamp", text, 1.0), text,
            _count(path, line, "Request tokens", row["Request tokens"]),
            _count(path, line, "Response tokens", row["Response tokens"]),
            model=row["Model"],
        )


def _json_objects(path: pathlib.Path) -> Iterator[tuple[int, dict]]:
    lines = _lines(path)
    try:
        seen = False
        for line, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            seen = True
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _error(path, line, f"not valid JSON: {exc.msg} (column {exc.colno})"
                             ) from None
            if not isinstance(data, dict):
                raise _error(path, line, f"expected a JSON object, got {type(data).__name__}")
            yield line, data
        if not seen:
            raise _error(path, 1, "empty file (no header)")
    finally:
        lines.close()


def _hash_ids(path: pathlib.Path, line: int, value: object) -> tuple[int, ...]:
    if isinstance(value, list) and all(
        type(h) is int and h >= 0 for h in value  # bools are not ids
    ):
        return tuple(value)
    raise _error(path, line, f"hash_ids must be a list of ints >= 0, got {value!r}")


def _mooncake_rows(path: pathlib.Path, _: Mapping[str, object]) -> Iterator[_Row]:
    for line, data in _json_objects(path):
        missing = [f for f in _MOONCAKE_FIELDS if f not in data]
        if missing:
            raise _error(path, line, (
                f"missing field(s) {', '.join(map(repr, missing))}: a Mooncake line has "
                f"{', '.join(_MOONCAKE_FIELDS)}"
            ))
        stamp = data["timestamp"]
        yield _Row(
            line, _seconds(path, line, "timestamp", stamp, 1e-3, text=False), f"{stamp!r} ms",
            _count(path, line, "input_length", data["input_length"], text=False),
            _count(path, line, "output_length", data["output_length"], text=False),
            hash_ids=_hash_ids(path, line, data["hash_ids"]),
        )


def _recording_rows(path: pathlib.Path, format_options: Mapping[str, object]
                    ) -> Iterator[_Row]:
    from llmlab.observe.recording import load

    arrivals = []
    # Line 1 is the header and the recorder writes one step a line: step i is line i + 2.
    for line, event in enumerate(load(path).events, start=2):
        for arrival in event.arrived:
            where = f"arrival {arrival.request_id!r}"
            max_tokens = arrival.max_tokens
            arrivals.append((
                _seconds(path, line, f"{where}: arrival_time", arrival.arrival_time, 1.0,
                         text=False),
                repr(arrival.arrival_time),
                _count(path, line, f"{where}: prompt_len", arrival.prompt_len, text=False),
                format_options["default_max_tokens"] if max_tokens is None else _count(
                    path, line, f"{where}: max_tokens", max_tokens, text=False),
                arrival.user,
                arrival.priority,
            ))
    # Requests queued from several threads may be recorded slightly out of time order.
    arrivals.sort(key=lambda arrival: arrival[0])
    for ordinal, (time_s, time_text, prompt_len, output_len, user, priority) in enumerate(
        arrivals, start=1
    ):
        yield _Row(ordinal, time_s, time_text, prompt_len, output_len, user=user,
                   priority=priority)


def _check_recording_header(path: pathlib.Path) -> None:
    try:
        data = json.loads(_first_line(path))
    except json.JSONDecodeError as exc:
        raise _error(path, 1, f"not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict) or data.get("format") != _RECORDING_FORMAT:
        raise _error(path, 1, f"not an llmlab recording (no 'format': {_RECORDING_FORMAT!r})")


@attrs.frozen
class _Format:
    """How to read one format: its rows, the name of its time field (for messages), and
    its own options with their defaults."""

    read_rows: Callable[[pathlib.Path, Mapping[str, object]], Iterator[_Row]]
    time_field: str
    defaults: Mapping[str, object] = attrs.field(factory=dict)


_FORMATS: dict[str, _Format] = {
    "azure": _Format(_azure_rows, "TIMESTAMP"),
    "mooncake": _Format(_mooncake_rows, "timestamp", {"block_tokens": 512}),
    "burstgpt": _Format(_burstgpt_rows, "Timestamp", {"model": None}),
    "recording": _Format(_recording_rows, "arrival_time", {"default_max_tokens": 16}),
}
_FORMAT_OPTION_CHECKS: dict[str, Callable[[object], object]] = {
    "block_tokens": functools.partial(as_int, "block_tokens", min=1),
    "model": functools.partial(as_str, "model", allow_none=True, allow_empty=False),
    "default_max_tokens": functools.partial(as_int, "default_max_tokens", min=1),
}


# -- prompts -----------------------------------------------------------------------------


@attrs.define
class _Prompts:
    """Token ids for rows: per line, or (Mooncake) from shared blocks kept in an LRU."""

    options: TraceOptions
    block_tokens: int
    _blocks: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)

    def _draw(self, seed: list[int], n: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(self.options.low, self.options.vocab_size, n)

    def _block(self, hash_id: int) -> np.ndarray:
        block = self._blocks.get(hash_id)
        if block is not None:
            self._blocks.move_to_end(hash_id)
            return block
        block = self._draw([self.options.seed, hash_id, _BLOCK_STREAM], self.block_tokens)
        self._blocks[hash_id] = block
        if len(self._blocks) > max(1, _BLOCK_CACHE_TOKENS // self.block_tokens):
            self._blocks.popitem(last=False)
        return block

    def of(self, row: _Row, n: int) -> tuple[int, ...]:
        own = [self.options.seed, row.line]
        if row.hash_ids is None:
            return tuple(self._draw(own, n).tolist())
        num_blocks = min(len(row.hash_ids), -(-n // self.block_tokens))
        parts = [self._block(h) for h in row.hash_ids[:num_blocks]]
        have = num_blocks * self.block_tokens
        if have < n:  # input_length beyond the named blocks: the line's own tokens
            parts.append(self._draw(own, n - have))
        return tuple(np.concatenate(parts)[:n].tolist())


# -- the trace ---------------------------------------------------------------------------


def _stem(path: pathlib.Path) -> str:
    name = path.name
    for suffix in (".gz", ".csv", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name or path.name


@attrs.define(eq=False)
class Trace:
    """A workload read lazily from a trace file; each ``iter()`` reads the file again.

    Made by :func:`read_trace` or a per-format reader. Making one checks the options and
    the file's start (header and first row; a recording's header), so a wrong file fails
    at once; later rows are checked as iteration reaches them.

    Attributes:
        path: the file.
        format: one of :data:`FORMATS`.
        options: how rows become requests.
        format_options: the format's own (Mooncake: ``block_tokens``; BurstGPT: ``model``;
            recordings: ``default_max_tokens``).
        name: the file's name without ``.csv`` / ``.jsonl`` / ``.gz``.
        num_skipped: rows the latest iteration skipped (so far, if it is not done).
        skipped: the same, by reason (``"zero output tokens"``, ``"zero prompt tokens"``).
    """

    path: pathlib.Path = attrs.field(converter=pathlib.Path)
    format: str = attrs.field(converter=functools.partial(as_choice, "format", choices=FORMATS))
    options: TraceOptions
    format_options: Mapping[str, object] = attrs.field(factory=dict, converter=dict)
    name: str = attrs.field(init=False)
    skipped: dict[str, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.name = _stem(self.path)
        defaults = _FORMATS[self.format].defaults
        unknown = sorted(set(self.format_options) - set(defaults))
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)}: not an option of the {self.format!r} format (its own "
                f"options: {', '.join(defaults) or 'none'})"
            )
        self.format_options = {
            key: _FORMAT_OPTION_CHECKS[key](self.format_options.get(key, default))
            for key, default in defaults.items()
        }
        if self.format == "recording":
            _check_recording_header(self.path)
        else:  # the header and the first row, so a wrong file fails now
            rows = self._rows()
            try:
                next(rows, None)
            finally:
                rows.close()

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def _rows(self) -> Iterator[_Row]:
        return _FORMATS[self.format].read_rows(self.path, self.format_options)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return self._requests()

    def _requests(self) -> Iterator[WorkloadRequest]:
        options = self.options
        skipped = self.skipped = {}
        if options.limit == 0:
            return
        prompts = _Prompts(options, self.format_options.get("block_tokens", 512))
        model = self.format_options.get("model")
        time_field = _FORMATS[self.format].time_field
        origin = previous = None
        num_yielded = 0
        rows = self._rows()
        try:
            for row in rows:
                if previous is not None and row.time_s < previous.time_s:
                    raise _error(self.path, row.line, (
                        f"{time_field} {row.time_text} is earlier than {previous.time_text} "
                        f"on line {previous.line}: the trace must be sorted by time"
                    ))
                previous = row  # every row counts for the order, filtered or skipped
                if model is not None and row.model != model:
                    continue
                reason = ("zero output tokens" if row.output_len == 0
                          else "zero prompt tokens" if row.prompt_len == 0 else None)
                if reason is not None:
                    skipped[reason] = skipped.get(reason, 0) + 1
                    continue
                origin = row.time_s if origin is None else origin
                prompt_len = min(row.prompt_len, options.max_prompt_len or row.prompt_len)
                yield WorkloadRequest(
                    (row.time_s - origin) * options.time_scale,
                    prompts.of(row, prompt_len),
                    min(row.output_len, options.max_output_len or row.output_len),
                    user=row.user,
                    priority=row.priority,
                )
                num_yielded += 1
                if num_yielded == options.limit:
                    return
        finally:
            rows.close()  # closes the file now, not when the generator is collected

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (fewer if the trace is shorter) as an in-memory
        :class:`~llmlab.experiments.workloads.Workload` named after the file."""
        n = as_int("n", n, min=0)
        return Workload(self.name, list(itertools.islice(self, n)))

    def __repr__(self) -> str:
        return f"Trace({str(self.path)!r}, format={self.format!r})"


# -- readers -----------------------------------------------------------------------------


def read_trace(
    path: str | os.PathLike, format: str | None = None, *, vocab_size: int, low: int = 2,
    seed: int = 0, limit: int | None = None, time_scale: float = 1.0,
    max_prompt_len: int | None = None, max_output_len: int | None = None, **format_options,
) -> Trace:
    """A trace file as a lazy workload; ``format=None`` tells it by :func:`sniff_format`.

    Args:
        vocab_size / low: prompts are token ids drawn uniformly from ``[low, vocab_size)``.
        seed: the tokens drawn (the same seed, file and options: the same requests).
        limit: stop after that many requests (None: the whole trace).
        time_scale: multiplies arrival times (0.5 plays the trace twice as fast).
        max_prompt_len / max_output_len: clamp the lengths (None: as written), for a
            model with a short context; a clamped prompt is the start of the full one.
        format_options: the format's own: ``block_tokens=512`` (Mooncake),
            ``model=None`` (BurstGPT), ``default_max_tokens=16`` (recordings).

    The header and first row are checked now; later rows as iteration reaches them.
    """
    format = sniff_format(path) if format is None else as_choice("format", format, FORMATS)
    options = TraceOptions(
        vocab_size, low, seed, limit, time_scale, max_prompt_len, max_output_len)
    return Trace(path, format, options, format_options)


def azure_trace(path: str | os.PathLike, **options) -> Trace:
    """An Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``); the
    options are :func:`read_trace`'s."""
    return read_trace(path, "azure", **options)


def mooncake_trace(path: str | os.PathLike, *, block_tokens: int = 512, **options) -> Trace:
    """A Mooncake trace (JSON Lines: ``timestamp`` in ms, ``input_length``,
    ``output_length``, ``hash_ids`` of ``block_tokens``-token prompt blocks)."""
    return read_trace(path, "mooncake", block_tokens=block_tokens, **options)


def burstgpt_trace(path: str | os.PathLike, *, model: str | None = None, **options) -> Trace:
    """A BurstGPT trace; ``model`` (e.g. ``"ChatGPT"``, ``"GPT-4"``) keeps only its rows."""
    return read_trace(path, "burstgpt", model=model, **options)


def recording_trace(
    path: str | os.PathLike, *, default_max_tokens: int = 16, **options
) -> Trace:
    """The arrivals of an llmlab recording (``Engine.record``), in time order, with
    ``default_max_tokens`` where an arrival has none; a prompt's tokens are drawn per
    arrival (its 1-based ordinal stands for the line number). An arrival of ``n`` samples
    is one request (a workload request has no ``n``)."""
    return read_trace(path, "recording", default_max_tokens=default_max_tokens, **options)


def sniff_format(path: str | os.PathLike) -> str:
    """The format of a trace file, from its name and first line: JSON lines are a recording
    when the first has ``"format": "llmlab.recording"``, else Mooncake; a CSV header is
    Azure or BurstGPT, whichever's columns it has more of (a name that is neither ``.csv``
    nor ``.jsonl``, ``.gz`` aside, is told by whether the first line is a JSON object)."""
    path = pathlib.Path(path)
    first = _first_line(path)
    kind = path.name.removesuffix(".gz").rpartition(".")[2].lower()
    if kind not in ("csv", "jsonl", "json"):
        kind = "jsonl" if first.lstrip().startswith("{") else "csv"
    if kind != "csv":
        try:
            data = json.loads(first)
        except json.JSONDecodeError:
            data = None
        is_recording = isinstance(data, dict) and data.get("format") == _RECORDING_FORMAT
        return "recording" if is_recording else "mooncake"
    # The format whose columns the header has most of: a header lacking one of them is
    # then named by that format's own check.
    header = {h.strip() for h in next(csv.reader([first]), [])}
    overlaps = {"azure": len(header & set(_AZURE_COLUMNS)),
                "burstgpt": len(header & set(_BURSTGPT_COLUMNS))}
    best = max(overlaps, key=overlaps.__getitem__)
    if overlaps[best] > 0 and list(overlaps.values()).count(overlaps[best]) == 1:
        return best
    raise _error(path, 1, (
        f"cannot tell the trace format from the header {first.strip()!r}: expected "
        f"{','.join(_AZURE_COLUMNS)} (azure) or {','.join(_BURSTGPT_COLUMNS)},... (burstgpt); "
        f"pass format= one of {', '.join(map(repr, FORMATS))}"
    ))
