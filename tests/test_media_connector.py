"""Where chat images may come from (`vllm/multimodal/media.py`): data: URLs, files under
`allowed_local_media_path` (symlinks and `..` leading out refused), and http(s) URLs of
`allowed_media_domains`, fetched from a local `http.server` in a thread (no internet here):
size and time limits, HTTP errors, redirects."""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from vllm.multimodal.media import FETCH_TIMEOUT_ENV, MediaConnector, fetch_timeout_from_env


def _png() -> bytes:
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
                    ).save(png, format="PNG")
    return png.getvalue()


PNG = _png()


# ---- data: URLs ---------------------------------------------------------------------------

def _data_url(media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(PNG).decode()}"


def test_data_url_decodes() -> None:
    assert MediaConnector().image_bytes(_data_url()) == PNG


@pytest.mark.parametrize("url, message", [
    ("https://example.com/cat.png", "Remote image URLs are not fetched .* "
                                    "--allowed-media-domains"),
    ("http://example.com/cat.png", "Remote image URLs are not fetched"),
    ("file:///etc/passwd", "not read by this engine: start it with "
                           "--allowed-local-media-path DIR"),
    ("ftp://example.com/cat.png", "scheme 'ftp' are not supported"),
    ("cat.png", "not supported"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:text/plain;base64,aGVsbG8=", "holds 'text/plain', not an image"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    (None, "needs 'image_url'"),
])
def test_refused_by_default(url, message) -> None:
    with pytest.raises(ValueError, match=message):
        MediaConnector().image_bytes(url)


def test_data_url_size_cap() -> None:
    with pytest.raises(ValueError, match="over the limit of 100 bytes"):
        MediaConnector(max_bytes=100).image_bytes(_data_url())
    assert MediaConnector(max_bytes=len(PNG)).image_bytes(_data_url()) == PNG


# ---- file: URLs ---------------------------------------------------------------------------

@pytest.fixture
def media_dir(tmp_path) -> str:
    """tmp/allowed/{cat.png, sub/dog.png, inner -> cat.png, outer -> ../secret.png,
    fifo}, tmp/secret.png."""
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "cat.png").write_bytes(PNG)
    (allowed / "sub" / "dog.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(allowed / "cat.png", allowed / "inner")
    os.symlink(tmp_path / "secret.png", allowed / "outer")
    os.mkfifo(allowed / "fifo")
    return str(allowed)


def test_files_under_the_allowed_path_are_read(media_dir) -> None:
    media = MediaConnector(allowed_local_media_path=media_dir)
    assert media.image_bytes(f"file://{media_dir}/cat.png") == PNG
    assert media.image_bytes(f"file://{media_dir}/sub/dog.png") == PNG
    assert media.image_bytes(f"file://localhost{media_dir}/sub/../cat.png") == PNG
    assert media.image_bytes(f"file://{media_dir}/inner") == PNG  # resolves inside
    assert media.image_bytes(f"file://{media_dir}/c%61t.png") == PNG  # percent-decoded


@pytest.mark.parametrize("name, message", [
    ("../secret.png", "outside the allowed local media path"),
    ("sub/../../secret.png", "outside the allowed local media path"),
    ("outer", "outside the allowed local media path"),  # a symlink leading out
    ("%2e%2e/secret.png", "outside the allowed local media path"),
    ("missing.png", "cannot be read: No such file"),
    ("fifo", "is not a regular file"),
    ("sub", "is not a regular file"),
])
def test_files_leading_out_or_odd_are_refused(media_dir, name, message) -> None:
    media = MediaConnector(allowed_local_media_path=media_dir)
    with pytest.raises(ValueError, match=message):
        media.image_bytes(f"file://{media_dir}/{name}")


def test_file_url_forms_and_size(media_dir) -> None:
    media = MediaConnector(allowed_local_media_path=media_dir)
    with pytest.raises(ValueError, match="not on host 'example.com'"):
        media.image_bytes(f"file://example.com{media_dir}/cat.png")
    with pytest.raises(ValueError, match="outside the allowed"):
        media.image_bytes("file:///etc/passwd")
    with pytest.raises(ValueError, match="over the limit of 100"):
        MediaConnector(allowed_local_media_path=media_dir, max_bytes=100).image_bytes(
            f"file://{media_dir}/cat.png")


def test_engine_args_check_the_allowed_path(tmp_path) -> None:
    from vllm import EngineArgs

    args = EngineArgs(allowed_local_media_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="must be an existing directory"):
        args._local_media_path()
    with pytest.raises(ValueError, match="list of host names"):
        EngineArgs(allowed_media_domains="example.com")._media_domains()  # type: ignore[arg-type]
    assert EngineArgs(allowed_media_domains=["Example.COM"])._media_domains() == ["example.com"]


# ---- http(s): URLs, from a local server ---------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    """/ok.png: the PNG; /big: 2,000 bytes with their length; /chunked-big: 2,000 bytes
    without a length; /slow: headers, then a byte every 0.2 s; /stall: headers only;
    /text: not an image; /moved: a redirect; anything else: 404."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            self._answer(self.path)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: expected
            pass

    def _answer(self, path: str) -> None:
        if path == "/ok.png":
            self._send(200, PNG)
        elif path == "/big":
            self._send(200, b"x" * 2000)
        elif path == "/chunked-big":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"64\r\n" + b"x" * 100 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path in ("/slow", "/stall"):
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100 if path == "/slow" else 0):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.2)
            time.sleep(3 if path == "/stall" else 0)
        elif path == "/text":
            self._send(200, b"hello, not an image")
        elif path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://elsewhere.example/cat.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _fetcher(**kwargs) -> MediaConnector:
    return MediaConnector(allowed_media_domains=("127.0.0.1",), **kwargs)


