"""Images named by URL in chat messages (`image_url` parts): `data:` URLs are decoded here
with a size cap; remote and local-file URLs are refused (this engine does not fetch)."""

from __future__ import annotations

import base64
import binascii

from vllm.multimodal.image import MAX_IMAGE_BYTES


def image_url_bytes(url: object, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The encoded image of a `data:image/...;base64,...` URL; ValueError for anything
    else, naming the problem.

    Example: "data:image/png;base64,iVBORw0KGgo..." -> b"\\x89PNG\\r\\n\\x1a\\n...".
    """
    if not isinstance(url, str) or not url:
        raise ValueError("An image_url part needs 'image_url': {'url': 'data:image/...'}.")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ValueError("Remote image URLs are not fetched by this engine: send the image "
                         "inline as a data: URL (data:image/png;base64,...).")
    if scheme != "data":
        raise ValueError(f"Image URLs with scheme {scheme or url[:16]!r} are not supported: "
                         "send the image inline as a data: URL (data:image/png;base64,...).")
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
