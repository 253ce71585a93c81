/*
 * minillm's memory view: the KV cache of a running (or recorded) engine, one block per square.
 *
 * What it shows, for one engine step (a FRAME):
 *   - the device pool, the host tier and the disk tier as grids of blocks coloured by state
 *     (free, held, being written, shared, cached, swapped out, spilled), with the blocks copied
 *     between tiers this step outlined;
 *   - every sequence's block table (the running batch, then the waiting queue);
 *   - the log of preemptions and their causes, and five counters as numbers and small charts.
 *
 * Where the data comes from (all same-origin GETs; a frame's fields: minillm/view/frames.py):
 *   GET /memory/info           which mode (live or replay) and whether an API key is needed;
 *   GET /memory/stream         live: a server-sent-event stream of frames, read with fetch()
 *                              because EventSource cannot send the Authorization header;
 *   GET /memory/replay         replay: the number of frames and every frame's counters;
 *   GET /memory/frames/{i}     replay: frame i.
 *
 * The page is served under a strict CSP: no inline script or style, and no innerHTML. Request ids
 * are user text, so everything from a frame reaches the page through textContent or a canvas.
 *
 * Reading order: constants; fetching (the key, live stream, replay); one frame's derived facts;
 * drawing (header, grids, requests, log, counters); the hover tooltip; start.
 */

const LIVE_HISTORY = 300; // frames of counters the live charts keep
const RETRY_MS = 2000; // wait before reconnecting a stream that ended
const STALL_MS = 30000; // a stream silent this long (no frame, no keepalive) counts as dead
const PLAY_INTERVAL_MS = 100; // replay plays ~10 frames per second
const CACHE_BLOCKS = 2_000_000; // replay frames kept in memory, counted in blocks (~20 MB of heap)
const GRID_WIDTH = 900; // px: the device pool fits this width...
const GRID_MAX_HEIGHT = 420; // ...and this height, with squares of MIN_CELL..MAX_CELL px
const MIN_CELL = 4;
const MAX_CELL = 22;
const TABLE_CELL = 10; // px per block in a request's block table
const TABLE_COLUMNS = 48; // blocks per line of a request's block table
const CHART_HEIGHT = 44; // px of each counter's chart

const STATE_NAMES = {
  ".": "free",
  h: "held",
  w: "being written",
  s: "shared",
  c: "cached (free, findable by content)",
  o: "swapped out",
  p: "spilled (cached, in the host tier)",
};

const COUNTERS = [
  { key: "utilization", label: "device pool used", format: formatPercent, max: 1 },
  { key: "hit_rate", label: "prefix-cache hit rate", format: formatPercent, max: 1 },
  { key: "tokens_per_s", label: "tokens computed per second", format: (v) => `${Math.round(v)} tok/s` },
  { key: "preemptions", label: "preemptions so far", format: (v) => String(v) },
  { key: "bytes_moved", label: "KV copied between tiers", format: formatBytes },
];

const byId = (id) => document.getElementById(id);
/** Set an element's text only when it changes: an unchanged element is not laid out again. */
const setText = (element, text) => {
  if (element.textContent !== text) element.textContent = text;
};
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const page = {
  apiKey: null, // kept here only: never stored, never put in a URL
  view: null, // the frame on screen and the facts derived from it (see describeFrame)
  arrivedAt: 0, // performance.now() when the live frame on screen arrived
  history: [], // live: the COUNTERS of the last LIVE_HISTORY frames
  unshown: null, // live: the latest frame that came while the tab was hidden
  replay: null, // replay: the index from /memory/replay, the frame cache and the cursor
  hover: null, // the pointer over a block: {canvas, clientX, clientY}
  colours: null, // the block colours, read once from memory.css
};

const gridLayouts = new WeakMap(); // canvas -> {ids, cell, columns}: drawBlocks sets it, the tooltip reads it

// ---------------------------------------------------------------------------------------------
// Fetching: every request carries the key; a 401 sends the reader back to the key form.

class KeyRejected extends Error {}

