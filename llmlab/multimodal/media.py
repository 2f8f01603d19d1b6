"""Images from what users send: PIL images, arrays, bytes, data URLs, local files, http(s).

:func:`load_image` turns any accepted form into a decoded RGB ``PIL.Image.Image`` or raises a
:class:`MediaError` (a ``ValueError``) whose message starts with the request field it came
from (``messages[0].content[1].image_url.url``, ``multi_modal_data.image[2]``), shows the
value (truncated) and says what is allowed, so the server answers 400 naming it.

The hard edges, all checked before pixels are allocated:

- encoded size: bytes, data URLs, files and fetched bodies above ``limits.max_encoded_bytes``
  are refused before decoding (a data URL by its base64 length, a file by ``stat``);
- formats: only ``limits.formats`` are tried (PNG, JPEG, WebP, GIF, BMP by default), so
  PIL's rarer decoders (EPS calls Ghostscript) never see user bytes;
- decompression bombs: ``PIL.Image.open`` is lazy and reads only the header, so the declared
  ``width * height`` is compared with ``limits.max_pixels`` before ``load()`` decodes
  anything. PIL's own process-wide ``Image.MAX_IMAGE_PIXELS`` is read, never changed (a
  server decodes on several threads at once); its ``DecompressionBombError`` for a header
  past twice that limit is reported like ours;
- corrupt or truncated data: the full decode runs inside a ``try``
  (``ImageFile.LOAD_TRUNCATED_IMAGES`` stays False), so bad bytes raise here, not later;
- local files: only with ``allowed_local_media_path``; the path is resolved (symlinks
  followed, ``..`` collapsed) and must lie inside the resolved allowed directory;
- http(s): only through an injected ``fetch(url) -> bytes``
  (:class:`llmlab.multimodal.fetch.HttpFetcher` for the server, with size, time, redirect
  and host limits); without one, a URL is refused.

PIL is imported inside the functions, so ``import llmlab`` does not need it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pathlib
import re
import stat
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

# The formats tried on user bytes (PIL's format names). Each is a common web image format
# whose decoder is built into Pillow; TIFF, EPS, PSD and the rest are left out on purpose.
DEFAULT_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")

Fetch = Callable[[str], bytes]
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class MediaError(ValueError):
    """A media input that cannot be used; ``field`` is the request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def shown(value: Any, max_chars: int = 80) -> str:
    """A short description of ``value`` for an error message (never the whole payload)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        head = bytes(value[:16])
        return f"{len(value)} bytes starting {head!r}"
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, (str, os.PathLike)):
        text = repr(os.fspath(value))
        return text if len(text) <= max_chars else f"{text[:max_chars]}... ({len(text)} chars)"
    if type(value).__module__.startswith("PIL."):
        mode, size = getattr(value, "mode", "?"), getattr(value, "size", "?")
        return f"PIL image of mode {mode} and size {size}"
    text = repr(value)
    text = text if len(text) <= max_chars else f"{text[:max_chars]}..."
    return f"{type(value).__name__} {text}"


def _positive_int(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _formats(value) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) and v for v in value) or not value:
        raise ValueError(f"formats must be a non-empty sequence of PIL format names, got {value!r}")
    return tuple(v.upper() for v in value)


@attrs.frozen
class MediaLimits:
    """What one image may cost before it is refused.

    Attributes:
        max_encoded_bytes: the largest encoded image (bytes, data URL payload, file, fetched
            body); 20 MiB by default, the size OpenAI's API documents for an image.
        max_pixels: the largest ``width * height``, checked from the header before decoding;
            32 Mi pixels by default (about 5,800 x 5,800; decoded RGB is 3 bytes a pixel).
        formats: the PIL formats tried, in order.
    """

    max_encoded_bytes: int = attrs.field(default=20 * 2**20, validator=_positive_int)
    max_pixels: int = attrs.field(default=32 * 2**20, validator=_positive_int)
    formats: tuple[str, ...] = attrs.field(default=DEFAULT_FORMATS, converter=_formats)


def load_image(
    source: Any,
    *,
    field: str,
    allowed_local_media_path: str | os.PathLike | None = None,
    fetch: Fetch | None = None,
    limits: MediaLimits = MediaLimits(),
):
    """Decode one image input into an RGB ``PIL.Image.Image``.

    ``source`` may be a PIL image, a numpy array (``HxW`` grayscale or ``HxWxC`` with 1, 3 or
    4 channels; ``uint8``, or floating point in ``[0, 1]``), encoded bytes, a
    ``data:image/...;base64,...`` URL, a ``file://`` URL or local path (only under
    ``allowed_local_media_path``) or an ``http(s)://`` URL (only through ``fetch``). An alpha
    channel is dropped, not composited; an animated GIF or WebP gives its first frame; EXIF
    orientation is not applied. A new image is returned; ``source`` is not changed.

    Raises:
        MediaError: anything not accepted; the message starts with ``field``.
    """
    from PIL import Image

    if isinstance(source, Image.Image):
        return _from_pil(source, field, limits)
    if isinstance(source, np.ndarray):
        return _from_array(source, field, limits)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image_bytes(bytes(source), field=field, limits=limits)
    if isinstance(source, os.PathLike):
        return _from_local(os.fspath(source), field, allowed_local_media_path, limits)
    if not isinstance(source, str):
        raise MediaError(field, f"{field} must be a PIL image, a numpy array, bytes or a URL "
                                f"string (data:, file:, http(s):), got {shown(source)}")
    match = _SCHEME.match(source)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        return decode_image_bytes(_data_url_bytes(source, field, limits), field=field,
                                  limits=limits, value=source)
    if scheme in ("http", "https"):
        return _from_http(source, field, fetch, limits)
    if scheme == "file":
        return _from_local(_file_url_path(source, field), field, allowed_local_media_path,
                           limits, value=source)
    if scheme:
        raise MediaError(field, f"{field} must be a data:, file:, http: or https: URL or a "
                                f"local path, got scheme {scheme!r} in {shown(source)}")
    return _from_local(source, field, allowed_local_media_path, limits)


def decode_image_bytes(data: bytes, *, field: str, limits: MediaLimits = MediaLimits(),
                       value: Any = None):
    """Decode encoded image bytes into RGB, refusing oversized, unknown, corrupt and
    truncated data and headers that declare more than ``limits.max_pixels`` pixels.
    ``value`` is what the error messages show (the bytes themselves by default)."""
    from PIL import Image

    what = shown(data if value is None else value)
    if len(data) > limits.max_encoded_bytes:
        raise MediaError(field, f"{field} must be an encoded image of at most "
                                f"{limits.max_encoded_bytes} bytes, got {len(data)} bytes ({what})")
    try:
        # Lazy: reads the header only (PIL raises DecompressionBombError itself for a header
        # past twice its own MAX_IMAGE_PIXELS, before ours is compared).
        with Image.open(io.BytesIO(data), formats=list(limits.formats)) as img:
            _check_pixels(img.size, field, limits, what)
            img.load()
            return img.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError as err:
        raise MediaError(field, f"{field} must be an image of at most {limits.max_pixels} "
                                f"pixels, got a header refused by PIL ({err}) ({what})") from None
    except Image.UnidentifiedImageError:
        raise MediaError(field, f"{field} must be an image in one of the formats "
                                f"{list(limits.formats)}, got undecodable data ({what})") from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as err:
        # Truncated or corrupt pixel data: "image file is truncated", "broken data stream"...
        raise MediaError(field, f"{field} must be a complete, valid image, got data that "
                                f"failed to decode: {err} ({what})") from None


def _check_pixels(size: tuple[int, int], field: str, limits: MediaLimits, what: str) -> None:
    width, height = size
    if width * height > limits.max_pixels:
        raise MediaError(field, f"{field} must be an image of at most {limits.max_pixels} "
                                f"pixels, got {width}x{height} = {width * height} ({what})")
    if width < 1 or height < 1:
        raise MediaError(field, f"{field} must be an image at least 1x1, got {width}x{height} "
                                f"({what})")


def _from_pil(img, field: str, limits: MediaLimits):
    from PIL import Image

    _check_pixels(img.size, field, limits, shown(img))
    try:
        img.load()  # a lazily opened image from the caller decodes here, inside the try
        return img.convert("RGB")  # always a new image, even from RGB
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as err:
        raise MediaError(field, f"{field} must be a complete, valid image, got a PIL image "
                                f"that failed to load: {err} ({shown(img)})") from None


def _from_array(array: np.ndarray, field: str, limits: MediaLimits):
    from PIL import Image

    allowed = ("a numpy array HxW or HxWxC (C in 1, 3, 4), uint8 or floating point in [0, 1]")
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise MediaError(field, f"{field} must be {allowed}, got {shown(array)}")
    height, width = array.shape[:2]
    _check_pixels((width, height), field, limits, shown(array))
    if array.dtype == np.uint8:
        pixels = array
    elif array.dtype.kind == "f":
        if not np.isfinite(array).all() or array.min() < 0.0 or array.max() > 1.0:
            raise MediaError(field, f"{field} must be {allowed}, got {shown(array)} with values "
                                    f"outside [0, 1] (min {array.min()}, max {array.max()})")
        pixels = np.rint(array.astype(np.float64) * 255.0).astype(np.uint8)
    else:
        raise MediaError(field, f"{field} must be {allowed}, got {shown(array)}")
    if pixels.ndim == 3 and pixels.shape[2] == 1:
        pixels = pixels[:, :, 0]
    mode = {2: "L", 3: "RGB", 4: "RGBA"}[pixels.ndim if pixels.ndim == 2 else pixels.shape[2]]
    return Image.fromarray(np.ascontiguousarray(pixels), mode=mode).convert("RGB")


def _data_url_bytes(url: str, field: str, limits: MediaLimits) -> bytes:
    """The payload of ``data:image/<type>;base64,<data>``, its size checked before decoding."""
    allowed = "a data URL of the form data:image/<type>;base64,<data>"
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError(field, f"{field} must be {allowed}, got no ',' in {shown(url)}")
    params = [p.strip().lower() for p in header[len("data:"):].split(";")]
    media_type = params[0]
    if not media_type.startswith("image/"):
        raise MediaError(field, f"{field} must be {allowed}, got media type "
                                f"{media_type or '(none)'!r} in {shown(url)}")
    if "base64" not in params[1:]:
        raise MediaError(field, f"{field} must be {allowed}, got a data URL that is not base64 "
                                f"({shown(url)})")
    # 4 base64 characters carry 3 bytes: refuse an oversized payload before decoding it.
    if len(payload) // 4 * 3 > limits.max_encoded_bytes + 3:
        raise MediaError(field, f"{field} must be an encoded image of at most "
                                f"{limits.max_encoded_bytes} bytes, got a data URL of about "
                                f"{len(payload) // 4 * 3} bytes ({shown(url)})")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise MediaError(field, f"{field} must be {allowed}, got invalid base64 ({err}) in "
                                f"{shown(url)}") from None


def _file_url_path(url: str, field: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
        raise MediaError(field, f"{field} must be a file URL of the form file:///absolute/path, "
                                f"got {shown(url)}")
    return urllib.parse.unquote(parsed.path)


def _from_local(path: str, field: str, allowed: str | os.PathLike | None,
                limits: MediaLimits, value: Any = None):
    what = shown(path if value is None else value)
    if allowed is None:
        raise MediaError(field, f"{field} must not be a local file unless the engine is started "
                                f"with allowed_local_media_path, got {what}")
    # A configuration error (the engine should have checked it at start): named as such.
    root = pathlib.Path(allowed).resolve()
    if not root.is_dir():
        raise MediaError("allowed_local_media_path",
                         f"allowed_local_media_path must be an existing directory, got "
                         f"{os.fspath(allowed)!r}")
    try:
        # resolve() follows every symlink and collapses "..", so what is checked is the real
        # file that will be opened; relative paths are taken from the allowed directory.
        real = (root / path).resolve(strict=True)
    except (OSError, RuntimeError) as err:  # missing, or a symlink loop
        raise MediaError(field, f"{field} must name an existing file under "
                                f"allowed_local_media_path {str(root)!r}, got {what} "
                                f"({type(err).__name__})") from None
    if not real.is_relative_to(root):
        raise MediaError(field, f"{field} must name a file under allowed_local_media_path "
                                f"{str(root)!r}, got {what} (resolves outside it)")
    try:
        # O_NOFOLLOW: a symlink swapped in after resolve() is refused, not followed.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise MediaError(field, f"{field} must name a regular file, got {what}")
            if info.st_size > limits.max_encoded_bytes:
                raise MediaError(field, f"{field} must be an encoded image of at most "
                                        f"{limits.max_encoded_bytes} bytes, got a file of "
                                        f"{info.st_size} bytes ({what})")
            with open(fd, "rb", closefd=False) as file:
                data = file.read(limits.max_encoded_bytes + 1)
        finally:
            os.close(fd)
    except OSError as err:
        raise MediaError(field, f"{field} must name a readable file, got {what} "
                                f"({type(err).__name__})") from None
    return decode_image_bytes(data, field=field, limits=limits,
                              value=path if value is None else value)


def _from_http(url: str, field: str, fetch: Fetch | None, limits: MediaLimits):
    if fetch is None:
        raise MediaError(field, f"{field} must be a data: URL here; fetching http(s) URLs is "
                                f"disabled (the server enables it with a flag), got {shown(url)}")
    try:
        data = fetch(url)
    except (ValueError, OSError) as err:
        raise MediaError(field, f"{field} could not be fetched: {err} ({shown(url)})") from None
    return decode_image_bytes(data, field=field, limits=limits, value=url)
