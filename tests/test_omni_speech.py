"""Qwen2.5-Omni speaking: the built-in pipeline (thinker -> talker -> code2wav) on the tiny
model equals HF transformers' `generate(return_audio=True)`: thinker tokens, talker codec
tokens and waveform, for text and for image + audio input, several requests at once."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import psutil
import pytest
import torch
from conftest import wait_for
from PIL import Image
from vllm import SamplingParams

from vllm_omni.testing.tiny_omni import TALKER_EOS_IDS
from vllm_omni.transfer.connectors import unread_payloads

THINKER_TOKENS, TALKER_TOKENS, SEED = 12, 40, 1234
PROMPTS = ["Tell me a story about a red fox.", "What is two plus two?", "Sing."]
RNG = np.random.default_rng(0)
IMAGE = Image.fromarray(RNG.integers(0, 256, (56, 84, 3), dtype=np.uint8))
AUDIO = (0.1 * np.sin(np.arange(16000) * 2 * np.pi * 440 / 16000)).astype(np.float32)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def chat_prompt(processor, text: str, media: tuple[str, ...] = ()) -> str:
    parts = [{"type": m} for m in media] + [{"type": "text", "text": text}]
    return processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )


@pytest.fixture(scope="module")
def hf_speech(tiny_omni):
    """Per prompt (the text ones, then one with an image and audio): the pipeline's prompt,
    and HF's thinker tokens, talker codes and waveform."""
    from conftest import hf_talker_with_attention_mask
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_omni)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_omni).eval()
    hf_talker_with_attention_mask(model)
    talker_generate = model.talker.generate
    calls = []

    def recording(*args, **kwargs):  # HF returns no codec tokens: read them on the way
        out = talker_generate(*args, **kwargs)
        calls.append(out[0, kwargs["input_ids"].shape[1]:].tolist())
        return out

    model.talker.generate = recording
    cases = [(chat_prompt(processor, t), {}) for t in PROMPTS]
    cases.append((chat_prompt(processor, "What is this?", ("image", "audio")),
                  {"image": IMAGE, "audio": (AUDIO, 16000)}))
    refs = []
    for prompt, media in cases:
        inputs = processor(text=prompt, return_tensors="pt",
                           **({"images": [IMAGE], "audio": [AUDIO]} if media else {}))
        if media:  # HF's generate hands unprefixed inputs to every stage
            inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
        torch.manual_seed(SEED)  # token2wav draws its noise from the global generator
        with torch.no_grad():
            sequences, waveform = model.generate(
                **inputs, return_audio=True, thinker_max_new_tokens=THINKER_TOKENS,
                thinker_do_sample=False, talker_do_sample=False,
                talker_max_new_tokens=TALKER_TOKENS, talker_eos_token_id=TALKER_EOS_IDS,
            )
        thinker = sequences[0, inputs["input_ids"].shape[1]:].tolist()
        pipeline_prompt = {"prompt": prompt, "multi_modal_data": media} if media else prompt
        refs.append((pipeline_prompt, thinker, calls.pop(), waveform.numpy()))
    return refs


def shm_segments() -> set[str]:
    return unread_payloads()  # a pool's free segments are its memory, not a payload


@pytest.fixture(scope="module")
def speech_llm(tiny_omni):
    """The built-in pipeline of the architecture."""
    from vllm_omni import OmniLLM

    llm = OmniLLM(tiny_omni, dtype="float32", max_model_len=1024)
    assert llm.pipeline.name == "qwen2_5_omni"
    yield llm
    llm.shutdown()


def params(**code2wav) -> list:
    return [
        SamplingParams(temperature=0, max_tokens=THINKER_TOKENS),
        {"temperature": 0, "max_tokens": TALKER_TOKENS},
        {"seed": SEED, **code2wav},
    ]


def test_speech_equals_hf(speech_llm, hf_speech):
    before = shm_segments()
    outs = speech_llm.generate([r[0] for r in hf_speech], params(), modalities=["text", "audio"])
    by_stage = {s: [o for o in outs if o.stage == s] for s in ("thinker", "code2wav")}
    assert all(len(v) == len(hf_speech) for v in by_stage.values())
    for i, (_, thinker, codes, waveform) in enumerate(hf_speech):
        assert by_stage["thinker"][i].token_ids == thinker
        # The talker's codes, as code2wav got them: HF's, up to the codec eos or pad that
        # ended them.
        spoken = codes[:-1] if codes and codes[-1] in TALKER_EOS_IDS else codes
        assert by_stage["code2wav"][i].tensors["codes"].tolist() == spoken
        audio = by_stage["code2wav"][i].audio
        assert audio.sample_rate == 24000
        np.testing.assert_allclose(audio.waveform, waveform, atol=1e-5)
    # The thinker's states went to the talker's worker and were freed there.
    assert shm_segments() <= before


