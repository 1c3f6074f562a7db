// Shared by the /ui pages: the API key (kept in this page's memory only, sent as a header, never put in a
// URL or in storage), authenticated fetches, and DOM helpers that only ever set text (never innerHTML).
"use strict";

const qv = (() => {
  let apiKey = "";

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (apiKey) h["Authorization"] = "Bearer " + apiKey;
    return h;
  }

  async function request(path, options) {
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const response = await fetch(path, opts);
    if (!response.ok) {
      let detail = response.statusText;
      try { detail = (await response.json()).detail || detail; } catch (e) { /* not JSON */ }
      const error = new Error(response.status + ": " + (typeof detail === "string" ? detail : JSON.stringify(detail)));
      error.status = response.status;
      throw error;
    }
    return response;
  }

  async function json(path, options) { return (await request(path, options)).json(); }

  // An element with text content and attributes; children appended in order.
  function el(tag, attrs, text, children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const child of children || []) node.appendChild(child);
    return node;
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : n) + " " + units[i];
  }

  function showError(error) { document.getElementById("error").textContent = error ? String(error.message || error) : ""; }

  function bindKey(onSet) {
    const form = document.getElementById("key-form");
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const input = document.getElementById("key");
      apiKey = input.value.trim();
      input.value = "";  // the key lives in `apiKey` only
      document.getElementById("key-state").textContent = apiKey ? "key set" : "no key";
      if (onSet) onSet();
    });
  }

  return { request, json, el, clear, bytes, showError, bindKey };
})();
