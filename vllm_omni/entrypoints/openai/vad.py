"""Server-side turn detection for the Realtime API: where speech starts and stops in a stream of
16-bit pcm, by WebRTC's voice activity detector (the `webrtcvad-wheels` package) on 30 ms
frames at 16 kHz."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

VAD_RATE = 16000  # one of the rates WebRTC's detector takes
FRAME = VAD_RATE * 30 // 1000  # samples per 30 ms frame
START_FRAMES = 3  # voiced frames in a row that make a start (shorter clicks are not speech)


@dataclass
class Turn:
    """A change the detector saw: speech started, or stopped, at `ms` into the stream."""

    started: bool
    ms: int


class SpeechDetector:
    """Feed it pcm as it comes (`push`); it says where turns start and stop. `threshold`
    (0..1, the protocol's) picks the detector's aggressiveness; `silence_ms` of unvoiced
    audio end a turn."""

    def __init__(self, rate: int, threshold: float = 0.5, silence_ms: int = 500) -> None:
        import webrtcvad

        self.vad = webrtcvad.Vad(min(3, max(0, int(threshold * 4))))
        common = math.gcd(rate, VAD_RATE)
        self.up, self.down = VAD_RATE // common, rate // common
        self.rate, self.silence_frames = rate, max(1, math.ceil(silence_ms / 30))
        self.pending = np.zeros(0, dtype=np.float32)  # 16 kHz samples not yet in a frame
        self.frames = 0  # frames judged so far
        self.run = 0  # frames in a row that disagree with the current state
        self.speaking = False

    def push(self, pcm: bytes) -> list[Turn]:
        from scipy.signal import resample_poly

        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
        if self.up != self.down:
            samples = resample_poly(samples, self.up, self.down).astype(np.float32)
        self.pending = np.concatenate([self.pending, samples])
        turns = []
        while len(self.pending) >= FRAME:
            frame, self.pending = self.pending[:FRAME], self.pending[FRAME:]
            data = np.clip(frame, -32768, 32767).astype("<i2").tobytes()
            voiced = self.vad.is_speech(data, VAD_RATE)
            self.frames += 1
            self.run = self.run + 1 if voiced != self.speaking else 0
            needed = self.silence_frames if self.speaking else START_FRAMES
            if self.run >= needed:
                self.speaking, self.run = not self.speaking, 0
                # The change happened where the run began.
                turns.append(Turn(self.speaking, (self.frames - needed) * 30))
        return turns
