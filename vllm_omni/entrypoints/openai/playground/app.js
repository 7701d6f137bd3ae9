// The vLLM-omni playground: talks to this server's own OpenAI endpoints, nothing else.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("omni-key") || "", info: null, chat: [] };

// -- the server ---------------------------------------------------------------------------

class ServerError extends Error {}

function headers(extra = {}) {
  return state.key ? { ...extra, Authorization: `Bearer ${state.key}` } : extra;
}

async function api(path, options = {}) {
  const reply = await fetch(path, { ...options, headers: headers(options.headers) });
  if (reply.status === 401) {
    showKeyForm();
    throw new ServerError("this server needs an API key");
  }
  if (!reply.ok) {
    let message = `${reply.status} ${reply.statusText}`;
    try {
      message = (await reply.json()).error.message || message;
    } catch (_) { /* not JSON: keep the status line */ }
    throw new ServerError(message);
  }
  return reply;
}

function showError(error) {
  const box = $("error");
  box.textContent = error ? String(error.message || error) : "";
  box.hidden = !error;
}

function showKeyForm() {
  $("key-form").hidden = false;
  $("api-key").focus();
}

// Reads an SSE body, calling `onEvent` with each parsed `data:` payload until [DONE].
async function readEvents(reply, onEvent) {
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new ServerError(event.error.message);
      onEvent(event);
    }
  }
}

// -- tabs -----------------------------------------------------------------------------------

function buildTabs(names) {
  const nav = $("tabs");
  nav.replaceChildren();
  const labels = {
    chat: "Chat", images: "Images", videos: "Videos", speech: "Speech", pipeline: "Pipeline",
  };
  for (const name of names) {
    const tab = document.createElement("button");
    tab.type = "button";
    tab.role = "tab";
    tab.id = `tab-button-${name}`;
    tab.textContent = labels[name];
    tab.setAttribute("aria-controls", `tab-${name}`);
    tab.addEventListener("click", () => selectTab(name));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = names[(names.indexOf(name) + step + names.length) % names.length];
      selectTab(next);
      $(`tab-button-${next}`).focus();
    });
    nav.append(tab);
  }
  selectTab(names[0]);
}

function selectTab(name) {
  for (const tab of $("tabs").children) {
    const on = tab.id === `tab-button-${name}`;
    tab.setAttribute("aria-selected", String(on));
    tab.tabIndex = on ? 0 : -1;
    $(tab.getAttribute("aria-controls")).hidden = !on;
  }
  if (name === "pipeline") showPlan().catch(showError);
}

// -- the pipeline ---------------------------------------------------------------------------

function fillTable(table, head, rows) {
  table.replaceChildren();
  const top = table.insertRow();
  for (const h of head) {
    const th = document.createElement("th");
    th.textContent = h;
    top.append(th);
  }
  for (const row of rows) {
    const tr = table.insertRow();
    for (const cell of row) tr.insertCell().textContent = cell;
  }
}

function showTimings(seconds, what) {
  if (!seconds) return;
  const rows = Object.entries(seconds).map(([stage, s]) => [stage, s.toFixed(3)]);
  fillTable($("timings"), [`stage (${what})`, "seconds"], rows);
}

async function showPlan() {
  const plan = await (await api("/v1/omni/plan")).json();
  const gib = (b) => (b / 2 ** 30).toFixed(3);
  const rows = plan.stages.map((s) => [s.stage, s.device, gib(s.weights), gib(s.kv_cache),
    gib(s.activations), gib(s.runtime), gib(s.total), s.source]);
  for (const d of plan.devices) {
    rows.push([`[${d.device}]`, `${gib(d.free)} free`, "", "", "", "", gib(d.planned),
      `of ${gib(d.usable)} usable`]);
  }
  fillTable($("plan"), ["stage", "device", "weights", "kv cache", "activations", "runtime",
    "total", "set by"], rows);
}

// -- chat ------------------------------------------------------------------------------------

function bubble(role) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  $("chat-log").append(div);
  return div;
}

function fileAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function pcmToFloat(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const ints = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  return Float32Array.from(ints, (v) => v / 32768);
}

