// multihead web page: plain JS, no build step, no third-party code. Two pages share this file:
// index.html (data-page="classify") and bots.html (data-page="bots").
// Every API error is JSON {"error", "code"}; apiError() turns it into a readable message.
"use strict";

const $ = (id) => document.getElementById(id);

// -- the API key (servers with `--auth keys`) -------------------------------------------------
// Kept for this tab only (sessionStorage), sent as `Authorization: Bearer <key>` on every call.
const KEY_STORE = "multihead-api-key";

function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

function withKey(headers = {}) {
  const key = apiKey();
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

function initKey() {
  const input = $("api-key");
  if (!input) return;
  input.value = apiKey();
  input.addEventListener("change", () => {
    const key = input.value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key);
    else sessionStorage.removeItem(KEY_STORE);
    location.reload();  // every list and status again, with the key
  });
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("data-") || key.startsWith("aria-") || key === "role") {
      node.setAttribute(key, value);
    } else node[key] = value;
  }
  for (const child of children) if (child != null) node.append(child);
  return node;
}

class ApiError extends Error {
  constructor(message, status, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function apiError(response) {
  let message = response.statusText || "request failed";
  let code = "http_error";
  try {
    const body = await response.json();
    if (body && body.error) message = body.error;
    if (body && body.code) code = body.code;
  } catch (_) { /* not JSON: keep the status text */ }
  if (response.status === 503) {
    const retry = response.headers.get("Retry-After");
    if (retry) message += ` (retry in ${retry} s)`;
  }
  if (response.status === 401) {
    message += apiKey() ? " — check the API key above" : " — this server needs an API key: paste it above";
    if ($("api-key")) $("api-key").focus();
  }
  return new ApiError(message, response.status, code);
}

async function getJSON(url) {
  let response;
  try {
    response = await fetch(url, { headers: withKey({ Accept: "application/json" }) });
  } catch (err) {
    throw new ApiError(`cannot reach the server (${err.message})`, 0, "network");
  }
  if (!response.ok) throw await apiError(response);
  return response.json();
}

function showError(err) {
  const box = $("error");
  if (!err) {
    box.hidden = true;
    box.textContent = "";
    return;
  }
  const where = err.status ? ` — HTTP ${err.status}${err.code ? ", " + err.code : ""}` : "";
  box.textContent = `${err.message}${where}`;
  box.hidden = false;
}

// -- trunk status (both pages) --------------------------------------------------------------

// "batch 16: 276 ms here, 240 ms alone (1.15×)", or "" before the first batch.
function trunkSpeed(trunk) {
  const here = trunk.in_server;
  if (!here) return "";
  const sizes = Object.keys(here.batches).map(Number);
  const size = sizes.reduce((a, b) => (here.batches[b] > here.batches[a] ? b : a), sizes[0]);
  const ms = here.batch_ms[size];
  let text = `batch ${size}: ${ms.toFixed(0)} ms here`;
  const alone = trunk.profile ? aloneMs(trunk.profile.batch_ms, size) : null;
  if (alone) text += `, ${alone.toFixed(0)} ms alone (${(ms / alone).toFixed(2)}×)`;
  return text;
}

// The profile's time at `size`, linear between the measured sizes (the nearest end beyond).
function aloneMs(batchMs, size) {
  const points = Object.keys(batchMs).map(Number).sort((a, b) => a - b);
  if (!points.length) return null;
  if (size <= points[0]) return batchMs[points[0]];
  for (let i = 1; i < points.length; i++) {
    if (size <= points[i]) {
      const [x0, x1] = [points[i - 1], points[i]];
      return batchMs[x0] + (batchMs[x1] - batchMs[x0]) * (size - x0) / (x1 - x0);
    }
  }
  return batchMs[points[points.length - 1]];
}

async function showTrunk() {
  const node = $("trunk");
  let body = null;
  try {
    // /readyz answers 503 while loading, with the same JSON body: read it either way.
    const response = await fetch("/readyz", { headers: withKey({ Accept: "application/json" }) });
    body = await response.json();
  } catch (_) {
    node.textContent = "Trunk: server unreachable";
    node.dataset.state = "failed";
    setTimeout(showTrunk, 5000);
    return;
  }
  const weights = (body.trunk && body.trunk.weights) || "unknown";
  node.dataset.weights = weights;
  node.dataset.state = body.status;
  if (body.status === "ready" && !body.trunk) {
    // The status alone: with API keys, the full report is for the operator and metrics keys.
    node.textContent = "Trunk: ready";
  } else if (body.status === "ready") {
    const runs = body.trunk.runtime ? ` · ${body.trunk.runtime} ${body.trunk.precision}` : "";
    // An int8 trunk: the images it was calibrated on, and when (the day; the rest in the title).
    const cal = body.trunk.calibration;
    const calibrated = cal
      ? ` · calibrated on ${cal.images} images, ${cal.date.slice(0, 10)}${cal.passed ? "" : " (below its fidelity bound)"}`
      : "";
    node.textContent = `Trunk weights: ${weights}${runs}${calibrated}`;
    const where = body.trunk.checkpoint ? `checkpoint ${body.trunk.checkpoint} on ${body.trunk.device}` : "";
    node.title = cal
      ? `${where}\ncalibration: ${cal.description} (sha256 ${cal.digest.slice(0, 16)}…) at ${cal.date}; ` +
        `float layers ${body.trunk.float_precision}; min cosine vs fp32 ${cal.min_cosine.toFixed(4)}`
      : where;
    // Which precision, and why: "int8: gate passed for 3 heads (...)", "bf16: the INT8 trunk's gate fails ...".
    if (body.trunk.why) node.title += `${node.title ? "\n" : ""}precision ${body.trunk.why}`;
    // Its time per batch inside the server next to its time alone (the warm-up profile), at the
    // batch size it ran most; refreshed while the page is open.
    const speed = trunkSpeed(body.trunk);
    if (speed) node.textContent += ` · ${speed}`;
    // The batcher's batch size: the profile's smallest within 5 % of its best images/s.
    if (body.trunk.batch_size) {
      node.textContent += ` · batches ≤ ${body.trunk.batch_size}`;
      const rates = body.trunk.profile && body.trunk.profile.images_per_s;
      if (rates) {
        const shown = Object.entries(rates).map(([n, r]) => `${n}: ${r.toFixed(0)}/s`).join(", ");
        node.title += `${node.title ? "\n" : ""}batch size ${body.trunk.batch_size} ` +
          `(the smallest within 5 % of the best images/s alone: ${shown})`;
      }
    }
    setTimeout(showTrunk, 10000);
  } else if (body.status === "failed") {
    node.textContent = `Trunk failed: ${body.error || "unknown error"}`;
  } else {
    node.textContent = `Trunk weights: ${weights} (loading…)`;
    setTimeout(showTrunk, 1000);
  }
}

// -- classify page ----------------------------------------------------------------------------

const state = { file: null, previewUrl: null, busy: false };

function selectedBots() {
  return [...document.querySelectorAll("#bot-list input:checked")].map((box) => box.value);
}

function updateSubmit() {
  $("submit").disabled = state.busy || !state.file || selectedBots().length === 0;
}

async function loadBotChoices() {
  const fieldset = $("bots");
  const status = $("bots-status");
  const list = $("bot-list");
  const wanted = new Set((new URLSearchParams(location.search).get("bots") || "")
    .split(",").filter(Boolean));
  try {
    const { bots } = await getJSON("/bots");
    list.replaceChildren(...bots.map((bot, i) => {
      const box = el("input", { type: "checkbox", id: `bot-${i}`, value: bot.bot_id,
                                name: "bots", checked: wanted.has(bot.bot_id) });
      box.addEventListener("change", updateSubmit);
      const label = el("label", { htmlFor: box.id },
        el("span", { class: "bot-id", text: bot.bot_id }),
        el("span", { class: "muted", text: ` v${bot.version} · ${bot.n_classes} classes` }));
      return el("li", { "data-bot": bot.bot_id }, box, label);
    }));
    status.textContent = bots.length ? `${bots.length} bot${bots.length > 1 ? "s" : ""}` +
      " — pick one or several" : "No bots registered yet.";
    if (bots.length === 1) list.querySelector("input").checked = true;
    fieldset.dataset.state = "ready";
  } catch (err) {
    status.textContent = "Bots could not be loaded.";
    fieldset.dataset.state = "failed";
    showError(err);
  }
  updateSubmit();
}

function setFile(file) {
  if (!file) return;
  state.file = file;
  if (state.previewUrl) URL.revokeObjectURL(state.previewUrl);
  state.previewUrl = URL.createObjectURL(file);
  const preview = $("preview");
  preview.onerror = () => { preview.hidden = true; };  // not an image the browser can show
  preview.src = state.previewUrl;
  preview.alt = `Preview of ${file.name}`;
  preview.hidden = false;
  $("drop").classList.add("has-image");
  $("drop-text").innerHTML = "<u>Choose another image</u> or drop one here";
  $("file-name").textContent = `${file.name} · ${formatBytes(file.size)}`;
  updateSubmit();
  // Picking an image is the moment the user wants an answer: send it if bots are chosen.
  if (selectedBots().length) classify();
}

function formatBytes(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

function serverMs(response, url) {
  // Preferred: a Server-Timing header ("app;dur=12.3"). Otherwise the time to first byte
  // from the Resource Timing API, which is the server's time plus the network round trip.
  const header = response.headers.get("Server-Timing");
  const match = header && /dur=([\d.]+)/.exec(header);
  if (match) return { ms: parseFloat(match[1]), kind: "on the server" };
  const entries = performance.getEntriesByName(url, "resource");
  const entry = entries[entries.length - 1];
  performance.clearResourceTimings();
  if (entry && entry.responseStart > 0 && entry.requestStart > 0) {
    return { ms: entry.responseStart - entry.requestStart, kind: "to the server's first byte" };
  }
  return null;
}

async function classify() {
  const bots = selectedBots();
  if (!state.file || !bots.length || state.busy) return;
  const topK = Math.max(1, parseInt($("top-k").value, 10) || 5);
  const path = bots.length === 1
    ? `/classify/${encodeURIComponent(bots[0])}?top_k=${topK}`
    : `/classify?bots=${bots.map(encodeURIComponent).join(",")}&top_k=${topK}`;
  const url = new URL(path, location.href).href;
  const results = $("results");
  state.busy = true;
  updateSubmit();
  showError(null);
  results.dataset.state = "busy";
  results.setAttribute("aria-busy", "true");
  $("submit").textContent = "Classifying…";
  try {
    const start = performance.now();
    let response;
    try {
      response = await fetch(url, {
        method: "POST",
        body: state.file,
        headers: withKey({ "Content-Type": state.file.type || "application/octet-stream",
                           Accept: "application/json" }),
      });
    } catch (err) {
      throw new ApiError(`cannot reach the server (${err.message})`, 0, "network");
    }
    if (!response.ok) throw await apiError(response);
    const body = await response.json();
    const clientMs = performance.now() - start;
    const perBot = bots.length === 1 ? { [body.bot_id]: body } : body.results;
    renderResults(bots.map((bot) => perBot[bot]).filter(Boolean));
    renderLatency(clientMs, serverMs(response, url));
    results.scrollIntoView({ block: "nearest" });
    results.dataset.state = "done";
  } catch (err) {
    // Old results next to a new image would mislead: clear them.
    $("result-cards").replaceChildren();
    $("latency").hidden = true;
    results.dataset.state = "error";
    showError(err);
  } finally {
    state.busy = false;
    results.removeAttribute("aria-busy");
    $("submit").textContent = "Classify";
    updateSubmit();
  }
}

function renderResults(botResults) {
  const cards = botResults.map((result) => {
    const predictions = result.results[0].predictions;
    const items = predictions.map((p, rank) => {
      const pct = (p.score * 100).toFixed(1);
      const bar = el("span", { class: "bar", "aria-hidden": "true" },
        el("span", { class: "fill" }));
      bar.firstChild.style.width = `${Math.max(0, Math.min(100, p.score * 100))}%`;
      return el("li", { class: rank === 0 ? "first" : "", "data-label": p.label,
                        "data-score": String(p.score) },
        el("span", { class: "label", text: p.label, title: p.label }),
        bar,
        el("span", { class: "score", text: `${pct}%` }));
    });
    return el("article", { class: "card", "data-bot": result.bot_id },
      el("h3", {}, el("span", { text: result.bot_id }),
        el("span", { class: "muted", text: ` v${result.version}` })),
      el("ol", { class: "predictions" }, ...items));
  });
  $("result-cards").replaceChildren(...cards);
}

function renderLatency(clientMs, server) {
  const node = $("latency");
  node.replaceChildren(
    "Latency ", el("strong", { id: "latency-client", text: `${clientMs.toFixed(0)} ms` }),
    " in the browser",
    server ? el("span", {}, " · ", el("span", { id: "latency-server",
      text: `${server.ms.toFixed(0)} ms` }), ` ${server.kind}`) : null);
  node.hidden = false;
}

function initClassify() {
  const drop = $("drop");
  const input = $("file");
  input.addEventListener("change", () => setFile(input.files[0]));
  for (const type of ["dragenter", "dragover"]) {
    drop.addEventListener(type, (event) => {
      event.preventDefault();
      drop.classList.add("dragging");
    });
  }
  for (const type of ["dragleave", "dragend"]) {
    drop.addEventListener(type, () => drop.classList.remove("dragging"));
  }
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("dragging");
    const file = event.dataTransfer && event.dataTransfer.files[0];
    if (file) setFile(file);
  });
  // A file dropped outside the zone would make the browser navigate away from the page.
  window.addEventListener("dragover", (event) => event.preventDefault());
  window.addEventListener("drop", (event) => event.preventDefault());
  $("classify-form").addEventListener("submit", (event) => {
    event.preventDefault();
    classify();
  });
  const setAll = (checked) => {
    for (const box of document.querySelectorAll("#bot-list input")) box.checked = checked;
    updateSubmit();
  };
  $("select-all").addEventListener("click", () => setAll(true));
  $("select-none").addEventListener("click", () => setAll(false));
  loadBotChoices();
}

// -- bots page --------------------------------------------------------------------------------

async function mapLimited(items, limit, fn) {
  const out = new Array(items.length);
  let next = 0;
  const worker = async () => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i]);
    }
  };
  await Promise.all(Array.from({ length: Math.min(limit, items.length) }, worker));
  return out;
}

