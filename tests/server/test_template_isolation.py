"""Request chat templates cannot hold the server's own (issue 39, item 4): they render on
a pool and a budget of their own, so plain chats never wait behind template bombs."""

from __future__ import annotations

import asyncio

import httpx

from tests.server.conftest import running

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# A template that renders for seconds (Jinja loops), well past the 1 s budget below.
BOMB = ("{% set ns = namespace(n=0) %}{% for i in range(4000) %}{% for j in range(1000) %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}hi")


def test_plain_chats_do_not_wait_behind_request_template_bombs(tiny_llama):
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app

    engine = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    app = build_app(engine, served_model_names=["tiny"], trust_request_chat_template=True)
    serving = app.state.serving
    serving.template_timeout_s = 1.0
    serving._template_processes().render(5.0, MSG, None, True, False, None, 10_000)  # started

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bombs = [asyncio.create_task(client.post(CHAT, json={
                "messages": MSG, "chat_template": BOMB, "max_tokens": 2})) for _ in range(6)]
            await asyncio.sleep(0.3)  # the bombs hold every request-template worker
            plain = [await client.post(CHAT, json={"messages": MSG, "max_tokens": 2})
                     for _ in range(3)]
            # The plain chats were answered while the bombs still waited for theirs.
            pending = sum(not b.done() for b in bombs)
            return plain, pending, await asyncio.gather(*bombs)

    with running(app) as url:
        plain, pending, bombs = asyncio.run(main(url))
    assert all(r.status_code == 200 for r in plain), [r.text for r in plain]
    assert pending == 6
    assert all(r.status_code == 400 and "took longer than 1 s" in r.text for r in bombs)
