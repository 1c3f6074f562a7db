// GET /ui: one request, streamed, then the context as the model got it (serve/ui/routes.py says why the
// page is plain DOM code). Every server string is set with textContent.
"use strict";

const REASONS = {
  promoted: "promoted (within τ, B and the token budget)",
  low_by_tau: "kept low by τ",
  low_by_b: "kept low by B",
  low_by_budget: "kept low by the token budget",
  no_high_entry: "promoted, but no high-tier entry: served low",
  hybrid_text: "served as text (hybrid rule)",
  mode: "the mode's own tier",
};
const SOURCES = { device: "device hot tier", host: "host LRU", store: "store", compiled: "compiled lazily" };
const PHASES = [["route", "route_ms"], ["load", "load_ms"], ["render", "render_ms"], ["queue", "queue_ms"],
  ["re-anchor", "reanchor_ms"], ["prefill", "prefill_ms"], ["decode", "decode_ms"]];
const COMPARED = ["qvpic", "text_pic", "image_pic", "full_image"];

let store = null;  // GET /v1/store
const pageUrls = new Map();  // "chunk\ttier" -> blob: URL of its first page

const $ = (id) => document.getElementById(id);

function tiersByDpi() {
  return Object.entries(store.tiers).sort((a, b) => a[1] - b[1]).map(([name]) => name);
}

function requestBody(mode, stream) {
  const body = { query: $("query").value, mode: mode, stream: stream,
    max_new_tokens: Number($("max_new_tokens").value), temperature: Number($("temperature").value),
    top_p: Number($("top_p").value) };
  if ($("selection").value === "doc_ids") {
    body.doc_ids = $("doc_ids").value.split(",").map((s) => s.trim()).filter((s) => s);
  } else {
    body.top_k = Number($("top_k").value);
  }
  if ($("tau").value !== "") body.tau = Number($("tau").value);
  if ($("max_high_res").value !== "") body.max_high_res = Number($("max_high_res").value);
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  return body;
}

function answerHeaders(noCache) {
  const h = { "Content-Type": "application/json" };
  if (noCache) h["Cache-Control"] = "no-cache";
  return h;
}

async function ask(event) {
  event.preventDefault();
  qv.showError(null);
  $("answer").textContent = "";
  $("answer-meta").textContent = "";
  $("go").disabled = true;
  try {
    const response = await qv.request("/v1/answer", { method: "POST", headers: answerHeaders($("no_cache").checked),
      body: JSON.stringify(requestBody($("mode").value, true)) });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (event.startsWith("data: ")) handleEvent(JSON.parse(event.slice(6)));
      }
    }
  } catch (error) {
    qv.showError(error);
  } finally {
    $("go").disabled = false;
  }
}

function handleEvent(event) {
  if (event.type === "delta") {
    $("answer").textContent += event.text;
  } else if (event.type === "done") {
    show(event.response);
  } else if (event.type === "error") {
    qv.showError(new Error(event.status_code + ": " + event.detail));
  }
}

function show(response) {
  $("answer").textContent = response.answer;
  $("answer-meta").textContent = response.mode + " · " + response.finish_reason +
    (response.cache_hit ? " · answered by the response cache (" + response.response_cache.level + ")" : "") +
    " · generation " + response.generation;
  drawRanking(response);
  drawWaterfall(response);
  drawCards(response);
}

