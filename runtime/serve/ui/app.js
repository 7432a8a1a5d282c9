// The playground: one page on the server's public API (/v1/models, /v1/videos, /v1/videos/{id},
// /v1/videos/{id}/content, its live preview ?variant=thumbnail, a segment kind's live stream
// /v1/videos/{id}/stream.m3u8; an image-editing bundle's /v1/images/edits; an AnyFlow-FAR bundle's realtime session
// /v1/realtime/video), as any client would use it. Everything a user or the server wrote is shown with
// textContent, never as HTML.
"use strict";

const KEY = "wan-aot-api-key";
const $ = (id) => document.getElementById(id);
const videos = new Map(); // job id -> object URL of its downloaded mp4 (an image edit's: its PNG)
const images = new Set(); // the ids of image edits' jobs, whose content is a PNG
const lives = new Map(); // job id -> the hls.js player of its live stream
let model = null;
let polling = null;
let live = null; // the realtime session's WebSocket, MediaSource and appends (AnyFlow-FAR bundles)

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = sessionStorage.getItem(KEY);
  if (key) headers.set("Authorization", "Bearer " + key);
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON */ }
    throw new ApiError(response.status, message);
  }
  return response;
}

function askForKey(message) {
  stopPolling();
  $("model").textContent = "This server needs an API key.";
  $("generate").hidden = true;
  $("edit-image").hidden = true;
  $("live").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = message || "";
  $("api-key").value = "";
  $("api-key").focus();
}

function option(value, text) {
  const o = document.createElement("option");
  o.value = value;
  o.textContent = text;
  return o;
}

function fillDurations() {
  const size = $("size").value;
  const select = $("duration");
  select.replaceChildren();
  for (const shape of model.shapes.filter((s) => s.size === size)) {
    select.append(option(shape.seconds, `${shape.frames} frames (${shape.seconds} s)`));
  }
}

function showModel(card) {
  model = card;
  $("model").textContent = `${card.id}: ${card.title}, ${card.fps} fps (bundle ${card.bundle_id})`;
  const sizes = [...new Set(card.shapes.map((s) => s.size))];
  $("size").replaceChildren(...sizes.map((s) => option(s, s.replace("x", " × "))));
  // Wan-Animate 2 makes the video at the image's aspect: left to the server, the first size whose area that aspect
  // makes is taken (a size picked is the area asked for)
  if (card.animate_2) $("size").prepend(option("", "Any: the image's aspect picks"));
  $("size").selectedIndex = 0;
  fillDurations();
  $("steps").placeholder = String(card.defaults.steps);
  $("guidance").placeholder = String(card.defaults.guidance);
  $("guidance-2-field").hidden = card.experts < 2;
  $("sampler").value = card.defaults.sampler;
  $("sigmas").placeholder = card.defaults.sigmas ? card.defaults.sigmas.join(",") : "e.g. 1,0.75,0.5,0.25";
  $("video-field").hidden = !card.video;
  $("mask-field").hidden = !card.mask;
  $("references-field").hidden = Math.max(...card.reference_images) === 0;
  $("strength-field").hidden = !card.video_to_video;
  $("conditioning-field").hidden = !card.mask;
  $("image-field").hidden = card.image === "none";
  $("image-label").textContent = card.animate || card.animate_2 ? "Character image" : "Image (first frame)";
  $("animate-fields").hidden = !card.animate;
  $("pose-video").required = $("face-video").required = Boolean(card.animate);
  $("animate2-fields").hidden = !card.animate_2;
  $("driving-video").required = Boolean(card.animate_2);
  $("a2-fps").placeholder = String(card.fps);
  $("a2-prev").max = String(Math.max(...card.shapes.map((s) => s.frames)) - 1);
  // the pose or driving video's length; any length
  $("duration-field").hidden = Boolean(card.animate || card.animate_2 || card.forcing || card.helios);
  $("forcing-fields").hidden = !card.forcing;
  $("helios-fields").hidden = !card.helios;
  $("pyramid-field").hidden = !(card.helios && card.pyramid > 1);
  for (const [on, id] of [[card.forcing, "df-seconds"], [card.helios, "helios-seconds"]]) {
    if (!on) continue;
    $(id).max = String(card.max_seconds);
    $(id).placeholder = model.shapes[0].seconds;
  }
  if (card.helios && card.pyramid > 1) {
    $("pyramid-steps").placeholder = Array(card.pyramid).fill(card.defaults.steps).join(",");
  }
  $("image").required = card.image === "required";
  $("last-image-field").hidden = !card.last_image;
  $("last-image").required = card.image === "required" && card.last_image; // diffusion forcing: optional
  $("loras").replaceChildren();
  $("lora-field").hidden = !(card.loras && card.loras.length);
  updateAddLora();
  $("edit-image").hidden = !card.image_edit;
  if (card.image_edit) {
    $("edit-shape").replaceChildren(...card.edit_sizes.map((s) => option(s, s.replace("x", " × "))));
    $("edit-passes").placeholder = String(card.defaults.steps);
    $("edit-guidance").placeholder = String(card.defaults.guidance);
  }
  $("live").hidden = card.kind !== "anyflow-far";
  $("live-passes").placeholder = String(card.defaults.steps);
  $("key-form").hidden = true;
  $("generate").hidden = false;
}

