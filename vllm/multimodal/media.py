"""Images and audio named by URL in chat messages (`image_url`, `audio_url` parts), read
under the server's rules (`MediaConnector`):

| URL                      | read when                                 | limits                    |
|--------------------------|-------------------------------------------|---------------------------|
| `data:image/...;base64,` | always (audio: `data:audio/...`)          | `max_bytes` decoded       |
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

from vllm.multimodal.audio import MAX_AUDIO_BYTES
from vllm.multimodal.image import MAX_IMAGE_BYTES

FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
DEFAULT_FETCH_TIMEOUT = 5.0  # seconds, vLLM's default
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class MediaConnector:
    """Reads the encoded image an `image_url` part names (or the audio file an `audio_url`
    part names), under the server's rules.

    Args:
        allowed_local_media_path: a directory whose files `file:` URLs may name ("": none).
        allowed_media_domains: hosts `http(s):` URLs may name (None: remote URLs refused).
        fetch_timeout: seconds a whole fetch may take.
        max_bytes: the most encoded bytes of one image.
        max_audio_bytes: the most encoded bytes of one audio file.
    """

    allowed_local_media_path: str = ""
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT
    max_bytes: int = MAX_IMAGE_BYTES
    max_audio_bytes: int = MAX_AUDIO_BYTES

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
        return self.media_bytes(url, "image")

    def audio_bytes(self, url: object) -> bytes:
        """The audio file `url` names ("data:audio/wav;base64,..."); ValueError for anything
        refused."""
        return self.media_bytes(url, "audio")

    def media_bytes(self, url: object, what: str) -> bytes:
        """The encoded `what` ("image" or "audio") that `url` names."""
        example = "data:image/png;base64,..." if what == "image" else "data:audio/wav;base64,..."
        if not isinstance(url, str) or not url:
            raise ValueError(f"An {what}_url part needs '{what}_url': {{'url': "
                             f"'data:{what}/...'}}.")
        limit = self.max_bytes if what == "image" else self.max_audio_bytes
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return _data_url_bytes(url, limit, what)
        if scheme == "file":
            return self._file_bytes(url, what, limit)
        if scheme in ("http", "https"):
            return self._fetch(url, what, limit)
        raise ValueError(f"{what.capitalize()} URLs with scheme {scheme or url[:16]!r} are not "
                         f"supported: send the {what} inline as a data: URL ({example}).")

    def _file_bytes(self, url: str, what: str, limit: int) -> bytes:
        """A `file:` URL's bytes: its resolved path (symlinks and `..` followed) must lie
        inside `allowed_local_media_path` and be a regular file."""
        root = self.allowed_local_media_path
        if not root:
            raise ValueError(f"Local {what} files (file: URLs) are not read by this engine: "
                             "start it with --allowed-local-media-path DIR (offline: "
                             "LLM(allowed_local_media_path=DIR)) to allow files under DIR.")
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"A file: URL names a file on this machine, not on host "
                             f"{parts.netloc!r}.")
        path = urllib.parse.unquote(parts.path)
        if not os.path.isabs(path) or "\x00" in path:
            raise ValueError("A file: URL needs an absolute path: file:///dir/name.ext.")
        real_root = os.path.realpath(root)
        real = os.path.realpath(path)
        if os.path.commonpath([real_root, real]) != real_root:
            raise ValueError(f"The file {path!r} is outside the allowed local media path "
                             f"{root!r} (after resolving symlinks and '..').")
        try:  # O_NONBLOCK: a FIFO put there cannot hang the open
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise ValueError(f"The {what} file {path!r} cannot be read: "
                             f"{e.strerror or e}.") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ValueError(f"{path!r} is not a regular file.")
        with os.fdopen(fd, "rb") as f:
            if info.st_size > limit:
                raise ValueError(f"The {what} file {path!r} is {info.st_size} bytes, over the "
                                 f"limit of {limit}.")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"The {what} file {path!r} is over the limit of {limit} "
                             "bytes.")
        return data

    def _fetch(self, url: str, what: str, limit: int) -> bytes:
        """GET `url` (its host allowed), within `fetch_timeout` and `limit` bytes."""
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        domains = self.allowed_media_domains
        if domains is None:
            raise ValueError(f"Remote {what} URLs are not fetched by this engine unless "
                             "fetching is on: start it with --allowed-media-domains HOST ... "
                             "(offline: LLM(allowed_media_domains=[...])), or send the "
                             f"{what} inline as a data: URL (data:{what}/...;base64,...).")
        if host not in (d.lower() for d in domains):
            raise ValueError(f"The {what} URL's host {host!r} is not in the allowed media "
                             f"domains ({', '.join(domains) or 'none'}).")
        deadline = time.monotonic() + self.fetch_timeout
        https = parts.scheme == "https"
        kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
        try:
            conn = kind(host, parts.port, timeout=self.fetch_timeout)
        except ValueError as e:  # a bad port
            raise ValueError(f"The {what} URL is malformed: {e}.") from None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", target, headers={"Accept": f"{what}/*"})
            _set_deadline(conn, deadline)
            response = conn.getresponse()
            if response.status != 200:
                where = response.getheader("Location")
                moved = f" (redirected to {where}: send that URL)" if where else ""
                raise ValueError(f"Fetching the {what} URL failed: HTTP {response.status} "
                                 f"{response.reason}{moved}.")
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise ValueError(f"The {what} at the URL is {length} bytes, over the limit "
                                 f"of {limit}.")
            return self._read_body(conn, response, deadline, what, limit)
        except TimeoutError:
            raise ValueError(f"Fetching the {what} URL took longer than {self.fetch_timeout} s "
                             f"({FETCH_TIMEOUT_ENV}).") from None
        except (OSError, http.client.HTTPException) as e:
            raise ValueError(f"Fetching the {what} URL failed: {type(e).__name__}: "
                             f"{e}.") from None
        finally:
            conn.close()

    def _read_body(self, conn: http.client.HTTPConnection,
                   response: http.client.HTTPResponse, deadline: float, what: str,
                   limit: int) -> bytes:
        body = bytearray()
        while True:
            _set_deadline(conn, deadline)
            chunk = response.read1(_CHUNK)  # at most one socket read: the deadline holds
            if not chunk:
                return bytes(body)
            body += chunk
            if len(body) > limit:
                raise ValueError(f"The {what} at the URL is over the limit of {limit} bytes.")


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


def _data_url_bytes(url: str, max_bytes: int, what: str = "image") -> bytes:
    """The encoded image (audio) of a `data:image/...;base64,...` (`data:audio/...`) URL."""
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError(f"An {what} data: URL must be base64: data:{what}/<type>;base64,<data>.")
    media_type = header[len("data:"):-len(";base64")].lower()
    if media_type and not media_type.startswith(f"{what}/"):
        raise ValueError(f"An {what}_url part's data: URL holds {media_type!r}, not "
                         f"{'an image' if what == 'image' else 'audio'}.")
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise ValueError(f"The {what} in the data: URL is over the limit of {max_bytes} "
                         "bytes.")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"The {what} data: URL is not valid base64.") from None