function drawRanking(response) {
  const box = $("ranking");
  qv.clear(box);
  const ranked = response.chunks.map((c, i) => [c, i]).sort((a, b) => b[0].relevance - a[0].relevance || a[1] - b[1]);
  const top = Math.max(1e-9, ...ranked.map(([c]) => c.relevance));
  const routed = response.chunks.some((c) => c.tier_reason !== "mode");
  $("tau-label").textContent = routed ? "τ = " + ($("tau").value || "server default") : "(not routed in this mode)";
  let cutDrawn = false;
  for (const [chunk, position] of ranked) {
    if (routed && !cutDrawn && chunk.tier_reason === "low_by_tau") {  // τ's cut: where the share above reached τ
      box.appendChild(qv.el("div", { class: "tau-cut", "data-testid": "tau-cut" }, null,
        [qv.el("span", {}, "τ cut")]));
      cutDrawn = true;
    }
    const bar = qv.el("div", { class: "bar" + (chunk.tier_reason === "promoted" ? " high" : ""),
      "data-testid": "relevance-bar" });
    bar.style.width = (Math.max(chunk.relevance, 0) / top * 100).toFixed(1) + "%";
    box.appendChild(qv.el("div", { class: "rank-row" }, null, [
      qv.el("span", {}, "#" + position + " " + chunk.doc_id),
      qv.el("div", { class: "track" }, null, [bar]),
      qv.el("span", {}, chunk.relevance.toFixed(3)),
    ]));
  }
  if (routed && !cutDrawn) {  // nothing was kept low by τ: the cut lies below the whole ranking
    box.appendChild(qv.el("div", { class: "tau-cut", "data-testid": "tau-cut" }, null, [qv.el("span", {}, "τ cut")]));
  }
}

function drawWaterfall(response) {
  const box = $("waterfall");
  qv.clear(box);
  const t = response.timings;
  const total = Math.max(1e-9, t.total_ms);
  let start = 0;
  for (const [name, field] of PHASES) {
    const ms = t[field] || 0;
    const bar = qv.el("div", { class: "wf-bar", "data-testid": "waterfall-bar" });
    bar.style.marginLeft = (start / total * 100).toFixed(2) + "%";
    bar.style.width = Math.max(ms / total * 100, 0.3).toFixed(2) + "%";
    box.appendChild(qv.el("div", { class: "wf-row" }, null, [
      qv.el("span", {}, name + (name === "prefill" ? " → first token" : "")),
      qv.el("div", { class: "track" }, null, [bar]),
      qv.el("span", {}, t[field] === null ? "–" : ms.toFixed(1) + " ms")]));
    start += ms;
  }
  box.appendChild(qv.el("p", { class: "muted" }, "total " + t.total_ms.toFixed(1) + " ms (the ingress's wall time)"));
  const u = response.usage, c = response.cache;
  const facts = [["context tokens", u.context_tokens], ["cached tokens", u.cached_tokens],
    ["vision tokens", u.context_vision_tokens], ["text tokens", u.context_text_tokens],
    ["query tokens", u.query_tokens], ["completion tokens", u.completion_tokens],
    ["KV from device hot tier", c.device_hits], ["KV from host LRU", c.hits], ["KV read from store", c.misses],
    ["bytes from store", qv.bytes(c.nbytes_from_store)]];
  const dl = $("usage");
  qv.clear(dl);
  for (const [name, value] of facts) { dl.appendChild(qv.el("dt", {}, name)); dl.appendChild(qv.el("dd", {}, value)); }
}

async function pageUrl(chunkId, tier) {
  const key = chunkId + "\t" + tier;
  if (!pageUrls.has(key)) {
    const query = new URLSearchParams({ chunk_id: chunkId, tier: tier, page: "0" });
    const blob = await (await qv.request("/ui/api/page?" + query.toString())).blob();
    pageUrls.set(key, URL.createObjectURL(blob));
  }
  return pageUrls.get(key);
}

function figure(chunkId, tier, label) {
  const img = qv.el("img", { alt: "page 1 of " + chunkId + " at " + tier, "data-tier": tier, "data-testid": "page" });
  const fig = qv.el("figure", {}, null, [img, qv.el("figcaption", {}, label)]);
  pageUrl(chunkId, tier).then((url) => { img.src = url; }, qv.showError);
  return fig;
}