// A live session (AnyFlow-FAR bundles): GET /v1/realtime/video as a WebSocket (runtime/serve/realtime.py). A page
// cannot set a header on a WebSocket: the key goes as the subprotocol `wan-aot-key.<hex>`. The server's first binary
// message is the fMP4 init segment, then each chunk's chunk.done comes with one binary message, its fragments: each
// is appended to a MediaSource as it arrives, so the chunks play while the next ones are made.
function hex(text) {
  return [...new TextEncoder().encode(text)].map((b) => b.toString(16).padStart(2, "0")).join("");
}

function avcCodec(init) { // "avc1.PPCCLL" from the init segment's avcC box (profile, constraints, level)
  const b = new Uint8Array(init);
  for (let i = 0; i + 8 < b.length; i++) {
    if (b[i] === 0x61 && b[i + 1] === 0x76 && b[i + 2] === 0x63 && b[i + 3] === 0x43) {
      return "avc1." + [b[i + 5], b[i + 6], b[i + 7]].map((x) => x.toString(16).padStart(2, "0")).join("");
    }
  }
  return "avc1.64001f";
}

function startLive(event) {
  event.preventDefault();
  endLive();
  $("live-error").textContent = "";
  $("live-chunks").replaceChildren();
  if (!window.MediaSource) {
    $("live-error").textContent = "This browser has no Media Source Extensions: it cannot play a live session.";
    return;
  }
  const protocols = ["wan-aot.realtime"];
  const key = sessionStorage.getItem(KEY);
  if (key) protocols.push("wan-aot-key." + hex(key));
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const ws = new WebSocket(`${scheme}//${location.host}/v1/realtime/video`, protocols);
  ws.binaryType = "arraybuffer";
  const source = new MediaSource();
  const session = { ws, source, buffer: null, queue: [], done: false, opening: null };
  session.opening = new Promise((resolve) => source.addEventListener("sourceopen", resolve, { once: true }));
  const video = $("live-video");
  video.src = URL.createObjectURL(source);
  video.hidden = false;
  live = session;
  ws.addEventListener("message", (message) => liveMessage(session, message));
  ws.addEventListener("close", (e) => {
    if (!session.done && live === session) {
      $("live-error").textContent = e.code === 1006 && !session.created
        ? "The session could not be opened (is the API key right?)" : `The session closed (${e.code} ${e.reason})`;
    }
    if (live === session) liveControls(false);
  });
  $("live-status").textContent = "Connecting…";
  $("live-start").disabled = true;
}

function liveControls(running) {
  $("live-controls").hidden = !running;
  $("live-start").disabled = running;
}