/** GET a same-origin path with the Authorization header when a key was given. */
async function get(path, signal) {
  const headers = page.apiKey === null ? {} : { Authorization: `Bearer ${page.apiKey}` };
  const response = await fetch(path, { headers, signal, cache: "no-store" });
  if (response.status === 401) throw new KeyRejected("wrong key");
  if (!response.ok) throw new Error(`${path} answered HTTP ${response.status}`);
  return response;
}

/** Show the key form with a message; resolve with the key the reader submits. */
function askForKey(message) {
  const form = byId("key-form");
  const input = byId("key-input");
  byId("key-message").textContent = message;
  form.hidden = false;
  input.value = "";
  input.focus();
  setStatus(message || "waiting for the API key", message !== "");
  return new Promise((resolve) => {
    form.addEventListener(
      "submit",
      (event) => {
        event.preventDefault(); // the CSP forbids form submission; the key goes in a header
        form.hidden = true;
        const key = input.value.trim();
        input.value = ""; // the key lives in one variable only, not in the page
        resolve(key);
      },
      { once: true },
    );
  });
}

/** Run `action` until the server accepts the key, asking the reader again after each 401. */
async function withKey(action) {
  for (;;) {
    try {
      return await action();
    } catch (error) {
      if (!(error instanceof KeyRejected)) throw error;
      page.apiKey = await askForKey("wrong key: try again");
    }
  }
}

