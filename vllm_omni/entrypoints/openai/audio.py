"""Audio encoding for API responses."""

from __future__ import annotations

import base64
import io
import math
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
    """A mono waveform in [-1, 1] as a file of `fmt` (one of FORMATS, checked by the caller
    with `check_voice_and_format`), in 16-bit samples."""
    import soundfile

    container, subtype = FORMATS[fmt]
    buf = io.BytesIO()
    extra = {"endian": "LITTLE"} if container == "RAW" else {}
    soundfile.write(buf, np.clip(waveform, -1.0, 1.0), sample_rate, subtype=subtype,
                    format=container, **extra)
    return buf.getvalue()


def heard_wav(audio_file: bytes, rate: int) -> bytes | None:
    """`audio_file` (any container soundfile reads) as 16-bit mono wav at `rate`, resampled
    with scipy where its own rate differs; None where it already is that; ValueError for
    what is no audio."""
    import soundfile
    from scipy.signal import resample_poly

    try:
        info = soundfile.info(io.BytesIO(audio_file))
        if info.samplerate == rate and info.channels == 1 and info.format == "WAV":
            return None
        waveform, own_rate = soundfile.read(io.BytesIO(audio_file), dtype="float32",
                                            always_2d=True)
    except Exception as e:  # libsndfile's errors come as several types
        raise ValueError(f"not an audio file this server reads (wav, flac, mp3, ogg): {e}"
                         ) from None
    if waveform.shape[0] == 0:
        raise ValueError("the audio is empty")
    mono = waveform.mean(axis=1)
    if own_rate != rate:
        common = math.gcd(own_rate, rate)
        mono = resample_poly(mono, rate // common, own_rate // common)
    return encode_audio(mono, rate, "wav")


def audio_b64(waveform: np.ndarray, sample_rate: int, fmt: str) -> str:
    return base64.b64encode(encode_audio(waveform, sample_rate, fmt)).decode()


def check_voice_and_format(speakers: list[str], voice: str | None, fmt: str,
                           voice_field: str, format_field: str) -> None:
    """400s for a voice the model lacks or a format it cannot write, naming the field."""
    if fmt not in FORMATS:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"{format_field} {fmt!r} is not supported; "
                            f"use one of {sorted(FORMATS)}", format_field)
    if voice is not None and voice not in speakers:
        raise OmniHTTPError(HTTPStatus.BAD_REQUEST, f"unknown voice {voice!r}; "
                            f"this model has {speakers}", voice_field)


class AudioPieces:
    """What to send of an audio stage's outputs (each holds the waveform so far): each new
    piece as it comes when the format concatenates (`in_pieces`), else the whole waveform
    once finished; None while there is nothing to send."""

    def __init__(self, in_pieces: bool) -> None:
        self.in_pieces = in_pieces
        self.sent = 0

    def take(self, waveform: np.ndarray, finished: bool) -> np.ndarray | None:
        if not finished and (not self.in_pieces or waveform.shape[0] == self.sent):
            return None
        new, self.sent = waveform[self.sent:], waveform.shape[0]
        return new