def test_text_only_runs_the_thinker_alone(speech_llm, hf_speech):
    before = shm_segments()
    outs = speech_llm.generate([hf_speech[0][0]], params())  # default modalities: text
    assert [o.stage for o in outs] == ["thinker"]
    assert outs[0].token_ids == hf_speech[0][1]
    assert shm_segments() <= before  # no hidden states kept for a talker that never runs


def test_voices_and_bad_parameters(speech_llm, hf_speech):
    prompt = hf_speech[0][0]
    chelsie, ethan = (
        speech_llm.generate([prompt], params(speaker=v), modalities=["audio"])[0]
        for v in ("Chelsie", "Ethan")
    )
    assert chelsie.stage == ethan.stage == "code2wav"
    np.testing.assert_allclose(chelsie.audio.waveform, hf_speech[0][3], atol=1e-5)
    assert not np.allclose(chelsie.audio.waveform, ethan.audio.waveform)
    with pytest.raises(ValueError, match="unknown voice"):
        speech_llm.generate([prompt], params(speaker="Nobody"), modalities=["audio"])
    with pytest.raises(ValueError, match="unknown code2wav parameters"):
        speech_llm.generate([prompt], params(loudness=3), modalities=["audio"])


def busy_seconds(procs, window: float = 1.0) -> float:
    """CPU seconds the processes use during `window`."""
    def cpu():
        return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())
    start = cpu()
    time.sleep(window)
    return cpu() - start


def test_abort_mid_speech_stops_every_stage(speech_llm, hf_speech):
    """Cancel a request while the talker speaks: no stage keeps working on it."""
    engine = speech_llm.engine
    talker = engine.stages["talker"].engine
    children = psutil.Process().children(recursive=True)
    long_speech = params()
    long_speech[1] = {"temperature": 0, "max_tokens": 900, "stop_token_ids": []}

    async def speak_and_hang_up() -> list[str]:
        seen = []

        async def consume():
            async for out in engine.generate(hf_speech[0][0], long_speech, "hang-up",
                                             ["text", "audio"]):
                seen.append(out.stage)

        task = asyncio.create_task(consume())
        deadline = time.monotonic() + 60
        while not talker.output_processor.has_unfinished_requests():
            assert time.monotonic() < deadline, "the talker never started"
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return seen

    shm_before_abort = shm_segments()
    idle = busy_seconds(children)  # resource trackers and friends
    seen = asyncio.run_coroutine_threadsafe(speak_and_hang_up(), speech_llm._loop).result(120)
    assert "code2wav" not in seen
    assert not talker.output_processor.has_unfinished_requests()
    # Speaking 900 codes keeps the stages busy for ~15 s here; aborted, they are idle once
    # vLLM's workers stop polling (they spin about a second after their last step).
    wait_for(lambda: busy_seconds(children) < idle + 0.2, "every stage idle", timeout=8)
    assert shm_segments() <= shm_before_abort


def test_code2wav_batch_equals_hf_one_by_one(tiny_omni):
    """Requests batched in one DiT call each get HF's waveform for their own seed."""
    from vllm_omni.engine.code2wav.sampler import request_noise, sample_mels
    from vllm_omni.models.qwen2_5_omni.speakers import speakers
    from vllm_omni.models.qwen2_5_omni.token2wav import load_token2wav

    token2wav, _ = load_token2wav(tiny_omni, "float32", "cpu")
    voice = speakers(tiny_omni)["Ethan"]
    codes = torch.randint(0, 100, (3, 30), generator=torch.Generator().manual_seed(0))
    seeds = [11, 22, 33]
    dit = token2wav.code2wav_dit_model
    noise = torch.stack([request_noise(s, 30 * dit.repeats, dit.mel_dim, torch.float32)
                         for s in seeds])
    with torch.inference_mode():
        mels = sample_mels(dit, codes, voice["cond"][None].expand(3, -1),
                           voice["ref_mel"].expand(3, -1, -1), noise, 10, 0.5, -1.0)
        batched = token2wav.code2wav_bigvgan_model(mels).reshape(3, -1)
        for i, seed in enumerate(seeds):
            torch.manual_seed(seed)
            alone = token2wav(codes[i : i + 1], conditioning=voice["cond"][None],
                              reference_mel=voice["ref_mel"]).reshape(-1)
            torch.testing.assert_close(batched[i], alone, atol=1e-5, rtol=0)
    assert not torch.allclose(batched[0], batched[1])