/** GET /memory/info, retrying every RETRY_MS until the server answers. */
async function fetchInfo() {
  for (;;) {
    try {
      return await (await get("/memory/info")).json();
    } catch (error) {
      setStatus(`cannot reach the server (${error.message}): retrying`, true);
      await sleep(RETRY_MS);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Live mode: read the frame stream; when it ends, say so and reconnect after RETRY_MS.

async function runLive() {
  setInterval(showAge, 250);
  document.addEventListener("visibilitychange", () => {
    if (document.hidden || page.unshown === null) return;
    const frame = page.unshown;
    page.unshown = null;
    drawLiveFrame(frame);
  });
  for (;;) {
    setStatus("connecting…");
    let ending;
    try {
      const error = await withKey(readStream);
      ending = error === null ? "stream ended" : `error: ${error}`;
    } catch (error) {
      ending = error.name === "AbortError" ? "stream went silent" : error.message;
    }
    setStatus(`disconnected (${ending}): retrying in ${RETRY_MS / 1000} s`, true);
    await sleep(RETRY_MS);
  }
}

/** Read /memory/stream until it ends; return the server's error text, or null for a plain end. */
async function readStream() {
  const connection = new AbortController();
  let stallTimer = null;
  const expectMoreWithin = (ms) => {
    clearTimeout(stallTimer);
    stallTimer = setTimeout(() => connection.abort(), ms);
  };
  expectMoreWithin(STALL_MS);
  const closeOnLeave = () => connection.abort(); // a page kept in the back-forward cache lets its stream go
  window.addEventListener("pagehide", closeOnLeave);
  try {
    const response = await get("/memory/stream", connection.signal);
    setStatus("live");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    const parser = new EventStreamParser();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return null;
      expectMoreWithin(STALL_MS);
      for (const data of parser.push(decoder.decode(value, { stream: true }))) {
        const message = JSON.parse(data);
        if ("error" in message) return message.error;
        onLiveFrame(message);
      }
    }
  } finally {
    clearTimeout(stallTimer);
    window.removeEventListener("pagehide", closeOnLeave);
    connection.abort(); // closes the stream when we stop early; a no-op once it has ended
  }
}

/** Turns decoded text/event-stream chunks into the data of each complete message. */
class EventStreamParser {
  constructor() {
    this.partialLine = ""; // a line cut by the chunk boundary waits for its end
    this.dataLines = []; // the `data:` lines of the message being read
  }

  push(text) {
    const lines = (this.partialLine + text).split(/\r\n|\r|\n/);
    this.partialLine = lines.pop();
    const messages = [];
    for (const line of lines) {
      if (line === "") {
        if (this.dataLines.length > 0) messages.push(this.dataLines.join("\n"));
        this.dataLines = [];
      } else if (line.startsWith("data:")) {
        this.dataLines.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      } // lines starting with ":" are keepalive comments; other fields are not used
    }
    return messages;
  }
}

function onLiveFrame(frame) {
  page.arrivedAt = performance.now();
  page.history.push(frame.counters);
  if (page.history.length > LIVE_HISTORY) page.history.shift();
  if (document.hidden) {
    page.unshown = frame; // a hidden tab draws nothing; shown again, it draws the latest frame
    return;
  }
  drawLiveFrame(frame);
}

function drawLiveFrame(frame) {
  showFrame(frame);
  drawCounters(page.history, null);
  // the lag: how long after the engine ended the step drawn it is on screen (one machine's clock)
  const lag = Date.now() / 1000 - frame.ts;
  byId("status").dataset.lag = lag.toFixed(3);
  setStatus(`live · drawn ${lag.toFixed(2)} s after its step`);
}

function showAge() {
  if (page.view === null) return;
  setText(byId("age"), ((performance.now() - page.arrivedAt) / 1000).toFixed(1));
}

// ---------------------------------------------------------------------------------------------
// Replay mode: a scrubber over the recorded frames; frames are fetched on demand and cached.

async function runReplay() {
  const index = await withKey(async () => (await get("/memory/replay")).json());
  page.replay = {
    count: index.frames,
    steps: index.steps,
    counters: index.counters,
    cache: new Map(), // frame index -> FRAME, oldest first
    wanted: 0, // the frame the controls point at
    shown: -1, // the frame on screen
    loading: false,
    playTimer: null,
  };
  byId("counters-caption").textContent = `the whole run (${index.frames} frames); the red line is this frame`;
  if (index.frames === 0) {
    setStatus("the recording has no frames", true);
    return;
  }
  setUpReplayControls(index.frames);
  goTo(0);
}

function setUpReplayControls(count) {
  const scrubber = byId("scrubber");
  scrubber.max = String(count - 1);
  scrubber.addEventListener("input", () => goTo(Number(scrubber.value)));
  byId("back").addEventListener("click", () => goTo(page.replay.wanted - 1));
  byId("forward").addEventListener("click", () => goTo(page.replay.wanted + 1));
  byId("play").addEventListener("click", togglePlay);
  document.addEventListener("keydown", onReplayKey);
  byId("replay-controls").hidden = false;
}

function onReplayKey(event) {
  if (event.target === byId("key-input")) return;
  const direction = { ArrowLeft: -1, ArrowRight: 1 }[event.key];
  if (direction === undefined) return;
  event.preventDefault(); // the focused scrubber would move a second time
  goTo(page.replay.wanted + direction);
}

/** Point the controls at frame i (clamped) and bring it on screen. */
function goTo(i) {
  const replay = page.replay;
  replay.wanted = Math.max(0, Math.min(replay.count - 1, i));
  byId("scrubber").value = String(replay.wanted);
  byId("frame-label").textContent =
    `step ${replay.steps[replay.wanted]} (frame ${replay.wanted + 1} of ${replay.count})`;
  loadWanted();
}

/** Show the wanted frame; while one fetch runs, later moves only update `wanted`. */
async function loadWanted() {
  const replay = page.replay;
  if (replay.loading) return;
  replay.loading = true;
  try {
    while (replay.shown !== replay.wanted) {
      const i = replay.wanted;
      const frame = await withKey(() => replayFrame(i));
      replay.shown = i;
      showFrame(frame);
      drawCounters(replay.counters, i);
      setStatus(replay.playTimer === null ? "paused" : "playing");
    }
  } catch (error) {
    pause();
    setStatus(`could not load frame ${replay.wanted + 1}: ${error.message}`, true);
  } finally {
    replay.loading = false;
  }
}

async function replayFrame(i) {
  const cache = page.replay.cache;
  if (cache.has(i)) return cache.get(i);
  const frame = await (await get(`/memory/frames/${i}`)).json();
  cache.set(i, frame);
  // at most CACHE_BLOCKS blocks' worth of frames (a frame of 1M blocks is ~11 MB of heap), 2 at least
  const most = Math.max(2, Math.floor(CACHE_BLOCKS / Math.max(1, frame.states.length)));
  while (cache.size > most) cache.delete(cache.keys().next().value);
  return frame;
}

function togglePlay() {
  if (page.replay.playTimer === null) play();
  else pause();
}

function play() {
  const replay = page.replay;
  if (replay.wanted === replay.count - 1) goTo(0);
  replay.playTimer = setInterval(() => {
    if (replay.loading) return; // a slow fetch: wait instead of queueing frames
    if (replay.wanted === replay.count - 1) pause();
    else goTo(replay.wanted + 1);
  }, PLAY_INTERVAL_MS);
  byId("play").textContent = "pause";
  setStatus("playing");
}

function pause() {
  clearInterval(page.replay.playTimer);
  page.replay.playTimer = null;
  byId("play").textContent = "play";
  setStatus("paused");
}

// ---------------------------------------------------------------------------------------------
// One frame's derived facts: where each block's state sits, who holds it, what moved.

function describeFrame(frame) {
  const pooled = frame.device + frame.host; // ids 0..pooled-1 index `states` directly
  const diskSlot = new Map(frame.disk.map((id, k) => [id, pooled + k]));
  const holders = new Map(); // block id -> [sequence], from inverting the block tables
  for (const sequence of frame.sequences) {
    for (const id of sequence.blocks) {
      if (!holders.has(id)) holders.set(id, []);
      holders.get(id).push(sequence);
    }
  }
  const moved = new Set(frame.moves.flatMap(([, source, destination]) => [source, destination]));
  const slotOf = (id) => (id < pooled ? id : diskSlot.get(id));
  return { frame, slotOf, holders, moved, stateOf: (id) => frame.states[slotOf(id)] ?? "." };
}

function colourOf(view, id) {
  const state = view.stateOf(id);
  if (state !== "s") return page.colours[state];
  const sharers = Math.min(4, Math.max(1, view.holders.get(id)?.length ?? 1));
  return page.colours[`s${sharers}`];
}

function readColours() {
  const style = getComputedStyle(document.documentElement);
  const read = (name) => style.getPropertyValue(`--${name}`).trim();
  return {
    ".": read("free"),
    h: read("held"),
    w: read("writing"),
    c: read("cached"),
    o: read("swapped"),
    p: read("spilled"),
    s1: read("shared-1"),
    s2: read("shared-2"),
    s3: read("shared-3"),
    s4: read("shared-4"),
    moved: read("moved"),
    hitDot: read("hit-dot"),
    chart: read("chart"),
    chartFill: read("chart-fill"),
    cursor: read("cursor"),
  };
}

// ---------------------------------------------------------------------------------------------
// Drawing a frame.

function showFrame(frame) {
  const view = describeFrame(frame);
  page.view = view;
  showHeader(frame);
  showDevice(view);
  showHost(view);
  showDisk(view);
  showRequests(view);
  showLog(frame.log);
  refreshTooltip();
  document.body.dataset.ready = "1";
}

function showHeader(frame) {
  setText(byId("step"), String(frame.step));
  setText(byId("t"), frame.t.toFixed(1));
  showAge();
}

function setStatus(text, bad = false) {
  const status = byId("status");
  setText(status, text);
  status.classList.toggle("bad", bad);
}

function showDevice(view) {
  const frame = view.frame;
  drawPool(byId("grid-device"), view, range(0, frame.device), poolCellSize(frame.device));
  setText(
    byId("device-caption"),
    `${frame.device} blocks × ${frame.block_size} tokens, ${formatBytes(frame.block_bytes)} each ` +
      `(all layers): ${formatBytes(frame.device * frame.block_bytes)} of KV cache. Hover a block for details.`,
  );
  showDeviceCounts(frame.states.slice(0, frame.device));
}

function showDeviceCounts(deviceStates) {
  const counts = { free: 0, held: 0, writing: 0, shared: 0, cached: 0 };
  const names = { ".": "free", h: "held", w: "writing", s: "shared", c: "cached" };
  for (const state of deviceStates) {
    if (state in names) counts[names[state]] += 1;
  }
  const legend = byId("device-counts");
  for (const [name, count] of Object.entries(counts)) {
    legend.dataset[name] = String(count);
    setText(legend.querySelector(`[data-count="${name}"]`), String(count));
  }
}

function showHost(view) {
  const frame = view.frame;
  showTier("host", view, range(frame.device, frame.device + frame.host), `${frame.host} blocks`);
}

function showDisk(view) {
  const frame = view.frame;
  showTier("disk", view, frame.disk, `${frame.disk.length} blocks`);
}

/** A lower tier's grid and caption (how full, copies this frame); hidden when it has no blocks. */
function showTier(name, view, ids, size) {
  const canvas = byId(`grid-${name}`);
  const empty = ids.length === 0;
  byId(`${name}-section`).hidden = empty;
  canvas.hidden = empty;
  canvas.dataset.blocks = "0";
  if (empty) return;
  // a block is drawn as large as in the device pool, so the tiers' sizes compare at a glance
  drawPool(canvas, view, ids, Math.min(poolCellSize(view.frame.device), poolCellSize(ids.length)));
  const held = ids.filter((id) => view.stateOf(id) !== ".").length;
  const copies = { out: 0, in: 0, spill: 0, back: 0 };
  const inTier = (id) => tierOf(view.frame, id) === name; // ids, not `disk`: a block copied in has left it
  for (const [kind, source, destination] of view.frame.moves) {
    if (kind in copies && (inTier(source) || inTier(destination))) copies[kind] += 1;
  }
  const copyText = Object.entries(copies).map(([kind, count]) => `${kind} ${count}`).join(" · ");
  setText(byId(`${name}-caption`), `${size}, ${held} in use. Copies this frame: ${copyText}.`);
}

/** Draw a pool's blocks as a grid of `cell`-px squares, GRID_WIDTH wide. */
function drawPool(canvas, view, ids, cell) {
  const columns = Math.max(1, Math.floor(GRID_WIDTH / cell));
  drawBlocks(canvas, view, ids, { cell, columns, hits: 0 });
}

/** The largest square (MIN_CELL..MAX_CELL px) that fits `count` blocks in GRID_WIDTH x GRID_MAX_HEIGHT. */
function poolCellSize(count) {
  for (let cell = MAX_CELL; cell > MIN_CELL; cell -= 1) {
    const rows = Math.ceil(count / Math.floor(GRID_WIDTH / cell));
    if (rows * cell <= GRID_MAX_HEIGHT) return cell;
  }
  return MIN_CELL;
}

/**
 * Paint blocks `ids` as squares, `columns` per row. One path per colour keeps this cheap
 * (4,096 blocks at 4 frames/s); the first `hits` blocks get a dot (prefix-cache hits).
 */
function drawBlocks(canvas, view, ids, { cell, columns, hits }) {
  const rows = Math.ceil(ids.length / columns);
  const context = sizeCanvas(canvas, Math.min(ids.length, columns) * cell, rows * cell);
  const gap = cell >= 6 ? 1 : 0;
  const corner = (k) => [(k % columns) * cell, Math.floor(k / columns) * cell];
  const byColour = new Map();
  ids.forEach((id, k) => {
    const colour = colourOf(view, id);
    if (!byColour.has(colour)) byColour.set(colour, []);
    byColour.get(colour).push(k);
  });
  for (const [colour, cells] of byColour) {
    context.fillStyle = colour;
    context.beginPath();
    for (const k of cells) context.rect(...corner(k), cell - gap, cell - gap);
    context.fill();
  }
  outlineMoved(context, view, ids, corner, cell - gap);
  dotHits(context, hits, corner, cell - gap);
  canvas.dataset.blocks = String(ids.length);
  gridLayouts.set(canvas, { ids, cell, columns });
}

function outlineMoved(context, view, ids, corner, size) {
  if (view.moved.size === 0) return;
  context.strokeStyle = page.colours.moved;
  context.lineWidth = size >= 8 ? 2 : 1;
  const inset = context.lineWidth / 2;
  ids.forEach((id, k) => {
    if (!view.moved.has(id)) return;
    const [x, y] = corner(k);
    context.strokeRect(x + inset, y + inset, size - 2 * inset, size - 2 * inset);
  });
}

function dotHits(context, hits, corner, size) {
  context.fillStyle = page.colours.hitDot;
  context.beginPath();
  for (let k = 0; k < hits; k += 1) {
    const [x, y] = corner(k);
    context.moveTo(x + size / 2 + size / 5, y + size / 2);
    context.arc(x + size / 2, y + size / 2, size / 5, 0, 2 * Math.PI);
  }
  context.fill();
}

/** Give a canvas this CSS size at the screen's pixel density; return its cleared 2D context. */
function sizeCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  const pixelWidth = Math.max(1, Math.round(width * ratio));
  const pixelHeight = Math.max(1, Math.round(height * ratio));
  if (canvas.width !== pixelWidth || canvas.height !== pixelHeight) {
    canvas.width = pixelWidth; // resizing clears the canvas and resets its context
    canvas.height = pixelHeight;
    canvas.style.width = `${width}px`;
    canvas.style.height = `${height}px`;
  }
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.clearRect(0, 0, width, height);
  return context;
}

// Requests: rows are kept per sequence id and updated in place, so a frame costs no new canvases.

const requestRows = new Map(); // seq id -> its row element

function showRequests(view) {
  const running = view.frame.sequences.filter((sequence) => sequence.status === "running");
  const queued = view.frame.sequences.filter((sequence) => sequence.status !== "running");
  const seen = new Set(view.frame.sequences.map((sequence) => sequence.seq));
  for (const seq of requestRows.keys()) {
    if (!seen.has(seq)) requestRows.delete(seq);
  }
  byId("requests").replaceChildren(
    groupHeading(`running batch: ${running.length}`),
    ...running.map((sequence) => updateRow(view, sequence)),
    groupHeading(`waiting queue: ${queued.length}`),
    ...queued.map((sequence) => updateRow(view, sequence)),
  );
}

function groupHeading(text) {
  const heading = document.createElement("div");
  heading.className = "group";
  heading.textContent = text;
  return heading;
}

function updateRow(view, sequence) {
  const row = requestRows.get(sequence.seq) ?? createRow(sequence.seq);
  requestRows.set(sequence.seq, row);
  const states = sequence.blocks.map((id) => view.stateOf(id)).join("");
  Object.assign(row.dataset, {
    seq: String(sequence.seq),
    request: sequence.request,
    status: sequence.status,
    states,
    hit: String(sequence.hit),
  });
  setText(row.querySelector(".request-id"), sequence.request);
  row.querySelector(".request-id").title = sequence.request;
  setText(row.querySelector(".state"), sequence.status);
  row.classList.toggle("idle", !sequence.ran);
  const preempted = row.querySelector(".preempted");
  setText(preempted, `preempted ${sequence.preemptions}×`);
  preempted.classList.toggle("some", sequence.preemptions > 0);
  // a table is drawn again only when a square would change: most rows keep theirs from step to step
  const moved = sequence.blocks.some((id) => view.moved.has(id));
  const drawn = `${sequence.blocks.join(",")}|${states}|${sequence.hit}|${moved}`;
  if (row.dataset.drawn !== drawn) {
    const table = row.querySelector("canvas");
    drawBlocks(table, view, sequence.blocks, { cell: TABLE_CELL, columns: TABLE_COLUMNS, hits: sequence.hit });
    row.dataset.drawn = drawn;
  }
  setText(row.querySelector(".table-size"), tableSummary(sequence));
  return row;
}

function tableSummary(sequence) {
  if (sequence.blocks.length === 0) return "no blocks yet";
  const hit = sequence.hit > 0 ? `, ${sequence.hit} from the prefix cache` : "";
  return `${sequence.blocks.length} blocks${hit}`;
}

function createRow(seq) {
  const row = document.createElement("div");
  row.className = "request";
  const cell = (className, tag = "span") => {
    const element = document.createElement(tag);
    element.className = className;
    row.append(element);
    return element;
  };
  cell("seq").textContent = `seq ${seq}`;
  cell("request-id");
  cell("state");
  cell("preempted");
  const table = cell("table", "div");
  const canvas = document.createElement("canvas");
  const size = document.createElement("span");
  size.className = "table-size unit";
  table.append(canvas, size);
  return row;
}

function showLog(lines) {
  const items = lines
    .slice()
    .reverse()
    .map(([step, text]) => {
      const stepLabel = document.createElement("span");
      stepLabel.className = "log-step";
      stepLabel.textContent = `step ${step}`;
      const item = document.createElement("li");
      item.append(stepLabel, text); // a string appended is a text node: never parsed as HTML
      return item;
    });
  if (items.length === 0) {
    items.push(document.createElement("li"));
    items[0].textContent = "nothing yet";
  }
  byId("log").replaceChildren(...items);
}

// Counters: the value at the cursor, and the series drawn as a small line chart.

function buildCounters() {
  const box = byId("counters");
  for (const counter of COUNTERS) {
    const row = document.createElement("div");
    row.className = "counter";
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = counter.label;
    const value = document.createElement("span");
    value.className = "value";
    value.id = `counter-${counter.key}`;
    value.textContent = "–";
    const chart = document.createElement("canvas");
    chart.id = `chart-${counter.key}`;
    row.append(label, value, chart);
    box.append(row);
  }
}

/** Numbers at the cursor (the last frame when `cursor` is null) and one chart per counter. */
function drawCounters(series, cursor) {
  const at = cursor ?? series.length - 1;
  // every chart's width read before anything is written: one layout, not one per chart
  const widths = COUNTERS.map((counter) => byId(`chart-${counter.key}`).parentElement.clientWidth);
  COUNTERS.forEach((counter, k) => {
    const values = series.map((counters) => counters[counter.key]);
    setText(byId(`counter-${counter.key}`), counter.format(values[at]));
    // a loop, not Math.max(...values): a long run's values overflow the call stack as arguments
    const top = counter.max ?? values.reduce((most, value) => Math.max(most, value), 0);
    drawChart(byId(`chart-${counter.key}`), widths[k], values, top, cursor);
  });
}

function drawChart(canvas, width, values, top, cursor) {
  const height = CHART_HEIGHT;
  const context = sizeCanvas(canvas, width, height);
  const span = cursor === null ? LIVE_HISTORY : values.length;
  const x = (i) => (span <= 1 ? 0 : (i / (span - 1)) * width);
  const y = (v) => height - 3 - (top > 0 ? (v / top) * (height - 8) : 0);
  context.beginPath();
  values.forEach((v, i) => (i === 0 ? context.moveTo(x(i), y(v)) : context.lineTo(x(i), y(v))));
  context.strokeStyle = page.colours.chart;
  context.lineWidth = 1.5;
  context.stroke();
  context.lineTo(x(values.length - 1), height);
  context.lineTo(x(0), height);
  context.fillStyle = page.colours.chartFill;
  context.fill();
  if (cursor !== null) {
    context.fillStyle = page.colours.cursor;
    context.fillRect(Math.round(x(cursor)) - 1, 0, 2, height);
  }
}

// ---------------------------------------------------------------------------------------------
// The tooltip: what a block is, who holds it, and how old its content is.

function onPointerMove(event) {
  page.hover = gridLayouts.has(event.target)
    ? { canvas: event.target, clientX: event.clientX, clientY: event.clientY }
    : null;
  refreshTooltip();
}

/** Redraw the tooltip for the pointer's block (also after a new frame under a still pointer). */
function refreshTooltip() {
  const tooltip = byId("tooltip");
  const id = page.hover === null ? undefined : blockUnderPointer(page.hover);
  if (id === undefined || page.view === null) {
    tooltip.hidden = true;
    return;
  }
  tooltip.replaceChildren(...describeBlock(page.view, id).map(tooltipLine));
  tooltip.firstChild.className = "tip-title";
  tooltip.hidden = false;
  placeTooltip(tooltip, page.hover);
}

function blockUnderPointer({ canvas, clientX, clientY }) {
  const layout = gridLayouts.get(canvas);
  if (!canvas.isConnected || canvas.hidden) return undefined;
  const box = canvas.getBoundingClientRect();
  const column = Math.floor((clientX - box.left) / layout.cell);
  const row = Math.floor((clientY - box.top) / layout.cell);
  if (column < 0 || column >= layout.columns || row < 0) return undefined;
  return layout.ids[row * layout.columns + column];
}

/** The tooltip's lines for block `id`, plain text. */
function describeBlock(view, id) {
  const frame = view.frame;
  const state = view.stateOf(id);
  const holders = view.holders.get(id) ?? [];
  const born = frame.born[view.slotOf(id)] ?? -1;
  const lines = [`block ${id} · ${tierOf(frame, id)}`, `state: ${STATE_NAMES[state] ?? state}`];
  if (holders.length > 0) {
    const names = holders.map((sequence) => `seq ${sequence.seq} (${sequence.request})`);
    lines.push(`held by ${holders.length}: ${names.join(", ")}`);
  }
  if (frame.keys[id] !== undefined) lines.push(`prefix key: ${frame.keys[id]}`);
  if (born >= 0) lines.push(`age: ${frame.step - born} steps (content from step ${born})`);
  if (state === "w") lines.push("being written");
  else if (state !== ".") lines.push(`full (${frame.block_size} tokens)`);
  return lines;
}

function tierOf(frame, id) {
  if (id < frame.device) return "device";
  if (id < frame.device + frame.host) return "host";
  return "disk";
}

function tooltipLine(text) {
  const line = document.createElement("div");
  line.textContent = text;
  return line;
}

function placeTooltip(tooltip, { clientX, clientY }) {
  const margin = 14;
  const box = tooltip.getBoundingClientRect();
  const left = Math.min(clientX + margin, window.innerWidth - box.width - 4);
  const fitsBelow = clientY + margin + box.height <= window.innerHeight;
  const top = fitsBelow ? clientY + margin : clientY - box.height - margin;
  tooltip.style.left = `${Math.max(4, left)}px`;
  tooltip.style.top = `${Math.max(4, top)}px`;
}

// ---------------------------------------------------------------------------------------------
// Small formatting helpers.

function range(start, end) {
  return Array.from({ length: Math.max(0, end - start) }, (_, k) => start + k);
}

function formatPercent(fraction) {
  return `${(100 * fraction).toFixed(1)} %`;
}

function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(value < 10 ? 2 : 1)} ${units[unit]}`;
}

// ---------------------------------------------------------------------------------------------
// Start: read the server's info, ask for the key if needed, then run the mode it names.

async function start() {
  page.colours = readColours();
  buildCounters();
  document.addEventListener("pointermove", onPointerMove);
  document.documentElement.addEventListener("pointerleave", () => {
    page.hover = null;
    refreshTooltip();
  });
  const info = await fetchInfo();
  document.title = info.title;
  byId("title").textContent = info.title;
  byId("mode").textContent = info.mode;
  byId("model").textContent = info.model;
  byId("model-fact").hidden = !info.model; // a replayed trace names no model
  byId("age-fact").hidden = info.mode !== "live";
  if (info.mode === "live") byId("counters-caption").textContent = `the last ${LIVE_HISTORY} frames`;
  if (info.needs_key) page.apiKey = await askForKey("");
  if (info.mode === "live") await runLive();
  else await runReplay();
}

start().catch((error) => setStatus(`stopped: ${error.message}`, true));
