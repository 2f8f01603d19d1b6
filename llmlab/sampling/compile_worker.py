"""Turning a constraint into an xgrammar grammar, and the process that does it for a server.

:func:`compile_constraint` is the whole compile: ``(kind, spec)`` cache key in, xgrammar
``CompiledGrammar`` out, or a ``ValueError`` naming the field. The in-process path
(:meth:`StructuredOutputBackend.compile`) calls it directly; a server's compiles run it in
a process of their own (:mod:`llmlab.sampling.compile_pool`), which starts this file as
a script: :func:`serve` is that process.

The compile process is a small *fork server*. It starts once (importing xgrammar, and torch
with it, takes seconds), rebuilds the tokenizer's ``TokenizerInfo`` from the server's
serialized copy, then forks one child per compile. The child compiles, serializes the result
(``CompiledGrammar.serialize_json``, the one format xgrammar 0.2.8 offers; no pickling, no
cancellation) and exits; the fork server relays the text. A compile the server gives up on
is ended with ``SIGKILL`` on its child, so it stops using a core at once and its memory is
returned; a fresh child for the next compile costs a fork, not a start. Forking is safe
here: the fork server runs one thread and has built no xgrammar compiler (each child builds
its own).

Only the standard library is imported at module level, and nothing of ``llmlab``: the
process runs this file by path, without the package's import cost or its threads.
Messages are pickles of plain tuples, strings and bytes. Linux (and other POSIX systems with
``fork``); the children also die with the fork server (``PR_SET_PDEATHSIG`` on Linux), and
the fork server ends when the server's end of its socket closes.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import sys
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("llmlab.sampling.structured")

# The character classes xgrammar (<= 0.2.8) writes for the characters of a JSON string,
# and what they should be. A string with minLength/maxLength gets [^"\\\r\n], which lets
# raw control characters (U+0000-U+001F) in: not JSON (json.loads rejects them). And a
# negated class matches the UTF-8 encoding of a surrogate (bytes ED A0-BF xx), which is not
# UTF-8: it decodes to three U+FFFD, so the text breaks maxLength and is not what the
# grammar matched. (Regex "." and [^...] in user regexes and grammars keep that hole.)
_JSON_STRING_CLASSES = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]")
_JSON_STRING_CHARS = r"[^\0-\x1f\"\\\ud800-\udfff]"

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes
# "Check failed: (cond) is false: ".
_XGR_ERROR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")

_WHAT_FAILED = {
    "json": "is not a usable JSON schema",
    "regex": "is not a supported regular expression",
    "choice": "could not be compiled",
    "grammar": "is not a valid EBNF grammar",
    "json_object": "could not be compiled",
}


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as err:
        raise ImportError(
            "structured outputs (structured_outputs / guided_decoding) need the xgrammar "
            "package: pip install xgrammar"
        ) from err
    return xgrammar


def xgr_message(err: BaseException) -> str:
    text = str(err).strip()
    return _XGR_ERROR_PREFIX.sub("", text).strip() or type(err).__name__


# ---------------------------------------------------------------------- the compile


def compile_constraint(compiler: Any, key: tuple, vocab_size: int) -> Any:
    """xgrammar's ``CompiledGrammar`` for a cache key ``(kind, spec)`` (see
    ``structured._cache_key``), compiled with ``compiler`` (an ``xgrammar.GrammarCompiler``).

    Raises:
        ValueError: naming the field (``structured_outputs.json`` / ``.regex`` /
            ``.choice`` / ``.grammar``) and why: an invalid or unsupported JSON schema,
            regex or grammar, or one that matches no text.
    """
    kind, spec = key[0], key[1] if len(key) > 1 else None
    field = f"structured_outputs.{kind}"
    if kind == "choice":
        spec = choice_grammar(spec)  # a ValueError naming the entry
    try:
        if kind == "json":
            compiled = _compile_json(compiler, spec, strict=True)
        elif kind == "json_object":
            # Any object: not xgrammar's builtin JSON grammar, which also admits a
            # top-level array and free whitespace. strict_mode=False: properties of any
            # name and value.
            compiled = _compile_json(compiler, '{"type": "object"}', strict=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        elif kind == "choice" or kind == "grammar":
            compiled = compiler.compile_grammar(spec)
        else:
            raise ValueError(f"structured_outputs has no constraint kind {kind!r}")
    except (RuntimeError, ValueError, TypeError) as err:
        raise ValueError(f"{field} {_WHAT_FAILED[kind]}: {xgr_message(err)}") from None
    if not _allows_some_token(compiled, vocab_size):
        raise ValueError(f"{field} matches no text: no token can start the output")
    return compiled


def _compile_json(compiler: Any, schema: str, *, strict: bool) -> Any:
    xgr = import_xgrammar()
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = fixed = str(grammar)
    for wrong in _JSON_STRING_CLASSES:
        fixed = fixed.replace(wrong, _JSON_STRING_CHARS)
    if fixed != text:
        try:
            return compiler.compile_grammar(fixed)
        except RuntimeError as err:  # the printed grammar did not parse back
            logger.warning(
                "JSON string fix for xgrammar not applied (%s); strings may admit raw "
                "control characters", xgr_message(err),
            )
    return compiler.compile_grammar(grammar)


def _allows_some_token(compiled: Any, vocab_size: int) -> bool:
    """Whether the grammar's first step allows any token below ``vocab_size``."""
    import torch  # xgrammar has imported it already

    xgr = import_xgrammar()
    width = (vocab_size + 31) // 32
    bitmask = torch.empty((1, width), dtype=torch.int32)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    tail = vocab_size % 32
    last = -1 if tail == 0 else (1 << tail) - 1
    return bool((bitmask[0, :-1] != 0).any()) or bool(int(bitmask[0, -1]) & last)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``."""
    literals = []
    for i, choice in enumerate(dict.fromkeys(choices)):
        try:
            literals.append(ebnf_literal(choice))
        except ValueError as err:
            raise ValueError(f"structured_outputs.choice[{i}] {err}") from None
    return "root ::= " + " | ".join(literals)


_EBNF_SIMPLE_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def ebnf_literal(text: str) -> str:
    """``text`` as an xgrammar EBNF string literal.

    Printable ASCII stays as is; everything else is written ``\\uXXXX`` / ``\\UXXXXXXXX``
    (fixed width: xgrammar reads ``\\x`` escapes greedily, so ``"\\x41b"`` would be U+041B).
    """
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _EBNF_SIMPLE_ESCAPES:
            out.append(_EBNF_SIMPLE_ESCAPES[ch])
        elif 0x20 <= code < 0x7F:
            out.append(ch)
        elif code == 0:
            # xgrammar's EBNF parser reads \0, \x00 and \u0000 as "nothing".
            raise ValueError("contains a NUL character, which the grammar engine cannot match")
        elif 0xD800 <= code <= 0xDFFF:
            raise ValueError(f"contains a lone surrogate U+{code:04X}, which is not text")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


# ---------------------------------------------------------------------- the fork server
#
# Server -> fork server: ("init", tokenizer_info_json, vocab_size, compile_threads,
#     max_grammar_bytes), then ("compile", job_id, key) and ("kill", job_id).
# Fork server -> server: ("ready", pid), ("started", job_id, pid) and
#     ("done", job_id, result) where result is the child's pickled ("ok", json) or
#     ("error", message), or None when the child died without answering (killed).


def _compile_job(info: Any, key: tuple, vocab_size: int, threads: int,
                 max_grammar_bytes: int | None) -> tuple:
    """One child's work: ``("ok", serialized grammar)`` or ``("error", message)``."""
    xgr = import_xgrammar()
    try:
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        compiled = compile_constraint(compiler, key, vocab_size)
        size = compiled.memory_size_bytes
        if max_grammar_bytes is not None and size > max_grammar_bytes:
            raise ValueError(
                f"structured_outputs.{key[0]} compiles to a grammar of {size / 2**20:.1f} MiB,"
                f" more than the {max_grammar_bytes / 2**20:.1f} MiB allowed"
                " (max_grammar_bytes); simplify the constraint"
            )
        return ("ok", compiled.serialize_json())
    except ValueError as err:
        return ("error", str(err))
    except Exception as err:  # noqa: BLE001 - a bug here must reach the server as text
        return ("error", f"structured_outputs.{key[0]} could not be compiled: "
                         f"{type(err).__name__}: {xgr_message(err)}")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the fork server (its parent) exits."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _fork_compile(server: Any, info: Any, key: tuple, settings: tuple) -> tuple[int, Any]:
    """Fork a child that compiles ``key``; its pid and the end the result arrives on."""
    from multiprocessing import Pipe

    result_end, child_end = Pipe(duplex=False)
    parent_pid = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        result_end.close()
        child_end.close()
        raise
    if pid == 0:  # the child: compile, answer, exit without running any cleanup
        code = 0
        try:
            _die_with_parent()
            if os.getppid() != parent_pid:
                os._exit(1)
            server.close()
            result_end.close()
            child_end.send_bytes(pickle.dumps(_compile_job(info, key, *settings)))
        except BaseException:  # noqa: BLE001 - the fork server hears None
            code = 1
        finally:
            os._exit(code)
    child_end.close()
    return pid, result_end


