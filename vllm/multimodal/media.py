"""Images named by URL in chat messages (`image_url` parts), read under the server's rules
(`MediaConnector`):

| URL                      | read when                                 | limits                    |
|--------------------------|-------------------------------------------|---------------------------|
| `data:image/...;base64,` | always                                    | `max_bytes` decoded       |
| `file:///abs/path`       | under `allowed_local_media_path` only     | a regular file, max_bytes |
| `http://`, `https://`    | host in `allowed_media_domains` only      | max_bytes, fetch_timeout  |

Anything else is refused with a `ValueError` naming the problem. A fetch follows no
redirect and goes through no proxy; its whole duration (connect, headers, body) is bounded
by `fetch_timeout` (vLLM's `VLLM_IMAGE_FETCH_TIMEOUT`, 5 s by default).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import os
import stat
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from vllm.multimodal.image import MAX_IMAGE_BYTES

FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT = 5.0  # seconds, vLLM's default
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class MediaConnector:
    """Reads the encoded image an `image_url` part names, under the server's rules.

    Args:
        allowed_local_media_path: a directory whose files `file:` URLs may name ("": none).
        allowed_media_domains: hosts `http(s):` URLs may name (None: remote URLs refused).
        fetch_timeout: seconds a whole fetch may take.
        max_bytes: the most encoded bytes of one image.
    """

    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_bytes: int = MAX_IMAGE_BYTES

    @classmethod
    def from_model_config(cls, model_config: Any) -> MediaConnector:
        """The engine's rules (`allowed_local_media_path`, `allowed_media_domains`) and the
        environment's `VLLM_IMAGE_FETCH_TIMEOUT`."""
        domains = model_config.allowed_media_domains
        return cls(allowed_local_media_path=model_config.allowed_local_media_path,
                   allowed_media_domains=None if domains is None else tuple(domains),
                   fetch_timeout=fetch_timeout_from_env())

    def image_bytes(self, url: object) -> bytes:
        """The encoded image `url` names; ValueError for anything refused.

        Example: "data:image/png;base64,iVBORw0KGgo..." -> b"\\x89PNG\\r\\n\\x1a\\n...".
        """
        if not isinstance(url, str) or not url:
            raise ValueError("An image_url part needs 'image_url': {'url': 'data:image/...'}.")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return _data_url_bytes(url, self.max_bytes)
        if scheme == "file":
            return self._file_bytes(url)
        if scheme in ("http", "https"):
            return self._fetch(url)
        raise ValueError(f"Image URLs with scheme {scheme or url[:16]!r} are not supported: "
                         "send the image inline as a data: URL (data:image/png;base64,...).")

    def _file_bytes(self, url: str) -> bytes:
        """A `file:` URL's bytes: its resolved path (symlinks and `..` followed) must lie
        inside `allowed_local_media_path` and be a regular file."""
        root = self.allowed_local_media_path
        if not root:
            raise ValueError("Local image files (file: URLs) are not read by this engine: "
                             "start it with --allowed-local-media-path DIR (offline: "
                             "LLM(allowed_local_media_path=DIR)) to allow files under DIR.")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"A file: URL names a file on this machine, not on host "
                             f"{parts.netloc!r}.")
        path = urllib.parse.unquote(parts.path)
        if not os.path.isabs(path) or "\x00" in path:
            raise ValueError("A file: URL needs an absolute path: file:///dir/image.png.")
        real_root = os.path.realpath(root)
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise ValueError(f"The file {path!r} is outside the allowed local media path "
                             f"{root!r} (after resolving symlinks and '..').")
        try:  # O_NONBLOCK: a FIFO put there cannot hang the open
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise ValueError(f"The image file {path!r} cannot be read: "
                             f"{e.strerror or e}.") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ValueError(f"{path!r} is not a regular file.")
        with os.fdopen(fd, "rb") as f:
            if info.st_size > self.max_bytes:
                raise ValueError(f"The image file {path!r} is {info.st_size} bytes, over the "
                                 f"limit of {self.max_bytes}.")
            data = f.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:
            raise ValueError(f"The image file {path!r} is over the limit of {self.max_bytes} "
                             "bytes.")
        return data

    def _fetch(self, url: str) -> bytes:
        """GET `url` (its host allowed), within `fetch_timeout` and `max_bytes`."""
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        domains = self.allowed_media_domains
        if domains is None:
            raise ValueError("Remote image URLs are not fetched by this engine unless "
                             "fetching is on: start it with --allowed-media-domains HOST ... "
                             "(offline: LLM(allowed_media_domains=[...])), or send the image "
                             "inline as a data: URL (data:image/png;base64,...).")
        if host not in (d.lower() for d in domains):
            raise ValueError(f"The image URL's host {host!r} is not in the allowed media "
                             f"domains ({', '.join(domains) or 'none'}).")
        deadline = time.monotonic() + self.fetch_timeout
        https = parts.scheme == "https"
        kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
        try:
            conn = kind(host, parts.port, timeout=self.fetch_timeout)
        except ValueError as e:  # a bad port
            raise ValueError(f"The image URL is malformed: {e}.") from None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", target, headers={"Accept": "image/*"})
            _set_deadline(conn, deadline)
            response = conn.getresponse()
            if response.status != 200:
                where = response.getheader("Location")
                moved = f" (redirected to {where}: send that URL)" if where else ""
                raise ValueError(f"Fetching the image URL failed: HTTP {response.status} "
                                 f"{response.reason}{moved}.")
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                raise ValueError(f"The image at the URL is {length} bytes, over the limit "
                                 f"of {self.max_bytes}.")
            return self._read_body(conn, response, deadline)
        except TimeoutError:
            raise ValueError(f"Fetching the image URL took longer than {self.fetch_timeout} s "
                             f"({FETCH_TIMEOUT_ENV}).") from None
        except (OSError, http.client.HTTPException) as e:
            raise ValueError(f"Fetching the image URL failed: {type(e).__name__}: "
                             f"{e}.") from None
        finally:
            conn.close()

    def _read_body(self, conn: http.client.HTTPConnection,
                   response: http.client.HTTPResponse, deadline: float) -> bytes:
        body = bytearray()
        while True:
            _set_deadline(conn, deadline)
            chunk = response.read1(_CHUNK)  # at most one socket read: the deadline holds
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > self.max_bytes:
                raise ValueError(f"The image at the URL is over the limit of "
                                 f"{self.max_bytes} bytes.")


def _set_deadline(conn: http.client.HTTPConnection, deadline: float) -> None:
    """The socket's timeout for its next operation: the time left before `deadline`."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)


def fetch_timeout_from_env() -> float:
    text = os.environ.get(FETCH_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_FETCH_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{FETCH_TIMEOUT_ENV} must be a positive number of seconds, got "
                         f"{text!r}.")
    return value


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The encoded image of a `data:image/...;base64,...` URL."""
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("An image data: URL must be base64: data:image/<type>;base64,<data>.")
    media_type = header[len("data:"):-len(";base64")].lower()
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"An image_url part's data: URL holds {media_type!r}, not an image.")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ValueError(f"The image in the data: URL is over the limit of {max_bytes} "
                         "bytes.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("The image data: URL is not valid base64.") from None