function liveMessage(session, message) {
  if (typeof message.data !== "string") { // the init segment, then one chunk's fragments per message
    session.queue.push(message.data);
    pump(session);
    return;
  }
  const event = JSON.parse(message.data);
  if (event.type === "session.created") {
    session.created = true;
    const settings = { prompt: $("live-prompt").value, size: $("size").value };
    if ($("live-passes").value !== "") settings.steps = Number($("live-passes").value);
    if ($("live-noise").value !== "") settings.seed = Number($("live-noise").value);
    session.ws.send(JSON.stringify({ type: "session.start", session: settings }));
    $("live-status").textContent = "Starting…";
    liveControls(true);
  } else if (event.type === "chunk.done") {
    session.chunks = (session.chunks || 0) + 1;
    const li = document.createElement("li");
    li.dataset.chunk = String(event.chunk);
    const frames = `${event.frames} frame${event.frames === 1 ? "" : "s"}`;
    li.textContent = `Chunk ${event.chunk}: ${frames} in ${event.elapsed} s · ${event.prompt}`;
    $("live-chunks").append(li);
    $("live-status").textContent = `Playing: chunk ${event.chunk} made`;
  } else if (event.type === "prompt.applied") {
    $("live-status").textContent = `The new prompt holds from chunk ${event.chunk}`;
  } else if (event.type === "session.done") {
    session.done = true;
    $("live-status").textContent = `Done: ${event.chunks} chunks, ${event.frames} frames${event.stopped ? " (stopped)" : ""}`;
    liveControls(false);
    pump(session);
  } else if (event.type === "error") {
    $("live-error").textContent = event.error.message;
    // refused before it started (a bad setting, the devices busy): the form is free for another try
    if (!session.chunks && ["invalid_value", "server_busy", "draining"].includes(event.error.code)) endLive();
  }
}

async function pump(session) { // one append at a time, in order; the stream ended once all are in
  if (!session.buffer) {
    if (session.waiting || !session.queue.length) return;
    session.waiting = true;
    await session.opening;
    session.buffer = session.source.addSourceBuffer(`video/mp4; codecs="${avcCodec(session.queue[0])}"`);
    session.buffer.addEventListener("updateend", () => pump(session));
  }
  if (session.buffer.updating || session.source.readyState !== "open") return;
  if (session.queue.length) {
    session.buffer.appendBuffer(session.queue.shift());
    $("live-video").play().catch(() => {}); // muted: autoplay is allowed
  } else if (session.done) {
    session.source.endOfStream();
  }
}

function endLive() {
  if (live === null) return;
  if (live.ws.readyState <= WebSocket.OPEN) live.ws.close();
  URL.revokeObjectURL($("live-video").src);
  live = null;
  liveControls(false);
}

function send(event) {
  if (live !== null && live.ws.readyState === WebSocket.OPEN) live.ws.send(JSON.stringify(event));
}

// An image edit (POST /v1/images/edits, as the openai SDK's images.edit sends it): the request waits for the edit's
// job and answers its PNG (base64), shown here with a download link.
async function editImage(event) {
  event.preventDefault();
  $("edit-error").textContent = "";
  const form = new FormData();
  form.append("image", $("edit-file").files[0]);
  form.append("prompt", $("edit-prompt").value);
  form.append("size", $("edit-shape").value);
  form.append("response_format", "b64_json");
  const numbers = { num_inference_steps: "edit-passes", guidance_scale: "edit-guidance", seed: "edit-noise" };
  for (const [name, id] of Object.entries(numbers)) if ($(id).value !== "") form.append(name, $(id).value);
  const prompt = $("edit-prompt").value;
  $("edit-submit").disabled = true;
  $("edit-status").textContent = "Editing… (queued as a job: see Jobs)";
  try {
    const answer = await (await api("/v1/images/edits", { method: "POST", body: form })).json();
    const bytes = Uint8Array.from(atob(answer.data[0].b64_json), (c) => c.charCodeAt(0));
    const url = URL.createObjectURL(new Blob([bytes], { type: "image/png" }));
    const img = document.createElement("img");
    img.className = "edited";
    img.src = url;
    img.alt = "Edited: " + prompt;
    const link = document.createElement("a");
    link.href = url;
    link.download = "edited.png";
    link.textContent = "Download the PNG";
    for (const old of $("edit-result").querySelectorAll("img")) URL.revokeObjectURL(old.src);
    $("edit-result").replaceChildren(img, link);
    $("edit-status").textContent = `Edited (${answer.size}).`;
  } catch (e) {
    $("edit-status").textContent = "";
    if (e.status === 401) askForKey(e.message);
    else $("edit-error").textContent = e.message;
  } finally {
    $("edit-submit").disabled = false;
  }
}