function wavBlob(samples, rate) {
  const data = new DataView(new ArrayBuffer(44 + samples.length * 2));
  const text = (at, s) => [...s].forEach((c, i) => data.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF"); data.setUint32(4, 36 + samples.length * 2, true); text(8, "WAVE");
  text(12, "fmt "); data.setUint32(16, 16, true); data.setUint16(20, 1, true);
  data.setUint16(22, 1, true); data.setUint32(24, rate, true); data.setUint32(28, rate * 2, true);
  data.setUint16(32, 2, true); data.setUint16(34, 16, true); text(36, "data");
  data.setUint32(40, samples.length * 2, true);
  samples.forEach((v, i) => data.setInt16(44 + i * 2, Math.max(-1, Math.min(1, v)) * 32767, true));
  return new Blob([data], { type: "audio/wav" });
}

// Plays pcm16 pieces as they arrive, one after another, and keeps them for the download.
class AudioPlayer {
  constructor(rate) {
    this.rate = rate;
    this.pieces = [];
    try {
      this.context = new AudioContext({ sampleRate: rate });
      this.next = this.context.currentTime;
    } catch (_) { this.context = null; } // no audio device: still downloadable
  }

  add(b64) {
    const samples = pcmToFloat(b64);
    this.pieces.push(samples);
    if (!this.context || samples.length === 0) return;
    const buffer = this.context.createBuffer(1, samples.length, this.rate);
    buffer.copyToChannel(samples, 0);
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    this.next = Math.max(this.next, this.context.currentTime);
    source.start(this.next);
    this.next += buffer.duration;
  }

  element() {
    const all = new Float32Array(this.pieces.reduce((n, p) => n + p.length, 0));
    let at = 0;
    for (const p of this.pieces) { all.set(p, at); at += p.length; }
    return audioElement(wavBlob(all, this.rate), "answer.wav");
  }
}

function audioElement(blob, name) {
  const wrap = document.createElement("div");
  const audio = document.createElement("audio");
  audio.controls = true;
  audio.src = URL.createObjectURL(blob);
  const link = document.createElement("a");
  link.href = audio.src;
  link.download = name;
  link.textContent = `Download ${name}`;
  wrap.append(audio, link);
  return wrap;
}

function imageElement(url, alt) {
  const img = document.createElement("img");
  img.src = url;
  img.alt = alt;
  return img;
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text) return;
  let stages;
  try {
    stages = stageSettings("chat-stages");
  } catch (error) {
    showError(error);
    return;
  }
  const content = [{ type: "text", text }];
  const image = $("chat-image").files[0];
  const audio = $("chat-audio").files[0];
  if (image) content.push({ type: "image_url", image_url: { url: await fileAsDataURL(image) } });
  if (audio) {
    const data = (await fileAsDataURL(audio)).split(",")[1];
    content.push({ type: "input_audio", input_audio: { data, format: "wav" } });
  }
  state.chat.push({ role: "user", content: content.length === 1 ? text : content });
  const mine = bubble("user");
  mine.textContent = text;
  const speak = $("chat-speak").checked;
  const body = {
    model: state.info.model, messages: state.chat, stream: true,
    stream_options: { include_usage: true },  // its last chunk carries the stages' seconds
    max_tokens: Number($("chat-max-tokens").value) || 64, stage_sampling_params: stages,
  };
  if (speak) {
    body.modalities = ["text", "audio"];
    body.audio = { voice: state.info.audio.voices[0], format: "pcm16" };
  }
  const theirs = bubble("assistant");
  const words = document.createElement("span");
  theirs.append(words);
  const player = speak ? new AudioPlayer(state.info.audio.sample_rate) : null;
  $("chat-send").disabled = true;
  $("chat-input").value = "";
  try {
    const reply = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    await readEvents(reply, (chunk) => {
      if (chunk.stage_seconds) showTimings(chunk.stage_seconds, "chat");
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (typeof delta.content === "string") words.textContent += delta.content;
        if (Array.isArray(delta.content)) {
          for (const part of delta.content) {
            if (part.type === "image_url") theirs.append(imageElement(part.image_url.url, text));
            if (part.type === "text") words.textContent += part.text;
          }
        }
        if (delta.audio?.transcript) words.textContent += delta.audio.transcript;
        if (delta.audio?.data) player.add(delta.audio.data);
      }
    });
    if (player && player.pieces.length) theirs.append(player.element());
    state.chat.push({ role: "assistant", content: words.textContent });
    showError(null);
  } catch (error) {
    theirs.remove();
    state.chat.pop();
    showError(error);
  } finally {
    $("chat-send").disabled = false;
  }
}