const CHIPS_SHOWN = 40;

const percent = (share) => share == null ? "–" : `${(100 * share).toFixed(1)} %`;
// A bot's answers under the INT8 trunk must agree with the float trunk's on this share of the
// held-out images (MIN_HEAD_AGREEMENT, backbone/gate.py), or `auto` serves the float trunk.
const INT8_BOUND = 0.99;

function int8Cell(share) {
  if (share == null) return el("td", { class: "int8 muted", text: "–" });
  const below = share < INT8_BOUND;
  return el("td", { class: below ? "int8 num below" : "int8 num",
                    "data-agreement": String(share),
                    title: "top-1 answers the same under the INT8 trunk as under the float trunk, " +
                           "on its held-out images" + (below ? ` (below ${100 * INT8_BOUND} %: ` +
                           "the next start serves the float trunk)" : ""),
                    text: `${(100 * share).toFixed(2)} %` });
}

function candidateCell(candidate) {
  // Shown to a manage key or the operator only (GET /bots/{id} has no `candidate` otherwise).
  if (!candidate) return el("td", { class: "candidate muted", text: "none" });
  const stats = candidate.stats || {};
  const mode = candidate.mode === "canary" ? `canary ${candidate.percent} %` : "shadow";
  const figures = [
    `${stats.images || 0} images compared`,
    `${percent(stats.agreement)} agree`,
    `mean |Δp| ${stats.mean_abs_diff == null ? "–" : stats.mean_abs_diff.toFixed(3)}`,
  ];
  if (candidate.mode === "canary") figures.push(`${stats.answered || 0} answered`);
  if (stats.failures) figures.push(`${stats.failures} failed`);
  const cell = el("td", { class: "candidate", "data-version": String(candidate.version),
                          "data-mode": candidate.mode,
                          title: "counted by the server process that answered this page, "
                                 + (stats.since ? `since ${stats.since}` : "not scored yet") },
    el("div", { class: "candidate-version", text: `v${candidate.version} · ${mode}` }),
    el("div", { class: "candidate-stats muted", text: figures.join(" · ") }));
  const disagreements = stats.disagreements || [];
  if (disagreements.length) {
    cell.append(el("details", {},
      el("summary", { text: "most frequent disagreements" }),
      el("ol", { class: "disagreements" }, ...disagreements.map((d) =>
        el("li", { "data-live": d.live, "data-candidate": d.candidate,
                   "data-images": String(d.images),
                   text: `${d.live} → ${d.candidate} (${d.images})` })))));
  }
  return cell;
}