// LoRA adapters: one row per adapter of the request (at most the server's max_loras), each a name, a scale and, on
// two-expert bundles, the expert it is applied to.
function loraRow() {
  const li = document.createElement("li");
  const name = document.createElement("select");
  name.className = "lora-name";
  name.setAttribute("aria-label", "LoRA");
  for (const a of model.loras) name.append(option(a.name, `${a.name} (rank ${a.rank}, ${a.experts.join(" + ")})`));
  const scale = document.createElement("input");
  scale.className = "lora-scale";
  scale.type = "number";
  scale.min = "-4";
  scale.max = "4";
  scale.step = "0.05";
  scale.value = "1";
  scale.setAttribute("aria-label", "LoRA scale");
  li.append(name, scale);
  if (model.experts > 1) {
    const expert = document.createElement("select");
    expert.className = "lora-expert";
    expert.setAttribute("aria-label", "LoRA expert");
    expert.append(option("", "its experts"), option("high", "high noise"), option("low", "low noise"));
    li.append(expert);
  }
  const remove = document.createElement("button");
  remove.type = "button";
  remove.textContent = "Remove";
  remove.addEventListener("click", () => {
    li.remove();
    updateAddLora();
  });
  li.append(remove);
  return li;
}

function updateAddLora() {
  $("add-lora").hidden = !model || !model.loras || $("loras").children.length >= model.max_loras;
}

function chosenLoras() {
  return [...$("loras").children].map((li) => {
    const entry = { name: li.querySelector(".lora-name").value, scale: Number(li.querySelector(".lora-scale").value) };
    const expert = li.querySelector(".lora-expert");
    if (expert && expert.value) entry.expert = expert.value;
    return entry;
  });
}

async function start() {
  try {
    const list = await (await api("/v1/models")).json();
    showModel(list.data[0]);
    startPolling();
  } catch (e) {
    if (e.status === 401) {
      askForKey(sessionStorage.getItem(KEY) ? e.message : "");
    } else if (e.status === 503) { // loading (or draining): say so, and ask again
      $("model").textContent = e.message.includes("loading") ? "Loading the model…" : e.message;
      setTimeout(start, 2000);
    } else {
      $("model").textContent = "The server cannot be reached: " + e.message;
    }
  }
}

async function generate(event) {
  event.preventDefault();
  $("form-error").textContent = "";
  const fields = {
    prompt: $("prompt").value,
    negative_prompt: $("negative-prompt").value,
    size: $("size").value,
  };
  if (model.animate) {
    fields.mode = $("mode").value;
    fields.prev_segment_frames = Number($("prev-frames").value);
  } else if (model.animate_2) { // as long as the driving video: no seconds; an empty box is the server's default
    if ($("prompt-ref").value !== "") fields.prompt_ref = $("prompt-ref").value;
    if (fields.size === "") delete fields.size;
  } else if (model.forcing) {
    if ($("df-seconds").value !== "") fields.seconds = $("df-seconds").value;
  } else if (model.helios) {
    if ($("helios-seconds").value !== "") fields.seconds = $("helios-seconds").value;
    const stages = $("pyramid-steps").value.replace(/\s+/g, "");
    if (model.pyramid > 1 && stages !== "") {
      fields.pyramid_num_inference_steps_list = stages.split(",").map(Number);
    }
  } else {
    fields.seconds = $("duration").value;
  }
  const numbers = { num_inference_steps: "steps", guidance_scale: "guidance", seed: "seed" };
  if (model.experts > 1) numbers.guidance_scale_2 = "guidance-2";
  if (model.video_to_video) numbers.strength = "strength";
  if (model.mask) numbers.conditioning_scale = "conditioning";
  if (model.animate_2) {
    Object.assign(numbers, { fps: "a2-fps", driving_video_fps: "driving-fps",
      prev_segment_conditioning_frames: "a2-prev" });
  }
  if (model.forcing) {
    Object.assign(numbers, { overlap_history: "overlap-history", ar_step: "ar-step", causal_block_size: "causal-block",
      addnoise_condition: "addnoise" });
  }
  for (const [name, id] of Object.entries(numbers)) {
    if ($(id).value !== "") fields[name] = Number($(id).value);
  }
  if ($("sampler").value !== model.defaults.sampler) fields.sampler = $("sampler").value;
  const loras = chosenLoras();
  if (loras.length) fields.lora = loras;
  const sigmas = $("sigmas").value.replace(/\s+/g, "");
  if (sigmas !== "") {
    fields.sigmas = sigmas;
    delete fields.num_inference_steps; // sigmas set the step count
  }
  // files: the first frame or the video go in input_reference
  const files = [["input_reference", $("image")], ["input_reference", $("video")], ["last_image", $("last-image")],
    ["mask", $("mask")], ...[...$("references").files].map((f) => ["reference_image", { files: [f] }])];
  if (model.animate_2) files.push(["driving_video", $("driving-video")]);
  if (model.animate) {
    files.push(["pose_video", $("pose-video")], ["face_video", $("face-video")]);
    if ($("mode").value === "replace") {
      files.push(["background_video", $("background-video")], ["mask_video", $("mask-video")]);
    }
  }
  const withFiles = files.some(([, input]) => input.files.length);
  let options;
  if (withFiles || sigmas !== "") {
    const form = new FormData();
    for (const [name, value] of Object.entries(fields)) {
      form.append(name, name === "lora" ? JSON.stringify(value) : String(value)); // lora: its JSON, as one field
    }
    for (const [name, input] of files) if (input.files.length) form.append(name, input.files[0]);
    options = { method: "POST", body: form };
  } else {
    options = { method: "POST", body: JSON.stringify(fields), headers: { "Content-Type": "application/json" } };
  }
  try {
    await api("/v1/videos", options);
    await refresh();
  } catch (e) {
    if (e.status === 401) askForKey(e.message);
    else $("form-error").textContent = e.message;
  }
}