def test_compiled_code2wav_equals_eager(tiny_omni):
    """`compile: true` (the code2wav stage's option): the DiT and vocoder through inductor
    give eager's waveform."""
    from vllm_omni.engine.code2wav.sampler import request_noise, sample_mels
    from vllm_omni.models.qwen2_5_omni.speakers import speakers
    from vllm_omni.models.qwen2_5_omni.token2wav import compile_token2wav, load_token2wav

    eager, _ = load_token2wav(tiny_omni, "float32", "cpu")
    compiled, _ = load_token2wav(tiny_omni, "float32", "cpu")
    compile_token2wav(compiled)
    voice = speakers(tiny_omni)["Chelsie"]

    def decode(model, codes):
        n, dit = len(codes), model.code2wav_dit_model
        noise = torch.stack([request_noise(i, codes.shape[1] * dit.repeats, dit.mel_dim,
                                           torch.float32) for i in range(n)])
        with torch.no_grad():
            mels = sample_mels(dit, codes, voice["cond"][None].expand(n, -1),
                               voice["ref_mel"].expand(n, -1, -1), noise, 4, 0.5, -1.0)
            return model.code2wav_bigvgan_model(mels).reshape(n, -1)

    codes = torch.randint(0, 100, (2, 30), generator=torch.Generator().manual_seed(0))
    wave = decode(compiled, codes)
    torch.testing.assert_close(wave, decode(eager, codes), atol=1e-5, rtol=0)
    assert not torch.allclose(wave[0], wave[1])


def run(llm, coro, timeout: float = 300):
    return asyncio.run_coroutine_threadsafe(coro, llm._loop).result(timeout)


def test_streamed_speech_starts_while_the_talker_speaks(speech_llm, hf_speech):
    """`stream: true`: code2wav gets the talker's codes as they come (the pipeline's streamed
    edge) and sends audio chunk by chunk; the result equals decoding the same codes handed
    over whole, also when batched with another request."""
    engine = speech_llm.engine
    code2wav = engine.stages["code2wav"]
    streamed = params(stream=True)
    streamed[1] = {"temperature": 0, "max_tokens": 300, "stop_token_ids": []}

    async def speak() -> list:
        return [out async for out in engine.generate(hf_speech[0][0], streamed, "streamed",
                                                     ["text", "audio"])
                if out.stage == "code2wav"]

    audio = run(speech_llm, speak())
    codes = audio[-1].tensors["codes"].tolist()
    info, per_code = code2wav.engine.info, 24000 // 50
    ends = list(range(info["first_chunk_codes"], len(codes), info["chunk_codes"]))
    assert len(codes) == 300
    assert [o.metrics["samples"] for o in audio] == [e * per_code for e in [*ends, 300]]
    assert [o.finished for o in audio] == [False] * (len(audio) - 1) + [True]
    # Audio began before the talker's last code.
    assert not audio[0].metrics["input_complete"]
    assert audio[-1].audio.waveform.shape == (len(codes) * per_code,)

    async def decode(request_id: str, codes: list[int], seed: int, stream: bool = True):
        async for out in code2wav.generate(request_id, {"codes": codes},
                                           {"seed": seed, "stream": stream}):
            if out.finished:
                return out.audio.waveform

    async def whole_passing() -> list:
        other = [c % 50 for c in codes[:200]]
        return await asyncio.gather(decode("whole", codes, SEED),
                                    decode("other", other, SEED + 1),
                                    decode("unchunked", codes, SEED, stream=False))

    waveform, other, unchunked = run(speech_llm, whole_passing())
    np.testing.assert_allclose(audio[-1].audio.waveform, waveform, atol=1e-5, rtol=0)
    assert other.shape == (200 * per_code,)
    # Chunks approximate the whole decode: the DiT sees each with context around it.
    snr = 10 * np.log10(np.sum(unchunked**2) / np.sum((waveform - unchunked) ** 2))
    assert snr > 40, f"chunked audio is {snr:.1f} dB from the whole decode"


def test_hanging_up_on_streamed_speech_stops_every_stage(speech_llm, hf_speech):
    """Close the stream after the first audio chunk: the talker and code2wav stop at once."""
    engine = speech_llm.engine
    children = psutil.Process().children(recursive=True)
    streamed = params(stream=True)
    streamed[1] = {"temperature": 0, "max_tokens": 900, "stop_token_ids": []}

    async def first_chunk_then_hang_up():
        outputs = engine.generate(hf_speech[0][0], streamed, "hang-up-streamed",
                                  ["text", "audio"])
        async for out in outputs:
            if out.stage == "code2wav":
                await outputs.aclose()
                return out

    idle = busy_seconds(children)
    first = run(speech_llm, first_chunk_then_hang_up())
    assert not first.finished and first.metrics["samples"] > 0
    # 900 codes take ~15 s to speak here; closed, every stage is idle once vLLM's workers
    # stop polling (about a second after their last step).
    wait_for(lambda: busy_seconds(children) < idle + 0.2, "every stage idle", timeout=8)