function botRow(info, withCandidates, withInt8) {
  // A bot can have a thousand classes: show the first ones, fold the rest away.
  const chipList = (labels) => el("ul", { class: "chips" },
    ...labels.map((label) => el("li", { text: label })));
  const chips = el("div", { role: "group", "aria-label": `Classes of ${info.bot_id}` },
    chipList(info.labels.slice(0, CHIPS_SHOWN)));
  if (info.labels.length > CHIPS_SHOWN) {
    chips.append(el("details", {},
      el("summary", { text: `${info.labels.length - CHIPS_SHOWN} more classes` }),
      chipList(info.labels.slice(CHIPS_SHOWN))));
  }
  if (info.error) chips.append(el("p", { class: "error-inline", text: info.error }));
  // The store writes ISO 8601 (UTC); accept epoch seconds too.
  const created = info.created == null ? null
    : new Date(typeof info.created === "number" ? info.created * 1000 : info.created);
  const versions = Array.isArray(info.versions) ? info.versions.join(", ") : "";
  return el("tr", { "data-bot": info.bot_id,
                    "data-search": [info.bot_id, ...info.labels].join("\n").toLowerCase() },
    el("th", { scope: "row" },
      el("a", { href: `/?bots=${encodeURIComponent(info.bot_id)}`, text: info.bot_id,
                title: `Classify with ${info.bot_id}` })),
    el("td", { class: "version", text: `v${info.version}`,
               title: versions ? `versions: ${versions}` : "" }),
    el("td", { class: "n-classes num", text: String(info.n_classes) }),
    el("td", {}, chips),
    withInt8 ? int8Cell(info.int8_agreement) : null,
    withCandidates ? candidateCell(info.candidate) : null,
    el("td", { class: "muted created", text: created && !isNaN(created) ?
      created.toISOString().slice(0, 16).replace("T", " ") : "" }));
}

