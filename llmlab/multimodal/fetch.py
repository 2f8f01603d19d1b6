"""``HttpFetcher``: the ``fetch(url) -> bytes`` the server hands to
:func:`llmlab.multimodal.media.load_image` when http(s) image URLs are enabled.

It uses ``urllib.request`` (no extra dependency) and follows redirects itself, so every hop
is counted and checked (scheme, host); a loop is refused at the first repeat. The body is
read in chunks against ``max_bytes`` and one deadline for the whole fetch.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import attrs


class FetchError(ValueError):
    """A URL :class:`HttpFetcher` would not or could not fetch; the message says why."""


def _positive_int(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _positive_number(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{attribute.name} must be a number > 0, got {value!r}")


def _non_negative_int(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Hand 3xx answers back to :meth:`HttpFetcher.__call__`, which follows them itself
    (counting hops and checking each target's scheme and host)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


@attrs.frozen
class HttpFetcher:
    """``fetch(url) -> bytes`` for http(s) image URLs, with hard limits.

    Attributes:
        max_bytes: the largest body; a larger ``Content-Length`` is refused before reading,
            and reading stops one byte past the limit.
        timeout_s: the whole fetch's deadline, redirects included (each socket operation
            waits at most what is left of it).
        max_redirects: redirects followed; a loop (a URL seen twice) is refused at once.
        allowed_hosts: host names that may be fetched (each redirect's target too), or
            ``None`` for any. Addresses are not filtered otherwise: a server reachable from
            untrusted clients should list its hosts, or it can be made to fetch internal URLs.
        trust_env: use the ``http_proxy``/``https_proxy`` environment variables.
    """

    max_bytes: int = attrs.field(default=20 * 2**20, validator=_positive_int)
    timeout_s: float = attrs.field(default=10.0, validator=_positive_number)
    max_redirects: int = attrs.field(default=3, validator=_non_negative_int)
    allowed_hosts: frozenset[str] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else frozenset(h.lower() for h in v))
    trust_env: bool = False

    def __call__(self, url: str) -> bytes:
        """The body at ``url``. Raises :class:`FetchError` naming the URL and the limit."""
        handlers: list[Any] = [_NoRedirect()]
        if not self.trust_env:
            handlers.append(urllib.request.ProxyHandler({}))
        opener = urllib.request.build_opener(*handlers)
        deadline = time.monotonic() + self.timeout_s
        seen: set[str] = set()
        for _ in range(self.max_redirects + 1):
            self._check_target(url)
            seen.add(url)
            target = self._get(opener, url, deadline)
            if isinstance(target, bytes):
                return target
            url = urllib.parse.urljoin(url, target)
            if url in seen:
                raise FetchError(f"redirect loop: {url!r} was already visited")
        raise FetchError(f"more than max_redirects={self.max_redirects} redirects "
                         f"(the last to {url!r})")

    def _check_target(self, url: str) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise FetchError(f"only http(s) URLs with a host may be fetched, got {url[:80]!r}")
        if self.allowed_hosts is not None and parsed.hostname.lower() not in self.allowed_hosts:
            raise FetchError(f"host {parsed.hostname!r} is not in allowed_hosts "
                             f"{sorted(self.allowed_hosts)}")

    def _get(self, opener, url: str, deadline: float) -> bytes | str:
        """The body, or a redirect's ``Location``."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise FetchError(f"timed out after timeout_s={self.timeout_s} s fetching {url!r}")
        request = urllib.request.Request(url, headers={"Accept": "image/*"})
        try:
            response = opener.open(request, timeout=left)
        except urllib.error.HTTPError as err:
            err.close()
            if err.code in (301, 302, 303, 307, 308) and err.headers.get("Location"):
                return err.headers["Location"]
            raise FetchError(f"HTTP {err.code} {err.reason} from {url!r}") from None
        except TimeoutError:
            raise FetchError(f"timed out after timeout_s={self.timeout_s} s fetching "
                             f"{url!r}") from None
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                raise FetchError(f"timed out after timeout_s={self.timeout_s} s fetching "
                                 f"{url!r}") from None
            raise FetchError(f"could not fetch {url!r}: {err.reason}") from None
        except (http.client.HTTPException, OSError) as err:  # a malformed or cut answer
            raise FetchError(f"could not fetch {url!r}: {type(err).__name__}: {err}") from None
        with response:
            content_type = response.headers.get_content_type()
            if not content_type.startswith("image/"):
                raise FetchError(f"{url!r} answered Content-Type {content_type!r}; an image/* "
                                 f"type is required")
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                raise FetchError(f"{url!r} has Content-Length {length}, more than "
                                 f"max_bytes={self.max_bytes}")
            body = self._read(response, url, deadline)
            if length is not None and length.isdigit() and len(body) != int(length):
                # http.client's read(n) returns a cut body quietly instead of raising
                raise FetchError(f"could not read {url!r}: got {len(body)} of its "
                                 f"Content-Length {length} bytes")
            return body

    def _read(self, response, url: str, deadline: float) -> bytes:
        chunks, size = [], 0
        try:
            while True:
                if time.monotonic() > deadline:
                    raise FetchError(f"timed out after timeout_s={self.timeout_s} s reading "
                                     f"{url!r}")
                chunk = response.read(min(65536, self.max_bytes + 1 - size))
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
                size += len(chunk)
                if size > self.max_bytes:
                    raise FetchError(f"{url!r} sent more than max_bytes={self.max_bytes} bytes")
        except TimeoutError:
            raise FetchError(f"timed out after timeout_s={self.timeout_s} s reading "
                             f"{url!r}") from None
        except (http.client.HTTPException, OSError) as err:
            raise FetchError(f"could not read {url!r}: {type(err).__name__}: {err}") from None
