"""Images in API requests and responses: encoding, decoding, and chat's image parts."""

from __future__ import annotations

import base64
import io
from http import HTTPStatus
from typing import Any

from PIL import Image, UnidentifiedImageError

from vllm_omni.entrypoints.openai.protocol import OmniHTTPError

_PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


def encode_image(image: Image.Image, fmt: str, compression: int | None = None) -> str:
    buf = io.BytesIO()
    kwargs = {} if compression is None or fmt == "png" else {"quality": compression}
    image.save(buf, format=_PIL_FORMAT[fmt], **kwargs)
    return base64.b64encode(buf.getvalue()).decode()


def decode_image(data: bytes, field: str) -> Image.Image:
    """An uploaded image as RGB; a 400 naming `field` for bytes that are no image or an
    image of more pixels than PIL decodes without suspecting a decompression bomb (a small
    file can declare a huge image, which would take gigabytes to decode)."""
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        if image.width * image.height > Image.MAX_IMAGE_PIXELS:
            raise Image.DecompressionBombError(f"{image.width}x{image.height}")
        return image.convert("RGB")
    except Image.DecompressionBombError as e:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                            f"{field}: image too large ({e}; at most {Image.MAX_IMAGE_PIXELS} "
                            "pixels)", field) from None
    except (UnidentifiedImageError, OSError) as e:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"{field}: not a readable image ({e})",
                            field) from None


def chat_image_prompt(messages: list[Any]) -> Any:
    """The diffusion prompt of a chat: the last user message's text, and its images (data
    URLs) for pipelines that edit images."""
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, "messages: no user message to draw",
                            "messages")
    content = users[-1].get("content")
    if isinstance(content, str):
        return content
    texts, images = [], []
    for part in content or []:
        if part.get("type") == "text":
            texts.append(part["text"])
        elif part.get("type") == "image_url":
            url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else ""
            head, _, data = url.partition(";base64,")
            if not head.startswith("data:image/"):
                raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                    "image_url: only base64 data URLs are supported", "messages")
            images.append(decode_image(base64.b64decode(data), "messages"))
        else:
            raise OmniHTTPError(HTTPStatus.BAD_REQUEST,
                                f"messages: {part.get('type')!r} content is not supported here",
                                "messages")
    text = "\n".join(texts)
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def image_parts(images: list[Image.Image]) -> list[dict]:
    """Images as chat content parts (PNG data URLs)."""
    return [{"type": "image_url",
             "image_url": {"url": "data:image/png;base64," + encode_image(img, "png")}}
            for img in images]
