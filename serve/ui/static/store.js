// GET /ui/store: the store the app serves and its caches, from GET /ui/api/store (text only, no innerHTML).
"use strict";

const $ = (id) => document.getElementById(id);

function table(node, head, rows) {
  qv.clear(node);
  node.appendChild(qv.el("tr", {}, null, head.map((h) => qv.el("th", {}, h))));
  for (const row of rows) node.appendChild(qv.el("tr", {}, null, row.map((v) => qv.el("td", {}, v))));
}

const rate = (r) => (r === null ? "–" : (r * 100).toFixed(1) + "%");

async function load() {
  qv.showError(null);
  let body;
  try {
    body = await qv.json("/ui/api/store");
  } catch (error) {
    qv.showError(error);
    return;
  }
  const s = body.store;
  const facts = [["fingerprint", s.fingerprint], ["model", s.model_id],
    ["tiers", Object.entries(s.tiers).map(([n, dpi]) => n + " " + dpi + " DPI").join(", ")],
    ["KV format", s.kv_quant], ["serving generation", s.generation],
    ["last published", s.published_at + " by " + s.job_id], ["documents", s.num_documents],
    ["chunks", s.num_chunks], ["entries", s.num_entries === null ? "not shown: your key reads some collections only" : s.num_entries]];
  const dl = $("facts");
  qv.clear(dl);
  for (const [name, value] of facts) { dl.appendChild(qv.el("dt", {}, name)); dl.appendChild(qv.el("dd", {}, value)); }
  table($("entries"), ["variant", "tier", "entries", "bytes"],
    s.entries.map((g) => [g.variant, g.tier === null ? "text" : g.tier, g.entries, qv.bytes(g.nbytes)]));
  table($("caches"), ["cache", "hit rate", "hits", "misses", "entries", "bytes", "evictions"],
    [["device hot tier", body.device_cache], ["host LRU", body.host_cache]].map(([name, c]) =>
      [name, rate(c.hit_rate), c.stats.hits, c.stats.misses, c.stats.entries,
        qv.bytes(c.stats.nbytes) + " / " + qv.bytes(c.stats.max_nbytes), c.stats.evictions]));
  table($("quarantine"), ["reason", "inputs", "samples"],
    s.quarantine.map((q) => [q.reason, q.count, q.samples.join("\n")]));
}

document.addEventListener("DOMContentLoaded", () => {
  qv.bindKey(load);
  load();
});