def serve(server: Any) -> None:
    """The fork server's loop over ``server`` (a ``multiprocessing`` connection)."""
    from multiprocessing.connection import wait

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when this ends
    _, info_json, vocab_size, threads, max_grammar_bytes = server.recv()
    xgr = import_xgrammar()
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    settings = (vocab_size, threads, max_grammar_bytes)
    server.send(("ready", os.getpid()))
    children: dict[int, tuple[int, Any]] = {}  # job id -> (pid, result end)
    try:
        while True:
            ends = {end: job for job, (_, end) in children.items()}
            for ready in wait([server, *ends]):
                if ready is server:
                    try:
                        message = server.recv()
                    except (EOFError, OSError):
                        return  # the server is gone (or closed us): end every compile
                    if message[0] == "compile":
                        _, job, key = message
                        try:
                            children[job] = _fork_compile(server, info, key, settings)
                        except OSError as err:  # no memory or pids left for a child
                            server.send(("done", job, pickle.dumps((
                                "error", f"structured_outputs.{key[0]} could not be compiled:"
                                f" no process could be started for it ({err})"))))
                            continue
                        server.send(("started", job, children[job][0]))
                    elif message[0] == "kill" and message[1] in children:
                        os.kill(children[message[1]][0], signal.SIGKILL)
                else:
                    job = ends[ready]
                    try:
                        result = ready.recv_bytes()
                    except (EOFError, OSError):
                        result = None  # killed, or died (out of memory, say)
                    pid, end = children.pop(job)
                    end.close()
                    os.waitpid(pid, 0)
                    server.send(("done", job, result))
    finally:
        for pid, _ in children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _main() -> None:
    from multiprocessing.connection import Connection

    serve(Connection(int(sys.argv[-1])))


if __name__ == "__main__":
    _main()
