// Pagoda web UI: what the chat page and the dashboard share.
// - the API key: kept in this browser's localStorage, sent as "Authorization: Bearer"
//   on every data request; a 401 opens the key dialog and the request is retried;
// - fetch() helpers and a Server-Sent-Events reader over a fetch body. EventSource is
//   not used on purpose: it cannot send an Authorization header, and a key in the
//   query string would end up in access logs, history and proxies.
// No inline code anywhere: the pages' Content-Security-Policy forbids it.
"use strict";

const Pagoda = (() => {
  const KEY_STORAGE = "pagoda.apiKey";

  class AuthError extends Error {}

  function apiKey() {
    return localStorage.getItem(KEY_STORAGE) || "";
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  // Opens the key dialog; resolves once the user saved a key (or cleared it).
  function askForKey(message) {
    const dialog = document.getElementById("key-dialog");
    const input = document.getElementById("key-input");
    document.getElementById("key-message").textContent =
      message || "This server needs an API key (the one given to pagoda serve --api-key).";
    input.value = apiKey();
    return new Promise((resolve) => {
      const save = document.getElementById("key-save");
      const forget = document.getElementById("key-forget");
      const finish = (value) => {
        if (value) localStorage.setItem(KEY_STORAGE, value);
        else localStorage.removeItem(KEY_STORAGE);
        save.onclick = forget.onclick = input.onkeydown = null;
        dialog.close();
        resolve(value);
      };
      save.onclick = () => finish(input.value.trim());
      forget.onclick = () => finish("");
      input.onkeydown = (e) => { if (e.key === "Enter") { e.preventDefault(); finish(input.value.trim()); } };
      if (!dialog.open) dialog.showModal();
      input.focus();
    });
  }

  // fetch() with the key; on 401 asks for the key once and retries.
  async function apiFetch(path, options) {
    for (let attempt = 0; ; attempt++) {
      const opts = Object.assign({}, options || {});
      opts.headers = headers(opts.headers);
      const response = await fetch(path, opts);
      if (response.status !== 401) return response;
      if (attempt > 0) throw new AuthError("the API key was refused");
      await askForKey(apiKey() ? "The server refused this API key. Enter the right one:"
                               : "This server needs an API key (pagoda serve --api-key):");
    }
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return "HTTP " + response.status;
  }

  // Reads a text/event-stream body; calls onEvent(name, data) per event
  // ("message" when the event has no name). Resolves when the body ends.
  async function readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let name = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line.startsWith("event:")) name = line.slice(6).trim();
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
        }
        if (data.length) onEvent(name, data.join("\n"));
      }
    }
  }

  async function modelInfo() {
    const response = await apiFetch("/v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    return body.data[0];
  }

  // The header's "API key" button; onKey runs after the user saved or forgot a key.
  function wireKeyButton(onKey) {
    const button = document.getElementById("key-button");
    button.addEventListener("click", async () => {
      await askForKey("API key for this server (stored in this browser only):");
      if (onKey) onKey();
    });
  }

  function formatNumber(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toLocaleString(undefined, { maximumFractionDigits: digits === undefined ? 1 : digits });
  }

  function formatSeconds(value) {
    if (value === null || value === undefined) return "–";
    return value < 1 ? formatNumber(value * 1000, 0) + " ms" : formatNumber(value, 2) + " s";
  }

  return { AuthError, apiKey, apiFetch, askForKey, errorMessage, readEvents, modelInfo,
           wireKeyButton, formatNumber, formatSeconds };
})();