// -- images ----------------------------------------------------------------------------------

// `stage_sampling_params` from an optional JSON field; a typo is said before sending.
function stageSettings(id) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new ServerError(`Stage settings are not valid JSON: ${error.message}`);
  }
}

function numberOf(id) {
  const value = $(id).value;
  return value === "" ? undefined : Number(value);
}

async function generateImage(event) {
  event.preventDefault();
  const prompt = $("image-prompt").value.trim();
  const size = `${numberOf("image-width")}x${numberOf("image-height")}`;
  const fields = {
    prompt, size, n: 1, num_inference_steps: numberOf("image-steps"),
    seed: numberOf("image-seed"), guidance_scale: numberOf("image-guidance"),
  };
  const cache = $("image-cache").value;
  if (cache) fields.cache = { method: cache };
  const edit = $("image-input").files[0];
  let request;
  if (edit) {
    const form = new FormData();
    form.append("image", edit);
    for (const [k, v] of Object.entries(fields)) {
      if (v !== undefined) form.append(k, typeof v === "object" ? JSON.stringify(v) : v);
    }
    request = api("/v1/images/edits", { method: "POST", body: form });
  } else {
    request = api("/v1/images/generations", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(fields),
    });
  }
  $("image-go").disabled = true;
  const start = performance.now();
  try {
    const result = await (await request).json();
    const seconds = ((performance.now() - start) / 1000).toFixed(2);
    for (const item of result.data) {
      const figure = document.createElement("figure");
      figure.append(imageElement(`data:image/png;base64,${item.b64_json}`, prompt));
      const caption = document.createElement("figcaption");
      const steps = fields.num_inference_steps ?? "default";
      caption.textContent = `${prompt} · ${result.size} · steps ${steps} · seed ${result.seed}` +
        ` · ${seconds} s${result.cache ? ` · cached ${result.cache.cached_steps}` : ""}`;
      figure.append(caption);
      $("gallery").prepend(figure);
    }
    showTimings(result.stage_seconds, "image");
    showError(null);
  } catch (error) {
    showError(error);
  } finally {
    $("image-go").disabled = false;
  }
}

// -- videos ----------------------------------------------------------------------------------

// A job: create it, poll its progress (denoising steps), then fetch and show the MP4.
async function makeVideo(event) {
  event.preventDefault();
  const prompt = $("video-prompt").value.trim();
  const fields = {
    prompt, size: `${numberOf("video-width")}x${numberOf("video-height")}`,
    num_frames: numberOf("video-frames"), num_inference_steps: numberOf("video-steps"),
    seed: numberOf("video-seed"),
  };
  const bar = $("video-progress");
  $("video-go").disabled = true;
  bar.value = 0;
  bar.hidden = false;
  const start = performance.now();
  try {
    let job = await (await api("/v1/videos", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(fields),
    })).json();
    while (job.status === "queued" || job.status === "in_progress") {
      await new Promise((done) => setTimeout(done, 300));
      job = await (await api(`/v1/videos/${job.id}`)).json();
      bar.value = job.progress;
    }
    if (job.status !== "completed") throw new ServerError(job.error?.message || job.status);
    const blob = await (await api(`/v1/videos/${job.id}/content`)).blob();
    const figure = document.createElement("figure");
    const video = document.createElement("video");
    video.src = URL.createObjectURL(blob);
    video.controls = true;
    video.loop = true;
    video.setAttribute("aria-label", prompt);
    const caption = document.createElement("figcaption");
    const seconds = ((performance.now() - start) / 1000).toFixed(2);
    caption.textContent = `${prompt} · ${job.size} · ${job.num_frames} frames at ${job.fps} fps` +
      ` · seed ${job.seed} · ${seconds} s`;
    figure.append(video, caption);
    $("videos").prepend(figure);
    showError(null);
  } catch (error) {
    showError(error);
  } finally {
    $("video-go").disabled = false;
    bar.hidden = true;
  }
}

