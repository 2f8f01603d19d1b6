"""load_image: every accepted form gives the same pixels; every bad one is refused with its
field named, before pixels are allocated where the input is too big; HttpFetcher's limits
against a local HTTP server (no network)."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from llmlab.multimodal import (
    FetchError,
    HttpFetcher,
    MediaError,
    MediaLimits,
    decode_image_bytes,
    load_image,
)

FIELD = "multi_modal_data.image[2]"


@pytest.fixture(scope="module")
def pixels() -> np.ndarray:
    """The reference: random HxWx3 uint8 (odd sizes, so width and height cannot swap)."""
    return np.random.default_rng(0).integers(0, 256, size=(13, 17, 3), dtype=np.uint8)


def encode(array: np.ndarray, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def as_array(image) -> np.ndarray:
    assert image.mode == "RGB"
    return np.asarray(image)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares ``width x height`` 8-bit RGB and holds no pixel data (~60 bytes)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b"")


def png_of_zeros(width: int, height: int) -> bytes:
    """A real, valid grayscale PNG of zeros, written row by row: it compresses about 1000:1,
    so a few tens of kilobytes decode to ``width * height`` pixels."""
    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)  # filter byte + pixels
    body = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", body)
            + png_chunk(b"IEND", b""))


@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if any image's pixel data is decoded (what a bomb check must prevent)."""
    def refuse(self):
        raise AssertionError(f"pixels of a {self.size} image were decoded")
    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


def refused(source, match: str, field: str = FIELD, **kwargs) -> MediaError:
    with pytest.raises(MediaError, match=match) as info:
        load_image(source, field=field, **kwargs)
    assert str(info.value).startswith(field) and info.value.field == field
    assert isinstance(info.value, ValueError)
    return info.value


# --- accepted forms round-trip to the same pixels -------------------------------------------

def test_pil_images_of_every_common_mode_round_trip(pixels):
    rgb = Image.fromarray(pixels)
    out = load_image(rgb, field=FIELD)
    assert out is not rgb and np.array_equal(as_array(out), pixels)
    rgba = np.dstack([pixels, np.full(pixels.shape[:2], 7, np.uint8)])
    assert np.array_equal(as_array(load_image(Image.fromarray(rgba), field=FIELD)), pixels)
    gray = pixels[:, :, 0]
    assert np.array_equal(as_array(load_image(Image.fromarray(gray), field=FIELD)),
                          np.repeat(gray[:, :, None], 3, axis=2))


def test_numpy_arrays_round_trip(pixels):
    gray = pixels[:, :, 1]
    cases = {
        "HWC uint8": (pixels, pixels),
        "HWC4 uint8 (alpha dropped)": (np.dstack([pixels, gray]), pixels),
        "HW uint8": (gray, np.repeat(gray[:, :, None], 3, axis=2)),
        "HW1 uint8": (gray[:, :, None], np.repeat(gray[:, :, None], 3, axis=2)),
        "HWC float32 in [0, 1]": (pixels.astype(np.float32) / 255, pixels),
        "HWC float64 in [0, 1]": (pixels / 255.0, pixels),
        "non-contiguous view": (pixels[:, ::-1], pixels[:, ::-1]),
    }
    for name, (array, expected) in cases.items():
        assert np.array_equal(as_array(load_image(array, field=FIELD)), expected), name


