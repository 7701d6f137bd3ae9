"""Audio encoding for API responses."""

from __future__ import annotations

import base64
import io
from http import HTTPStatus

import numpy as np

from vllm_omni.entrypoints.openai.protocol import OmniHTTPError

# Response format -> (soundfile container, subtype); "pcm" is raw 16-bit little-endian.
FORMATS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "pcm": ("RAW", "PCM_16"),
    "pcm16": ("RAW", "PCM_16"),  # OpenAI's name for it in chat audio
}
# Formats whose pieces concatenate into the whole: streamed chunk by chunk (the others come
# as one file at the end of a stream).
STREAMABLE = {"pcm", "pcm16"}


def encode_audio(waveform: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """A mono waveform in [-1, 1] as a file of the requested format (16-bit samples)."""
    import soundfile

    if fmt not in FORMATS:
        raise OmniHTTPError(
            HTTPStatus.BAD_REQUEST,
            f"audio format {fmt!r} is not supported; use one of {sorted(FORMATS)}", "format",
        )
    container, subtype = FORMATS[fmt]
    buf = io.BytesIO()
    extra = {"endian": "LITTLE"} if container == "RAW" else {}
    soundfile.write(buf, np.clip(waveform, -1.0, 1.0), sample_rate, subtype=subtype,
                    format=container, **extra)
    return buf.getvalue()


def audio_b64(waveform: np.ndarray, sample_rate: int, fmt: str) -> str:
    return base64.b64encode(encode_audio(waveform, sample_rate, fmt)).decode()
