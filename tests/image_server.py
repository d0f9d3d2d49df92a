"""Test images: generated with PIL, as data URLs, and served over HTTP on 127.0.0.1 by a
tiny threaded server with a normal, a too-large, a slow and a missing endpoint."""
from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

SLOW_S = 4.0   # the slow endpoint's delay: longer than the tests' fetch time limits


def noise_image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(encoded(image, fmt)).decode()}"


class ImageServer:
    """GET /<name> serves files[name]; /slow waits SLOW_S before its image; /big sends
    big_bytes of filler without a content-length; anything else is 404."""

    def __init__(self, files: dict[str, bytes], big_bytes: int = 1 << 20):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:   # noqa: N802 - http.server's name
                name = self.path.lstrip("/")
                if name == "slow":
                    time.sleep(SLOW_S)
                    body = next(iter(outer.files.values()))
                elif name == "big":
                    self.send_response(200)
                    self.end_headers()
                    try:
                        for _ in range(big_bytes // 65536 + 1):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        pass    # the client stopped reading: what the limit is for
                    return
                elif name in outer.files:
                    body = outer.files[name]
                else:
                    self.send_error(404)
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass

            def log_message(self, *args) -> None:
                pass

        self.files = files
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