// -- speech ----------------------------------------------------------------------------------

async function speak(event) {
  event.preventDefault();
  const format = $("speech-format").value;
  $("speech-go").disabled = true;
  try {
    const body = {
      model: state.info.model, input: $("speech-input").value, voice: $("speech-voice").value,
      response_format: format, stage_sampling_params: stageSettings("speech-stages"),
    };
    const reply = await api("/v1/audio/speech", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const seconds = reply.headers.get("X-Stage-Seconds");
    let blob = await reply.blob();
    if (format === "pcm") {  // raw samples: wrap them so the browser can play them
      const ints = new Int16Array(await blob.arrayBuffer());
      blob = wavBlob(Float32Array.from(ints, (v) => v / 32768), state.info.audio.sample_rate);
    }
    $("speech-out").prepend(audioElement(blob, `speech.${format === "pcm" ? "wav" : format}`));
    if (seconds) showTimings(JSON.parse(seconds), "speech");
    showError(null);
  } catch (error) {
    showError(error);
  } finally {
    $("speech-go").disabled = false;
  }
}

// -- start -----------------------------------------------------------------------------------

function setUp(info) {
  state.info = info;
  $("model-line").textContent = `${info.model} · pipeline ${info.pipeline}`;
  fillTable($("stages"), ["stage", "engine", "output", "inputs", "final"],
    info.stages.map((s) => [s.name, s.engine, s.output, s.inputs.join(", ") || "request",
      s.final_output ? "yes" : ""]));
  // The example names a stage this pipeline has: its last AR stage (the talker on an omni
  // pipeline), else its first.
  const ar = info.stages.filter((s) => s.engine === "ar");
  const example = (ar.length ? ar[ar.length - 1] : info.stages[0]).name;
  for (const id of ["chat-stages", "speech-stages"]) {
    $(id).placeholder = JSON.stringify({ [example]: { max_tokens: 100 } });
  }
  const tabs = [];
  if (info.outputs.includes("text")) tabs.push("chat");
  if (info.image) {
    tabs.push("images");
    const d = info.image.defaults || {};
    $("image-width").value = d.width ?? 512;
    $("image-height").value = d.height ?? 512;
    $("image-steps").value = d.num_inference_steps ?? 20;
    if (d.guidance_scale != null) $("image-guidance").value = d.guidance_scale;
    $("image-edit-row").hidden = !info.image.edits;
  }
  if (info.video) {
    tabs.push("videos");
    const d = info.video.defaults || {};
    $("video-width").value = d.width ?? 832;
    $("video-height").value = d.height ?? 480;
    $("video-frames").value = d.num_frames ?? 33;
    $("video-steps").value = d.num_inference_steps ?? 30;
  }
  if (info.audio && info.outputs.includes("text")) {
    tabs.push("speech");
    $("chat-speak-row").hidden = false;
    $("speech-voice").replaceChildren(...info.audio.voices.map((v) => new Option(v, v)));
  }
  $("chat-image-row").hidden = !info.inputs.includes("image");
  $("chat-audio-row").hidden = !info.inputs.includes("audio");
  tabs.push("pipeline");
  buildTabs(tabs);
}

async function connect() {
  try {
    setUp(await (await api("/v1/omni/info")).json());
    $("key-form").hidden = true;
    showError(null);
  } catch (error) {
    showError(error);
  }
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("api-key").value;
  sessionStorage.setItem("omni-key", state.key);
  connect();
});
$("chat-form").addEventListener("submit", sendChat);
$("chat-clear").addEventListener("click", () => { state.chat = []; $("chat-log").replaceChildren(); });
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) $("chat-form").requestSubmit();
});
$("image-form").addEventListener("submit", generateImage);
$("speech-form").addEventListener("submit", speak);
$("video-form").addEventListener("submit", makeVideo);
connect();