def test_encoded_bytes_and_data_urls_round_trip(pixels):
    for fmt, options in [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True}), ("GIF", {})]:
        source = pixels if fmt != "GIF" else pixels // 64 * 64  # GIF: at most 256 colours
        data = encode(source, fmt, **options)
        for form in (data, bytearray(data), memoryview(data),
                     data_url(data, f"image/{fmt.lower()}")):
            assert np.array_equal(as_array(load_image(form, field=FIELD)), source), fmt
    # JPEG is lossy: the same pixels as PIL's own decode, and close to the original.
    jpeg = encode(pixels, "JPEG", quality=95)
    out = as_array(load_image(data_url(jpeg, "image/jpeg"), field=FIELD))
    assert np.array_equal(out, np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")))
    # a data URL's base64 may be wrapped over lines, and its media type in any case
    lines = base64.encodebytes(encode(pixels)).decode().split()
    wrapped = "data:IMAGE/PNG;base64," + "\n".join(lines)
    assert np.array_equal(as_array(load_image(wrapped, field=FIELD)), pixels)


def test_local_files_round_trip_under_the_allowed_directory(tmp_path, pixels):
    allowed = tmp_path / "media dir"
    (allowed / "sub").mkdir(parents=True)
    path = allowed / "sub" / "a b.png"
    path.write_bytes(encode(pixels))
    (allowed / "link.png").symlink_to(path)  # a symlink that stays inside is fine
    forms = [path, str(path), f"file://{path}", "file://" + str(path).replace(" ", "%20"),
             f"file://localhost{path}", "sub/a b.png",
             str(allowed / "sub" / ".." / "sub" / "a b.png"),
             allowed / "link.png"]
    for form in forms:
        out = load_image(form, field=FIELD, allowed_local_media_path=allowed)
        assert np.array_equal(as_array(out), pixels), form


def test_http_urls_go_through_the_injected_fetch(pixels):
    asked = []

    def fetch(url: str) -> bytes:
        asked.append(url)
        return encode(pixels)

    out = load_image("https://example.com/cat.png", field=FIELD, fetch=fetch)
    assert np.array_equal(as_array(out), pixels) and asked == ["https://example.com/cat.png"]


# --- bad input: refused, the field named -----------------------------------------------------

def test_undecodable_corrupt_and_truncated_bytes_are_refused(pixels):
    refused(b"definitely not an image", "undecodable")
    png = encode(pixels)
    refused(png[: len(png) // 2], "failed to decode")
    # PIL opens TIFF, but it is not an allowed format
    refused(encode(pixels, "TIFF"), r"formats \['PNG', 'JPEG', 'WEBP', 'GIF', 'BMP'\]")
    assert decode_image_bytes(encode(pixels, "TIFF"), field=FIELD,
                              limits=MediaLimits(formats=["tiff"])).size == (17, 13)


def test_data_urls_that_are_not_images_are_refused(pixels):
    refused(data_url(b"hello", "text/plain"), "media type 'text/plain'")
    refused("data:;base64,aGVsbG8=", r"media type '\(none\)'")
    refused(data_url(b"hello, not pixels"), "undecodable")
    refused("data:image/png;base64,@@@@", "invalid base64")
    refused("data:image/png," + encode(pixels).hex(), "not base64")
    refused("data:image/png;base64", "no ','")


def test_oversized_encodings_are_refused_before_decoding(pixels, no_decoding):
    limits = MediaLimits(max_encoded_bytes=100)
    png = encode(pixels)
    refused(png, f"at most 100 bytes, got {len(png)} bytes", limits=limits)
    refused(data_url(png), "at most 100 bytes, got a data URL", limits=limits)


def test_decompression_bombs_are_refused_from_the_header(no_decoding):
    pil_limit = Image.MAX_IMAGE_PIXELS
    # 10^10 pixels in 57 bytes: past PIL's own limit too
    tiny = png_header_only(100_000, 100_000)
    assert len(tiny) < 100
    err = refused(tiny, "at most 33554432 pixels")
    assert "decompression bomb" in str(err)
    # 36M pixels: under PIL's limit, over ours; refused by our check
    refused(png_header_only(6000, 6000), "got 6000x6000 = 36000000")
    refused(data_url(png_header_only(6000, 6000)), "got 6000x6000")
    # a real, complete, highly compressible PNG: 36M pixels in ~40 kB
    zeros = png_of_zeros(6000, 6000)
    assert len(zeros) < 100_000
    refused(zeros, "got 6000x6000")
    refused(png_of_zeros(300, 200), "got 300x200 = 60000", limits=MediaLimits(max_pixels=50_000))
    assert Image.MAX_IMAGE_PIXELS == pil_limit  # PIL's process-wide limit was never touched


def test_a_compressible_png_under_the_limit_decodes():
    out = load_image(png_of_zeros(300, 200), field=FIELD)
    assert out.size == (300, 200) and not np.asarray(out).any()


def test_bad_arrays_and_oversized_images_are_refused(pixels):
    refused(np.zeros((2, 3, 4, 3), np.uint8), r"HxW or HxWxC.*shape \(2, 3, 4, 3\)")
    refused(np.zeros((4, 4, 2), np.uint8), r"shape \(4, 4, 2\)")
    refused(np.zeros((4, 4, 3), np.int32), "dtype int32")
    refused(np.zeros((4, 4), bool), "dtype bool")
    refused(np.full((4, 4, 3), 1.5), r"outside \[0, 1\]")
    refused(np.full((4, 4, 3), np.nan), r"outside \[0, 1\]")
    refused(np.full((4, 4, 3), -0.1, np.float32), r"outside \[0, 1\]")
    small = MediaLimits(max_pixels=100)
    refused(pixels, "got 17x13 = 221", limits=small)
    refused(Image.fromarray(pixels), "got 17x13 = 221", limits=small)
    refused(np.zeros((0, 5, 3), np.uint8), "at least 1x1")


def test_other_types_and_schemes_are_refused():
    refused(42, "got int 42")
    refused(None, "got NoneType None")
    refused({"url": "x"}, "PIL image, a numpy array, bytes or a URL")
    refused("ftp://example.com/a.png", "got scheme 'ftp'")
    refused("javascript:alert(1)", "got scheme 'javascript'")
    # a long value is shown truncated, never whole
    err = refused("gopher://" + "x" * 10_000, "got scheme 'gopher'")
    assert len(str(err)) < 400


def test_http_urls_are_refused_without_a_fetcher_and_fetch_errors_name_the_field():
    refused("http://example.com/a.png", "fetching http\\(s\\) URLs is disabled")

    def failing(url):
        raise FetchError("HTTP 404 Not Found")

    refused("https://example.com/a.png", "could not be fetched: HTTP 404", fetch=failing)
    refused("https://example.com/a.png", "undecodable", fetch=lambda url: b"<html>")


def test_local_files_need_the_allowed_directory_and_must_stay_inside_it(tmp_path, pixels):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    secret = outside / "secret.png"
    secret.write_bytes(encode(pixels))
    inside = allowed / "ok.png"
    inside.write_bytes(encode(pixels))
    refused(str(inside), "unless the engine is started with allowed_local_media_path")
    refused(f"file://{inside}", "unless the engine is started with allowed_local_media_path")
    kw = {"allowed_local_media_path": str(allowed)}
    refused(str(secret), "resolves outside it", **kw)
    refused(f"file://{secret}", "resolves outside it", **kw)
    refused(str(allowed / ".." / "outside" / "secret.png"), "resolves outside it", **kw)
    refused("../outside/secret.png", "resolves outside it", **kw)
    (allowed / "escape.png").symlink_to(secret)
    refused(str(allowed / "escape.png"), "resolves outside it", **kw)
    (allowed / "escape_dir").symlink_to(outside, target_is_directory=True)
    refused(str(allowed / "escape_dir" / "secret.png"), "resolves outside it", **kw)
    (allowed / "loop").symlink_to(allowed / "loop")
    refused(str(allowed / "loop"), "must name an existing file", **kw)
    refused(str(allowed / "missing.png"), "must name an existing file", **kw)
    refused(str(allowed), "must name a regular file", **kw)
    refused(f"file://otherhost{inside}", "file:///absolute/path", **kw)
    refused(str(inside), "a file of", limits=MediaLimits(max_encoded_bytes=10), **kw)
    (allowed / "text.png").write_text("hello")
    refused(str(allowed / "text.png"), "undecodable", **kw)
    for bad_root in (tmp_path / "nope", inside):
        with pytest.raises(MediaError, match="allowed_local_media_path must be an existing dir"):
            load_image(str(inside), field=FIELD, allowed_local_media_path=bad_root)


def test_limits_are_checked_at_construction():
    for kwargs, match in [({"max_pixels": 0}, "max_pixels must be an int >= 1, got 0"),
                          ({"max_encoded_bytes": 1.5}, "max_encoded_bytes must be an int"),
                          ({"formats": []}, "formats must be a non-empty"),
                          ({"formats": "PNG"}, "formats must be a non-empty")]:
        with pytest.raises(ValueError, match=match):
            MediaLimits(**kwargs)
    for kwargs, match in [({"max_bytes": 0}, "max_bytes must be an int >= 1"),
                          ({"timeout_s": 0}, "timeout_s must be a number > 0"),
                          ({"max_redirects": -1}, "max_redirects must be an int >= 0")]:
        with pytest.raises(ValueError, match=match):
            HttpFetcher(**kwargs)


def test_importing_the_package_does_not_import_pil():
    code = "import sys, llmlab.multimodal; assert 'PIL' not in sys.modules, 'PIL imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- HttpFetcher against a local server ----------------------------------------------------

class _Handler(http.server.BaseHTTPRequestHandler):
    png = b""
    release = threading.Event()  # set at teardown: wakes the slow handlers

    def log_message(self, *args):  # keep the test output quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str = "image/png",
              headers: dict | None = None, length: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length:
            self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        path = self.path
        if path == "/ok.png":
            self._send(200, self.png)
        elif path == "/big.png":
            self._send(200, b"\0" * 5000)
        elif path == "/big-unsized.png":  # no Content-Length: only reading can find out
            self._send(200, b"\0" * 5000, length=False)
        elif path.startswith("/hop/"):
            left = int(path.rsplit("/", 1)[1])
            self._send(302, b"", "text/plain",
                       {"Location": f"/hop/{left - 1}" if left > 1 else "/ok.png"})
        elif path == "/loop-a":
            self._send(302, b"", "text/plain", {"Location": "/loop-b"})
        elif path == "/loop-b":
            self._send(301, b"", "text/plain", {"Location": "/loop-a"})
        elif path == "/to-ftp":
            self._send(302, b"", "text/plain", {"Location": "ftp://127.0.0.1/a.png"})
        elif path == "/slow-headers":
            self.release.wait(5)
            self._send(200, self.png)
        elif path == "/slow-body":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(self.png[:10])
            self.wfile.flush()
            self.release.wait(5)
        elif path == "/cut.png":  # promises 3000 bytes, sends 10, hangs up
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", "3000")
            self.end_headers()
            self.wfile.write(self.png[:10])
        elif path == "/page.html":
            self._send(200, b"<html>hi</html>", "text/html; charset=utf-8")
        elif path == "/fake.png":
            self._send(200, b"<html>not really</html>")
        else:
            self._send(404, b"missing", "text/plain")


@pytest.fixture(scope="module")
def server(pixels):
    _Handler.png = encode(pixels)
    _Handler.release.clear()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _Handler.release.set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


def test_fetcher_gets_an_image_and_follows_redirects_up_to_the_limit(server, pixels):
    fetcher = HttpFetcher(max_bytes=4096, timeout_s=5.0, max_redirects=3)
    assert fetcher(f"{server}/ok.png") == _Handler.png
    out = load_image(f"{server}/hop/3", field=FIELD, fetch=fetcher)
    assert np.array_equal(as_array(out), pixels)
    with pytest.raises(FetchError, match="more than max_redirects=3 redirects"):
        fetcher(f"{server}/hop/4")
    with pytest.raises(FetchError, match="more than max_redirects=0"):
        HttpFetcher(max_redirects=0)(f"{server}/hop/1")


def test_fetcher_refuses_loops_size_type_and_bad_targets(server):
    fetcher = HttpFetcher(max_bytes=4096, timeout_s=5.0, max_redirects=10)
    cases = [("/loop-a", "redirect loop"),
             ("/big.png", "Content-Length 5000, more than max_bytes=4096"),
             ("/big-unsized.png", "sent more than max_bytes=4096"),
             ("/page.html", "Content-Type 'text/html'; an image/\\* type is required"),
             ("/to-ftp", "only http\\(s\\) URLs"),
             ("/cut.png", "got 10 of its Content-Length 3000 bytes"),
             ("/nothing-here", "HTTP 404")]
    for path, match in cases:
        with pytest.raises(FetchError, match=match):
            fetcher(f"{server}{path}")
    with pytest.raises(FetchError, match="not in allowed_hosts"):
        HttpFetcher(allowed_hosts=["images.example.com"])(f"{server}/ok.png")
    assert HttpFetcher(allowed_hosts=["127.0.0.1"])(f"{server}/ok.png") == _Handler.png
    # the body says image/png but is not one: refused when decoded, with the field named
    refused(f"{server}/fake.png", "undecodable", fetch=fetcher)
    refused(f"{server}/page.html", "could not be fetched: .*Content-Type", fetch=fetcher)


def test_fetcher_times_out_waiting_for_headers_or_body(server):
    fetcher = HttpFetcher(timeout_s=0.3)
    for path in ("/slow-headers", "/slow-body"):
        with pytest.raises(FetchError, match=r"timed out after timeout_s=0.3 s"):
            fetcher(f"{server}{path}")


def test_fetcher_ignores_proxy_variables_unless_told(server, monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens on port 9
    monkeypatch.setenv("no_proxy", "")
    assert HttpFetcher(timeout_s=5.0)(f"{server}/ok.png") == _Handler.png
    with pytest.raises(FetchError, match="could not fetch"):
        HttpFetcher(timeout_s=5.0, trust_env=True)(f"{server}/ok.png")