function jobItem(job) {
  const li = document.createElement("li");
  li.dataset.id = job.id;
  const head = document.createElement("div");
  head.className = "job-head";
  const prompt = document.createElement("span");
  prompt.className = "job-prompt";
  const meta = document.createElement("span");
  meta.className = "job-meta";
  head.append(prompt, meta);
  const bar = document.createElement("progress");
  bar.max = 100;
  bar.setAttribute("aria-label", "Progress");
  const error = document.createElement("p");
  error.className = "error";
  li.append(head, bar, error);
  return li;
}

function updateItem(li, job) {
  li.querySelector(".job-prompt").textContent = job.prompt;
  li.querySelector(".job-meta").textContent = `${job.size}, ${job.seconds} s · ${job.status.replace("_", " ")}`;
  const bar = li.querySelector("progress");
  bar.value = job.progress;
  bar.hidden = job.status === "completed" || job.status === "failed";
  li.querySelector(".error").textContent = job.status === "failed" && job.error ? job.error.message : "";
  // A running job's live preview: the server's current estimate of its middle frame (variant=thumbnail), stored
  // from its first step on, so it is there once progress shows.
  if (job.status === "in_progress" && job.progress >= 1) showPreview(li, job);
  else if (job.status !== "in_progress") dropPreview(li);
  // A segment kind's running job plays as it is made: each segment's (Helios: chunk's) frames join its live stream
  // once decoded.
  const segmented = model && (model.forcing || model.animate || model.animate_2 || model.helios);
  if (job.status === "in_progress" && segmented) showLive(li, job);
  else if (job.status !== "in_progress") dropLive(li);
  if (job.status === "completed" && !li.querySelector("video:not(.live), img.edited")) showVideo(li, job);
}

async function showPreview(li, job) {
  if (li.dataset.previewing) return; // one request at a time per job
  li.dataset.previewing = "1";
  try {
    const path = `/v1/videos/${encodeURIComponent(job.id)}/content?variant=thumbnail`;
    const blob = await (await api(path)).blob();
    let img = li.querySelector("img.preview");
    if (!img) {
      img = document.createElement("img");
      img.className = "preview";
      img.alt = "Live preview: " + job.prompt;
      li.insertBefore(img, li.querySelector(".error"));
    }
    const old = img.src;
    img.src = URL.createObjectURL(blob);
    if (old) URL.revokeObjectURL(old);
  } catch (_) {
    // The job ended meanwhile (its video follows) or was cancelled: the next poll says which.
  } finally {
    delete li.dataset.previewing;
  }
}

function dropPreview(li) {
  const img = li.querySelector("img.preview");
  if (img) {
    URL.revokeObjectURL(img.src);
    img.remove();
  }
}