async function initBots() {
  const table = $("bot-table");
  try {
    const { bots } = await getJSON("/bots");
    const infos = await mapLimited(bots, 6, async (bot) => {
      try {
        return await getJSON(`/bots/${encodeURIComponent(bot.bot_id)}`);
      } catch (err) {  // removed meanwhile, or its head is unreadable: keep the listing
        return { ...bot, labels: [], error: err.message };
      }
    });
    if (!infos.length) {
      table.replaceChildren(el("p", { class: "muted", text: "No bots registered yet." }));
    } else {
      // A caller that may manage the bots sees their candidates (shadow or canary).
      const withCandidates = infos.some((info) => "candidate" in info);
      // Where an INT8 trunk was calibrated for the serving checkpoint: each bot's agreement.
      const withInt8 = infos.some((info) => info.int8_agreement != null);
      const columns = ["Bot", "Version", "Classes", "Labels",
                       ...(withInt8 ? ["INT8 agreement"] : []),
                       ...(withCandidates ? ["Candidate"] : []), "Created (UTC)"];
      const head = el("thead", {}, el("tr", {},
        ...columns.map((name) => el("th", { scope: "col", text: name }))));
      table.replaceChildren(el("table", { class: "bots" }, head,
        el("tbody", {}, ...infos.map((info) => botRow(info, withCandidates, withInt8)))));
    }
    table.dataset.state = "ready";
    $("bots-count").textContent = `${infos.length} bot${infos.length === 1 ? "" : "s"}`;
  } catch (err) {
    table.replaceChildren();
    table.dataset.state = "failed";
    showError(err);
  }
  $("filter").addEventListener("input", (event) => {
    const needle = event.target.value.trim().toLowerCase();
    let shown = 0;
    for (const row of document.querySelectorAll("table.bots tbody tr")) {
      row.hidden = Boolean(needle) && !row.dataset.search.includes(needle);
      if (!row.hidden) shown++;
    }
    const total = document.querySelectorAll("table.bots tbody tr").length;
    $("bots-count").textContent = needle ? `${shown} of ${total} bots` :
      `${total} bot${total === 1 ? "" : "s"}`;
  });
}

document.addEventListener("DOMContentLoaded", () => {
  initKey();
  showTrunk();
  if (document.body.dataset.page === "classify") initClassify();
  else if (document.body.dataset.page === "bots") initBots();
});