def test_allowed_host_is_fetched(server) -> None:
    assert _fetcher().image_bytes(f"{server}/ok.png") == PNG


@pytest.mark.parametrize("path, message", [
    ("/big", "is 2000 bytes, over the limit of 1000"),  # refused from Content-Length
    ("/chunked-big", "over the limit of 1000 bytes"),  # counted while reading
    ("/missing.png", "HTTP 404"),
    ("/moved", r"HTTP 302 .*redirected to http://elsewhere.example/cat.png"),
])
def test_fetch_limits_and_errors(server, path, message) -> None:
    with pytest.raises(ValueError, match=message):
        _fetcher(max_bytes=1000).image_bytes(f"{server}{path}")


@pytest.mark.parametrize("path", ["/slow", "/stall"])
def test_fetch_time_limit_covers_the_whole_body(server, path) -> None:
    """/slow sends a byte every 0.2 s (each read is quick, the whole is 20 s); /stall
    sends headers and stops: both end at the deadline."""
    with pytest.raises(ValueError, match=r"took longer than 0.5 s \(VLLM_IMAGE_FETCH_TIMEOUT\)"):
        _fetcher(fetch_timeout=0.5).image_bytes(f"{server}{path}")


def test_other_hosts_and_closed_ports_are_refused(server) -> None:
    with pytest.raises(ValueError, match="host 'localhost' is not in the allowed media "
                                         r"domains \(127.0.0.1\)"):
        _fetcher().image_bytes(server.replace("127.0.0.1", "localhost") + "/ok.png")
    closed = MediaConnector(allowed_media_domains=("127.0.0.1",))
    with pytest.raises(ValueError, match="Fetching the image URL failed: ConnectionRefused"):
        closed.image_bytes("http://127.0.0.1:1/ok.png")


def test_fetch_timeout_from_env(monkeypatch) -> None:
    monkeypatch.delenv(FETCH_TIMEOUT_ENV, raising=False)
    assert fetch_timeout_from_env() == 5.0
    monkeypatch.setenv(FETCH_TIMEOUT_ENV, "1.5")
    assert fetch_timeout_from_env() == 1.5
    monkeypatch.setenv(FETCH_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        fetch_timeout_from_env()