function drawCards(response) {
  const box = $("cards");
  qv.clear(box);
  const [low, high] = [tiersByDpi()[0], tiersByDpi().slice(-1)[0]];
  response.chunks.forEach((chunk, position) => {
    const card = qv.el("article", { class: "card" + (chunk.tier_reason === "promoted" ? " promoted" : ""),
      "data-testid": "chunk-card" });
    card.appendChild(qv.el("div", { class: "doc" }, "#" + position + " · " + chunk.doc_id));
    card.appendChild(qv.el("div", { class: "muted" }, chunk.chunk_id));
    const facts = [["relevance", chunk.relevance.toFixed(3)], ["tier", chunk.tier === null ? "text" : chunk.tier],
      ["why", REASONS[chunk.tier_reason] || chunk.tier_reason],
      ["tokens", chunk.num_tokens + " (" + chunk.vision_tokens + " vision, span " + chunk.position_span + ")"],
      ["KV bytes", qv.bytes(chunk.kv_nbytes)],
      ["KV from", chunk.kv_source === null ? "none: prefilled online" : SOURCES[chunk.kv_source] || chunk.kv_source]];
    const dl = qv.el("dl");
    for (const [name, value] of facts) { dl.appendChild(qv.el("dt", {}, name)); dl.appendChild(qv.el("dd", {}, value)); }
    card.appendChild(dl);
    if (chunk.tier !== null) {
      const pages = qv.el("div", { class: "pages" });
      let shown = chunk.tier;
      pages.appendChild(figure(chunk.chunk_id, shown, "as served: " + shown));
      const toggle = qv.el("button", { type: "button", "data-testid": "toggle" }, "show " + (shown === low ? high : low));
      toggle.addEventListener("click", () => {
        shown = shown === low ? high : low;
        qv.clear(pages);
        pages.appendChild(figure(chunk.chunk_id, shown, shown + (shown === chunk.tier ? " (as served)" : "")));
        toggle.textContent = "show " + (shown === low ? high : low);
      });
      const both = qv.el("button", { type: "button", "data-testid": "side-by-side" }, "low | high");
      both.addEventListener("click", () => {
        qv.clear(pages);
        pages.appendChild(figure(chunk.chunk_id, low, low));
        pages.appendChild(figure(chunk.chunk_id, high, high));
      });
      card.appendChild(qv.el("div", {}, null, [toggle, both]));
      card.appendChild(pages);
    }
    box.appendChild(card);
  });
}

async function compareModes() {
  qv.showError(null);
  const box = $("compare-bars");
  qv.clear(box);
  $("compare").disabled = true;
  const rows = [];
  try {
    for (const mode of COMPARED.filter((m) => store.modes.includes(m))) {
      const r = await qv.json("/v1/answer", { method: "POST", headers: answerHeaders(true),
        body: JSON.stringify(requestBody(mode, false)) });
      const t = r.timings;
      const ttft = [t.route_ms, t.load_ms, t.render_ms, t.queue_ms, t.reanchor_ms, t.prefill_ms]
        .reduce((sum, ms) => sum + (ms || 0), 0);
      rows.push([mode, ttft, r.usage.context_tokens]);
    }
  } catch (error) {
    qv.showError(error);
  } finally {
    $("compare").disabled = false;
  }
  const maxTtft = Math.max(1e-9, ...rows.map((r) => r[1]));
  const maxTokens = Math.max(1, ...rows.map((r) => r[2]));
  box.appendChild(qv.el("div", { class: "cmp-row muted" }, null,
    [qv.el("span", {}, "mode"), qv.el("span", {}, "TTFT"), qv.el("span", {}, "context tokens")]));
  for (const [mode, ttft, tokens] of rows) {
    const bar = (cls, share, text) => {
      const b = qv.el("div", { class: "cmp-bar " + cls, "data-testid": "compare-bar", title: text });
      b.style.width = Math.max(share * 100, 0.5).toFixed(1) + "%";
      return qv.el("div", {}, null, [b, qv.el("span", { class: "muted" }, text)]);
    };
    box.appendChild(qv.el("div", { class: "cmp-row" }, null, [qv.el("span", {}, mode),
      bar("ttft", ttft / maxTtft, ttft.toFixed(1) + " ms"), bar("tokens", tokens / maxTokens, tokens + " tokens")]));
  }
}

async function loadStore() {
  try {
    store = await qv.json("/v1/store");
  } catch (error) {
    qv.showError(error);
    return;
  }
  const select = $("mode");
  qv.clear(select);
  for (const mode of store.modes) {
    const option = qv.el("option", { value: mode }, mode);
    if (mode === "qvpic") option.selected = true;
    select.appendChild(option);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  qv.bindKey(loadStore);
  $("ask").addEventListener("submit", ask);
  $("compare").addEventListener("click", compareModes);
  loadStore();
});
