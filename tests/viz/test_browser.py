"""A real browser draws the live KV-cache widget (issue 11).

The pipeline, all on loopback and bounded by one deadline (``TIME_BUDGET_S``):

1. build a small notebook with nbformat that runs the ``KVCacheView`` flow;
2. execute it with nbclient in a fresh ipykernel of this very interpreter (and this very
   ``llmlab``); nbclient stores the widgets' final state in the notebook's metadata;
3. export it with nbconvert's ``HTMLExporter`` (lab template) with that state embedded. The
   page's widget renderer (``@jupyter-widgets/html-manager``'s ``embed-amd.js``, which bundles
   the core widgets) and require.js normally come from a CDN, which neither CI nor a developer
   box here reaches: they are served from a local copy by an in-process HTTP server on
   127.0.0.1 (``.ci/run`` fetches them with ``npm pack`` into ``~/.cache/llmlab/widget-js``);
4. open the page in headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright's
   PyPI wheel; no browser download), with every non-loopback request aborted, wait for the
   grid's cells, and screenshot the widget's output area;
5. check the screenshot: enough saturated pixels, of at least two hues (blocks of two or more
   requests), and no widget placeholder or error text on the page.

Skips (with the reason) when Chromium, Playwright, the notebook tooling or the widget JS is
missing, unless ``LLMLAB_REQUIRE_BROWSER=1`` (as ``.ci/run`` sets), where it fails instead.
``LLMLAB_CHROMIUM`` names another Chromium binary; ``LLMLAB_WIDGET_JS_DIR`` another JS cache.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import pathlib
import re
import shutil
import sys
import threading
import time
import urllib.parse

import pytest

TIME_BUDGET_S = 120.0
REQUIRE_BROWSER = os.environ.get("LLMLAB_REQUIRE_BROWSER") == "1"
WIDGET_JS_DIR = pathlib.Path(
    os.environ.get("LLMLAB_WIDGET_JS_DIR")
    or pathlib.Path.home() / ".cache" / "llmlab" / "widget-js"
)
EMBED_JS = WIDGET_JS_DIR / "html-manager" / "dist" / "embed-amd.js"
REQUIRE_JS = WIDGET_JS_DIR / "requirejs" / "require.js"
FETCH_HINT = (
    "fetch it as .ci/run does: npm pack @jupyter-widgets/html-manager@1.0.15 requirejs@2.3.8, "
    f"then untar each package/ folder to {WIDGET_JS_DIR}/html-manager and .../requirejs"
)
# The flags the machine notes ask for: without the background-networking ones Chromium keeps
# dialing out (refused here). Playwright adds --headless, --no-sandbox and a fresh
# --user-data-dir of its own (it refuses one in args).
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Belt and braces for "loopback only": no host name but the loopback ones resolves.
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
]
PLACEHOLDERS = ("Loading widget", "Error displaying widget", "model not found", "Error rendering")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
VIEW_TAG = "kv-view"  # cell tag of the cell that displays the view; the template makes it a class
NUM_BLOCKS = 64

# The notebook (``{model}`` and ``{num_blocks}`` are filled in). Cell 3 is the flow: the grid follows
# generate() live. When generate() returns every block is free again, so the state stored at
# the end would show an idle pool; cell 4 therefore leaves four requests with disjoint prompts
# (no shared prefix blocks) mid-decode, which freezes a frame with blocks of several owners in
# the stored state. The view throttles redraws while the engine is busy, so the cell redraws
# it once at the end. The model is the suite's tiny random Llama, not the built-in demo model:
# this checks the widget, and should not hang on which model the demo ships.
NOTEBOOK_CELLS = [
    (
        "from llmlab import LLM, SamplingParams\n"
        "from llmlab.viz import KVCacheView\n"
        "\n"
        "llm = LLM({model!r}, dtype='float32', num_gpu_blocks_override={num_blocks},\n"
        "          max_model_len=256, enable_prefix_caching=True)\n"
        "view = KVCacheView(llm)"
    ),
    "view.display()",
    (
        "outs = llm.generate(['Once upon a time'] * 4, SamplingParams(max_tokens=40), "
        "use_tqdm=False)\n"
        "assert len(outs) == 4"
    ),
    (
        "engine = llm.llm_engine\n"
        "for i in range(4):\n"
        "    tokens = [10 + 100 * i + j for j in range(20 + 10 * i)]\n"
        "    params = SamplingParams(max_tokens=200, ignore_eos=True)\n"
        "    engine.add_request(f'held-{{i}}', {{'prompt_token_ids': tokens}}, params)\n"
        "for _ in range(6):\n"
        "    engine.step()\n"
        "view.refresh()\n"
        "held = {{r: len(t) for r, t in engine.snapshot().kv.block_tables.items()}}\n"
        "assert sorted(held) == [f'held-{{i}}' for i in range(4)], held\n"
        "print('blocks held:', held)"
    ),
]
# The grid's screenshot must show at least this many saturated (palette) pixels, and at least
# two hues with this many each: a few 10 px cells of two or more requests.
MIN_SATURATED_PX = 300
MIN_PX_PER_HUE = 60


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, floor: float = 1.0) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            pytest.fail(f"the browser check ran past its {TIME_BUDGET_S:.0f} s budget")
        return max(left, floor)

    def ms(self) -> float:
        return self.left() * 1000.0


def _unavailable(reason: str) -> None:
    if REQUIRE_BROWSER:
        pytest.fail(f"{reason} (LLMLAB_REQUIRE_BROWSER=1, so this is a failure, not a skip)")
    pytest.skip(reason)


def _find_chromium() -> str | None:
    named = os.environ.get("LLMLAB_CHROMIUM")
    if named:
        return named if os.access(named, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _check_prerequisites() -> str:
    missing = [
        mod
        for mod in ("nbformat", "nbclient", "nbconvert", "ipykernel", "playwright", "PIL", "numpy")
        if importlib.util.find_spec(mod) is None
    ]
    if missing:
        _unavailable(f"python packages missing: {', '.join(missing)} (pip install -e '.[dev]')")
    chromium = _find_chromium()
    if chromium is None:
        _unavailable("no Chromium: apt-get install -y --no-install-recommends chromium")
    for path in (EMBED_JS, REQUIRE_JS):
        if not path.is_file():
            _unavailable(f"widget JS missing: {path}; {FETCH_HINT}")
    return chromium


def _build_notebook(model: str):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for i, source in enumerate(NOTEBOOK_CELLS):
        cell = nbformat.v4.new_code_cell(source.format(model=model, num_blocks=NUM_BLOCKS))
        if i == 1:
            cell.metadata["tags"] = [VIEW_TAG]
        nb.cells.append(cell)
    return nb


def _execute(nb, workdir: pathlib.Path, deadline: Deadline) -> None:
    """Run ``nb`` in a kernel of this interpreter that imports this checkout's ``llmlab``."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    import llmlab

    spec_dir = workdir / "kernels" / "llmlab-browser-test"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "llmlab browser test",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    km = AsyncKernelManager(
        kernel_name="llmlab-browser-test",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]),
    )
    env = dict(os.environ)
    src_root = str(pathlib.Path(llmlab.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src_root, env.get("PYTHONPATH")]))
    env.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    env["MPLBACKEND"] = "Agg"
    client = NotebookClient(
        nb,
        km=km,
        timeout_func=lambda cell: int(deadline.left()),
        startup_timeout=int(min(60.0, deadline.left())),
        store_widget_state=True,
        shutdown_kernel="immediate",
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        # cleanup_kc: nbclient stops the kernel on the way out even though it does not own km.
        client.execute(env=env, cleanup_kc=True)
    except CellExecutionError as err:
        pytest.fail(f"the notebook failed:\n{_ANSI_ESCAPE.sub('', str(err))}")
    finally:
        if km.has_kernel:  # only if nbclient's own cleanup did not get that far
            run_sync(km.shutdown_kernel)(now=True)


def _export(nb, site: pathlib.Path, base_url: str) -> pathlib.Path:
    from nbconvert import HTMLExporter

    shutil.copytree(EMBED_JS.parent, site / "html-manager" / "dist")
    shutil.copy(REQUIRE_JS, site / "require.js")
    (site / "noop.js").write_text("/* stands in for CDN scripts the page does not need */\n")
    exporter = HTMLExporter(template_name="lab")
    exporter.widget_renderer_url = f"{base_url}/html-manager/dist/embed-amd.js"
    exporter.require_js_url = f"{base_url}/require.js"
    for trait in ("mathjax_url", "mermaid_js_url", "mermaid_layout_elk_js_url"):
        if exporter.has_trait(trait):
            setattr(exporter, trait, f"{base_url}/noop.js")
    body, _ = exporter.from_notebook_node(nb)
    page = site / "index.html"
    page.write_text(body, encoding="utf-8")
    return page


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


def _saturated_hues(png: pathlib.Path) -> tuple[int, dict[int, int]]:
    """(number of saturated pixels, {15-degree hue bin: pixels}) of a screenshot."""
    import numpy as np
    from PIL import Image

    hsv = np.asarray(Image.open(png).convert("RGB").convert("HSV")).astype(int)
    hue, sat, val = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    mask = (sat >= 90) & (val >= 70)  # not white, gray or black: a palette color
    bins = (hue[mask] * 24) // 256
    counts = np.bincount(bins, minlength=24)
    return int(mask.sum()), {int(b): int(n) for b, n in enumerate(counts) if n}


@pytest.mark.slow
def test_kv_cache_view_is_drawn_in_headless_chromium(tmp_path, tiny_llama):
    chromium = _check_prerequisites()
    deadline = Deadline(TIME_BUDGET_S)
    started = time.monotonic()

    nb = _build_notebook(tiny_llama)
    workdir = tmp_path / "nb"
    workdir.mkdir()
    _execute(nb, workdir, deadline)
    executed = time.monotonic() - started
    assert "widgets" in nb.metadata, "nbclient stored no widget state"

    site = tmp_path / "site"
    site.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    shot = tmp_path / "kv_grid.png"
    page_shot = tmp_path / "page.png"
    blocked: list[str] = []
    console: list[str] = []
    try:
        base_url = f"http://127.0.0.1:{server.server_address[1]}"
        _export(nb, site, base_url)

        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright

        def loopback_only(route):
            host = urllib.parse.urlsplit(route.request.url).hostname
            if host in ("127.0.0.1", "localhost"):
                route.continue_()
            else:
                blocked.append(route.request.url)
                route.abort()

        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=chromium,
                headless=True,
                args=CHROMIUM_ARGS,
                timeout=deadline.ms(),
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 1000})
                page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
                page.on("pageerror", lambda err: console.append(f"pageerror: {err}"))
                page.route("**/*", loopback_only)
                page.goto(f"{base_url}/index.html", wait_until="load", timeout=deadline.ms())
                cells = f".celltag_{VIEW_TAG} .llmlab-kv-cell"
                try:
                    page.wait_for_selector(cells, timeout=min(deadline.ms(), 30_000))
                    page.wait_for_timeout(300)  # let fonts and layout settle
                    missing = None
                except PlaywrightError as err:
                    missing = err.message.splitlines()[0]
                if missing is not None:
                    page.screenshot(path=str(page_shot), full_page=True)
                    print(f"page screenshot: {page_shot}")
                    pytest.fail(
                        f"the grid never appeared ({missing}); page text: "
                        f"{page.inner_text('body')[-1500:]!r}; console: {console[-10:]}; "
                        f"blocked: {blocked[:10]}; page screenshot: {page_shot}"
                    )
                page.screenshot(path=str(page_shot), full_page=True)
                grid = page.locator(f".celltag_{VIEW_TAG} .llmlab-kv-grid").first
                grid.screenshot(path=str(shot), timeout=deadline.ms())
                text = page.inner_text("body")
                num_cells = page.locator(cells).count()
                colors = page.eval_on_selector_all(
                    cells, "els => els.map(e => getComputedStyle(e).backgroundColor)"
                )
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    print(
        f"screenshot: {shot} (whole page: {page_shot}); notebook executed in {executed:.1f} s, "
        f"total {time.monotonic() - started:.1f} s; non-loopback requests aborted: {blocked}"
    )
    where = f"(screenshot: {shot}; whole page: {page_shot})"
    shown = [p for p in PLACEHOLDERS if p.lower() in text.lower()]
    assert not shown, f"the page shows widget placeholder/error text {shown} {where}"
    assert num_cells >= NUM_BLOCKS, f"{num_cells} grid cells drawn for {NUM_BLOCKS} blocks {where}"
    assert len(set(colors)) >= 3, f"cells have only the colors {sorted(set(colors))} {where}"

    saturated, hues = _saturated_hues(shot)
    big_hues = {b: n for b, n in hues.items() if n >= MIN_PX_PER_HUE}
    assert saturated >= MIN_SATURATED_PX, (
        f"only {saturated} saturated pixels in the widget's screenshot: no colored cells drawn "
        f"{where}"
    )
    assert len(big_hues) >= 2, (
        f"colored pixels of only {len(big_hues)} hue(s) ({hues}): expected blocks of several "
        f"requests in different colors {where}"
    )
