"""An image URL to a checked RGB PIL image: data URLs (base64), http(s) fetched under a
size and a time limit, file:// only under --allowed-local-media-path. Every failure is
the request's: an InputError naming `field`, its message bounded (a URL is cut short)."""
from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.parse
import warnings
from typing import Any

import httpx
from PIL import Image

from jaxserve.errors import InputError
from jaxserve.config.media import MediaConfig

# What PIL may decode: the formats browsers and the openai client send.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_SHOWN = 60   # characters of a URL an error message repeats


def _short(url: str) -> str:
    return repr(url[:_SHOWN] + ("..." if len(url) > _SHOWN else ""))


def load_image(url: Any, config: MediaConfig, field: str = "messages") -> Any:
    """The image `url` names, decoded and converted to RGB."""
    if not isinstance(url, str) or not url:
        raise InputError(f"an image URL must be a non-empty string, got "
                         f"{type(url).__name__}", field)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(url, config, field)
    elif scheme in ("http", "https"):
        data = _fetch(url, config, field)
    elif scheme == "file":
        data = _local_file(url, config, field)
    else:
        raise InputError(f"image URL {_short(url)}: the scheme must be data:, http(s): or "
                         f"file:", field)
    return decode_image(data, config, field)


def decode_image(data: bytes, config: MediaConfig, field: str = "messages") -> Any:
    """Encoded image bytes -> RGB PIL image; unknown formats, corrupt files and bitmaps
    over config.max_image_pixels are refused before the pixels are decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width * height > config.max_image_pixels:
                raise InputError(f"the image is {width}x{height} pixels, more than "
                                 f"{config.max_image_pixels}", field)
            image.load()
    except InputError:
        raise
    except Image.UnidentifiedImageError:
        raise InputError(f"the image's format is not one of {', '.join(FORMATS)} (or the "
                         f"data is not an image)", field) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as e:
        raise InputError(f"the image cannot be decoded: {type(e).__name__}: "
                         f"{str(e)[:120]}", field) from None
    return to_rgb(image)


def to_rgb(image: Any) -> Any:
    """RGB, with any transparency laid over white (as transformers' convert_to_rgb does,
    so the pixels are the reference processor's)."""
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        image = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        white.alpha_composite(image)
        image = white
    return image.convert("RGB")


def _too_big(n: int | str, config: MediaConfig, field: str, what: str) -> InputError:
    return InputError(f"{what} is larger than the {config.max_image_bytes} bytes an image "
                      f"may have ({n})", field)


def _data_url(url: str, config: MediaConfig, field: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise InputError("a data URL image must be base64: data:image/<format>;base64,...",
                         field)
    mime = head[5:-7].lower()
    if not mime.startswith("image/"):
        raise InputError(f"a data URL's media type must be image/..., got "
                         f"{mime[:40]!r}", field)
    if len(payload) * 3 // 4 > config.max_image_bytes:
        raise _too_big(f"about {len(payload) * 3 // 4} bytes", config, field, "the data URL")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InputError("the data URL's base64 payload is not valid base64", field) from None


def _fetch(url: str, config: MediaConfig, field: str) -> bytes:
    """GET url, at most max_image_bytes, within fetch_timeout_s in all (a server that
    drips bytes is cut off by the overall deadline, not only per read)."""
    deadline = time.monotonic() + config.fetch_timeout_s
    limit = config.max_image_bytes
    try:
        with httpx.Client(timeout=config.fetch_timeout_s, follow_redirects=True) as client:
            with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise InputError(f"fetching image URL {_short(url)} failed: HTTP "
                                     f"{r.status_code}", field)
                size = r.headers.get("content-length")
                if size is not None and size.isdigit() and int(size) > limit:
                    raise _too_big(f"{size} bytes", config, field, f"image URL {_short(url)}")
                chunks, total = [], 0
                for chunk in r.iter_bytes():
                    total += len(chunk)
                    if total > limit:
                        raise _too_big(f"over {limit} bytes", config, field,
                                       f"image URL {_short(url)}")
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("the overall deadline passed")
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.TimeoutException:
        raise InputError(f"fetching image URL {_short(url)} took longer than "
                         f"{config.fetch_timeout_s:g} s", field) from None
    except httpx.HTTPError as e:
        raise InputError(f"fetching image URL {_short(url)} failed: {type(e).__name__}",
                         field) from None


def _local_file(url: str, config: MediaConfig, field: str) -> bytes:
    root = config.allowed_local_media_path
    if not root:
        raise InputError("file:// image URLs are refused: the server was not started with "
                         "--allowed-local-media-path", field)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InputError(f"file:// URL {_short(url)} names a host; only local files are read",
                         field)
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    if os.path.commonpath([root, path]) != root:
        raise InputError(f"file:// URL {_short(url)} is outside --allowed-local-media-path",
                         field)
    try:
        size = os.path.getsize(path)
        if size > config.max_image_bytes:
            raise _too_big(f"{size} bytes", config, field, f"file {_short(url)}")
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InputError(f"file:// URL {_short(url)} cannot be read: {e.strerror}",
                         field) from None
