"""Videos in API responses: MP4 through PyAV (FFmpeg's encoders ship in its wheels)."""

from __future__ import annotations

import io
from fractions import Fraction

import av
from PIL import Image

# H.264 plays in every browser; the quality is near lossless for generated frames (CRF 12)
# so what the client sees is close to the model's output.
_CODEC = "libx264"
_OPTIONS = {"crf": "12", "preset": "medium"}


def encode_mp4(frames: list[Image.Image], fps: int) -> bytes:
    """An H.264 MP4 of RGB frames played at `fps` (sides must be even: yuv420p)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream(_CODEC, rate=Fraction(fps), options=_OPTIONS)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_image(frame.convert("RGB"))):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)
    return buf.getvalue()


def encode_png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