// The live stream through hls.js (ui/hls.light.min.js), which adds the key to each request, where the browser has
// Media Source Extensions; elsewhere the live preview stays what shows the job running.
function showLive(li, job) {
  if (li.querySelector("video.live") || !window.Hls || !Hls.isSupported()) return;
  const video = document.createElement("video");
  video.className = "live";
  video.muted = true;
  video.autoplay = true;
  video.controls = true;
  video.playsInline = true;
  video.setAttribute("aria-label", "Live: " + job.prompt);
  const player = new Hls({
    enableWorker: false, // the page's Content-Security-Policy starts no worker
    xhrSetup: (xhr) => {
      const key = sessionStorage.getItem(KEY);
      if (key) xhr.setRequestHeader("Authorization", "Bearer " + key);
    },
  });
  player.loadSource(`/v1/videos/${encodeURIComponent(job.id)}/stream.m3u8`);
  player.attachMedia(video);
  lives.set(job.id, player);
  li.insertBefore(video, li.querySelector(".error"));
}

function dropLive(li) {
  const video = li.querySelector("video.live");
  if (!video) return;
  lives.get(li.dataset.id)?.destroy();
  lives.delete(li.dataset.id);
  video.remove();
}

async function showVideo(li, job) {
  li.dataset.loading = "1";
  try {
    if (!videos.has(job.id)) {
      const blob = await (await api(`/v1/videos/${encodeURIComponent(job.id)}/content`)).blob();
      videos.set(job.id, URL.createObjectURL(blob));
      if (blob.type === "image/png") images.add(job.id);
    }
    if (li.querySelector("video:not(.live), img.edited")) return;
    const link = document.createElement("a");
    link.href = videos.get(job.id);
    link.textContent = "Download";
    if (images.has(job.id)) { // an image edit's job: its content is the PNG
      const img = document.createElement("img");
      img.className = "edited";
      img.src = videos.get(job.id);
      img.alt = "Image: " + job.prompt;
      link.download = job.id + ".png";
      li.append(img, link);
      return;
    }
    const video = document.createElement("video");
    video.controls = true;
    video.loop = true;
    video.muted = true;
    video.src = videos.get(job.id);
    video.setAttribute("aria-label", "Video: " + job.prompt);
    link.download = job.id + ".mp4";
    li.append(video, link);
  } catch (e) {
    li.querySelector(".error").textContent = "Cannot load the video: " + e.message;
  }
}

async function refresh() {
  let page;
  try {
    page = await (await api("/v1/videos?limit=20")).json();
  } catch (e) {
    if (e.status === 401) askForKey(e.message);
    return;
  }
  const list = $("jobs");
  const items = new Map([...list.children].map((li) => [li.dataset.id, li]));
  const ordered = page.data.map((job) => {
    const li = items.get(job.id) || jobItem(job);
    updateItem(li, job);
    return li;
  });
  ordered.forEach((li, i) => {
    if (list.children[i] !== li) list.insertBefore(li, list.children[i] || null);
  });
  for (const [id, li] of items) if (!page.data.some((j) => j.id === id)) li.remove();
}

function startPolling() {
  stopPolling();
  refresh();
  polling = setInterval(refresh, 500);
}

function stopPolling() {
  if (polling !== null) clearInterval(polling);
  polling = null;
}

document.addEventListener("DOMContentLoaded", () => {
  $("generate").addEventListener("submit", generate);
  $("edit-image").addEventListener("submit", editImage);
  $("live").addEventListener("submit", startLive);
  $("live-update").addEventListener("click", () => {
    send({ type: "prompt.update", prompt: $("live-next").value });
    $("live-status").textContent = "Sent: the new prompt holds from the next chunk not yet started";
  });
  $("live-stop").addEventListener("click", () => send({ type: "session.stop" }));
  $("size").addEventListener("change", fillDurations);
  $("add-lora").addEventListener("click", () => {
    $("loras").append(loraRow());
    updateAddLora();
    $("loras").lastElementChild.querySelector("select").focus();
  });
  $("mode").addEventListener("change", () => {
    $("replace-fields").hidden = $("mode").value !== "replace";
    $("background-video").required = $("mask-video").required = $("mode").value === "replace";
  });
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, $("api-key").value);
    start();
  });
  start();
});
