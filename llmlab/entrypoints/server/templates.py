"""Request-level chat templates rendered in worker processes (``--trust-request-chat-template``).

A chat template is code: a loop of a loop holds a thread, and the GIL, for as long as it
likes, which starves the event loop and the engine even on a thread of its own, and a
thread cannot be stopped. So a template that comes with a request renders in one of a few
worker processes (spawned at the first such request, each holding a copy of the
tokenizer); one that runs past its time is ended by terminating its worker pool, which is
then started afresh. The server's own template is trusted and renders in-process.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from typing import Any

from llmlab.engine.inputs import render_chat

_TOKENIZER: Any = None  # in a worker process: its copy of the tokenizer
# An object's default repr ends " at 0x7f...>": what a template printing a function or a
# tokenizer object would hand back.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def _init_worker(tokenizer: Any) -> None:
    global _TOKENIZER
    _TOKENIZER = tokenizer


def _ping(_: int) -> bool:
    return True


def _render(messages, template, add_generation_prompt, continue_final_message, kwargs,
            max_chars) -> dict:
    rendered = render_chat(
        _TOKENIZER, messages, chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=kwargs, max_chars=max_chars,
    )[0]
    text = rendered["prompt"]
    scrubbed = _ADDRESS.sub(" at 0x...>", text)
    if scrubbed != text:  # a template printed an object: no addresses leave the worker
        bos = getattr(_TOKENIZER, "bos_token", None)  # as render_chat encodes it
        ids = _TOKENIZER.encode(scrubbed, add_special_tokens=not (bos and scrubbed.startswith(bos)))
        rendered = {"prompt": scrubbed, "prompt_token_ids": list(ids)}
    return rendered


class TemplateTimeout(Exception):
    """A template ran past its time; its worker processes were terminated."""


class TemplateProcesses:
    """A pool of ``workers`` processes that render chat templates with a hard time limit."""

    def __init__(self, tokenizer: Any, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.workers = workers
        self._pool = None
        self._lock = threading.Lock()

    def render(self, timeout_s: float, messages, template, add_generation_prompt,
               continue_final_message, kwargs, max_chars) -> dict:
        """``render_chat``'s result for one conversation, from a worker; its errors are
        raised here; :class:`TemplateTimeout` after ``timeout_s``."""
        pool = self._get()
        result = pool.apply_async(_render, (messages, template, add_generation_prompt,
                                            continue_final_message, kwargs, max_chars))
        try:
            return result.get(timeout_s)
        except multiprocessing.TimeoutError:
            self._end(pool)
            raise TemplateTimeout from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.terminate()
            pool.join()

    def _get(self):
        with self._lock:
            if self._pool is None:
                context = multiprocessing.get_context("spawn")
                pool = context.Pool(self.workers, initializer=_init_worker,
                                    initargs=(self.tokenizer,))
                # Started before any render is timed: a worker's start (importing the
                # tokenizer's libraries) is not the template's time.
                pool.map(_ping, range(self.workers), chunksize=1)
                self._pool = pool
            return self._pool

    def _end(self, pool) -> None:
        """Terminate a pool whose template ran too long (renders still in it fail by
        their own deadlines); the next render starts a fresh one."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        pool.terminate()
        pool.join()
