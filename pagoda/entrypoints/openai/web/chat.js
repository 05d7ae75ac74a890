// Pagoda chat page: conversations kept in this browser's localStorage, replies
// streamed from /v1/chat/completions (fetch + SSE, with the API key when one is set),
// rendered as Markdown; reasoning_content, when the model sends it, goes into a folded
// "Reasoning" section. Stop aborts the fetch: the server sees the client go away and
// aborts the request in the engine (its KV blocks are freed at once).
"use strict";

(() => {
  const STORE = "pagoda.conversations";
  const CURRENT = "pagoda.currentConversation";
  const SETTINGS = "pagoda.chatSettings";
  const SETTING_IDS = ["system-prompt", "temperature", "top-p", "max-tokens", "seed"];
  const $ = (id) => document.getElementById(id);
  const { renderMarkdown } = window.PagodaMarkdown;

  let model = null; // {id, max_model_len} from /v1/models
  let conversations = loadConversations();
  let current = null;
  let controller = null; // the AbortController of the reply streaming now

  function loadConversations() {
    try {
      const value = JSON.parse(localStorage.getItem(STORE));
      return Array.isArray(value) ? value : [];
    } catch (e) {
      return [];
    }
  }

  function save() {
    try {
      // An empty "New chat" is not worth keeping.
      localStorage.setItem(STORE, JSON.stringify(conversations.filter((c) => c.messages.length)));
    } catch (e) {
      setStatus("Could not save the conversation in this browser: " + e.message);
    }
  }

  function setStatus(text) {
    $("status").textContent = text || "";
  }

  // ---------------------------------------------------------------- conversations

  function newConversation() {
    const conversation = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 7),
                           title: "New chat", messages: [], updated: Date.now() };
    conversations.unshift(conversation);
    return conversation;
  }

  function select(conversation) {
    current = conversation;
    localStorage.setItem(CURRENT, conversation.id);
    renderList();
    renderMessages();
    document.body.classList.remove("sidebar-open");
  }

  function remove(conversation) {
    conversations = conversations.filter((c) => c !== conversation);
    save();
    if (current === conversation) select(conversations[0] || newConversation());
    else renderList();
  }

  function renderList() {
    const list = $("conversation-list");
    list.replaceChildren();
    for (const conversation of conversations) {
      const item = document.createElement("li");
      if (conversation === current) item.classList.add("current");
      const open = document.createElement("button");
      open.type = "button";
      open.className = "conversation-title";
      open.textContent = conversation.title;
      open.addEventListener("click", () => { if (!controller) select(conversation); });
      const del = document.createElement("button");
      del.type = "button";
      del.className = "icon-button delete";
      del.textContent = "\u00d7";
      del.setAttribute("aria-label", "Delete " + conversation.title);
      del.addEventListener("click", () => { if (!controller) remove(conversation); });
      item.append(open, del);
      list.append(item);
    }
  }

  // ---------------------------------------------------------------- messages

  function renderMessages() {
    const box = $("messages");
    box.replaceChildren();
    if (!current.messages.length) {
      const hint = document.createElement("p");
      hint.className = "empty-hint";
      hint.textContent = "Ask anything. Replies stream as the model writes them; Stop ends the request on the server.";
      box.append(hint);
    }
    for (const message of current.messages) updateMessage(appendMessage(message), message);
  }

  function appendMessage(message) {
    const box = $("messages");
    const hint = box.querySelector(".empty-hint");
    if (hint) hint.remove();
    const root = document.createElement("article");
    root.className = "message " + message.role;
    const view = { root, reasoning: null, reasoningBody: null, content: document.createElement("div"),
                   meta: document.createElement("div") };
    view.content.className = "content";
    view.meta.className = "meta";
    if (message.role === "assistant") {
      view.reasoning = document.createElement("details");
      view.reasoning.className = "reasoning";
      const summary = document.createElement("summary");
      summary.textContent = "Reasoning";
      view.reasoningBody = document.createElement("div");
      view.reasoningBody.className = "reasoning-body";
      view.reasoning.append(summary, view.reasoningBody);
      view.reasoning.hidden = true;
      root.append(view.reasoning);
    }
    root.append(view.content, view.meta);
    box.append(root);
    return view;
  }

  function updateMessage(view, message) {
    if (message.role === "user") {
      view.content.textContent = message.content; // the user's text is shown as typed
    } else {
      view.content.innerHTML = renderMarkdown(message.content); // escaped, then marked up
      if (message.reasoning) {
        view.reasoning.hidden = false;
        view.reasoningBody.innerHTML = renderMarkdown(message.reasoning);
      }
      view.root.dataset.state = message.state || "done";
    }
    view.meta.textContent = message.meta || "";
    view.meta.classList.toggle("error", message.state === "error");
  }

  let pending = null;
  function scheduleUpdate(view, message) {
    if (pending) return;
    pending = requestAnimationFrame(() => {
      pending = null;
      const box = $("messages");
      const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
      updateMessage(view, message);
      if (atBottom) box.scrollTop = box.scrollHeight;
    });
  }

  // ---------------------------------------------------------------- settings

  function loadSettings() {
    let saved = {};
    try { saved = JSON.parse(localStorage.getItem(SETTINGS)) || {}; } catch (e) { saved = {}; }
    for (const id of SETTING_IDS) {
      if (typeof saved[id] === "string") $(id).value = saved[id];
      $(id).addEventListener("change", saveSettings);
    }
  }

  function saveSettings() {
    const values = {};
    for (const id of SETTING_IDS) values[id] = $(id).value;
    localStorage.setItem(SETTINGS, JSON.stringify(values));
  }

  function requestBody() {
    const messages = [];
    const system = $("system-prompt").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const m of current.messages) {
      if (m.state === "streaming" || m.state === "error" || !m.content) continue;
      messages.push({ role: m.role, content: m.content });
    }
    const body = { model: model ? model.id : undefined, messages, stream: true,
                   stream_options: { include_usage: true },
                   temperature: Number($("temperature").value),
                   top_p: Number($("top-p").value),
                   max_tokens: parseInt($("max-tokens").value, 10) };
    const seed = $("seed").value.trim();
    if (seed !== "") body.seed = parseInt(seed, 10);
    return body;
  }

  // ---------------------------------------------------------------- sending

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("prompt").disabled = false;
  }

  function describe(reply, timing, usage, finish) {
    const parts = [];
    const tokens = usage ? usage.completion_tokens : null;
    if (tokens !== null) parts.push(tokens + " tokens");
    if (timing.first !== null) {
      parts.push("first token " + Pagoda.formatSeconds((timing.first - timing.start) / 1000));
      const seconds = (timing.end - timing.first) / 1000;
      if (tokens > 1 && seconds > 0) parts.push(Pagoda.formatNumber((tokens - 1) / seconds) + " tok/s");
    }
    if (reply.state === "stopped") parts.push("stopped");
    else if (reply.state === "error") parts.push("error: " + reply.error);
    else if (finish === "length") parts.push("max tokens reached");
    return parts.join(" \u00b7 ");
  }

  async function send(text) {
    if (controller || !text.trim()) return;
    if (!current) select(newConversation());
    const user = { role: "user", content: text };
    current.messages.push(user);
    if (current.title === "New chat") current.title = text.trim().slice(0, 48);
    updateMessage(appendMessage(user), user);
    const reply = { role: "assistant", content: "", reasoning: "", state: "streaming" };
    const body = requestBody(); // before the reply joins the history
    current.messages.push(reply);
    current.updated = Date.now();
    const view = appendMessage(reply);
    updateMessage(view, reply);
    $("messages").scrollTop = $("messages").scrollHeight;
    save();
    renderList();
    const ctrl = controller = new AbortController();
    setBusy(true);
    setStatus("");
    const timing = { start: performance.now(), first: null, end: null };
    let usage = null;
    let finish = null;
    try {
      const response = await Pagoda.apiFetch("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: ctrl.signal });
      if (!response.ok) throw new Error(await Pagoda.errorMessage(response));
      await Pagoda.readEvents(response, (name, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
          if (delta.content) reply.content += delta.content;
          if (timing.first === null && (delta.content || delta.reasoning_content)) timing.first = performance.now();
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        scheduleUpdate(view, reply);
      });
      reply.state = "done";
    } catch (e) {
      if (e.name === "AbortError") {
        reply.state = "stopped";
      } else {
        reply.state = "error";
        reply.error = e.message;
      }
    } finally {
      ctrl.abort(); // closes the connection should the body still be open (an error event)
      controller = null;
      timing.end = performance.now();
      reply.meta = describe(reply, timing, usage, finish);
      if (pending) { cancelAnimationFrame(pending); pending = null; }
      updateMessage(view, reply);
      save();
      setBusy(false);
      $("prompt").focus();
    }
  }

  // ---------------------------------------------------------------- start

  async function showModel() {
    try {
      model = await Pagoda.modelInfo();
      $("model-info").textContent = model.id + " \u00b7 context " + Pagoda.formatNumber(model.max_model_len, 0) + " tokens";
      $("model-info").classList.remove("error");
    } catch (e) {
      $("model-info").textContent = "server: " + e.message;
      $("model-info").classList.add("error");
    }
  }

  function start() {
    Pagoda.wireKeyButton(showModel);
    loadSettings();
    const wanted = localStorage.getItem(CURRENT);
    select(conversations.find((c) => c.id === wanted) || conversations[0] || newConversation());
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
    $("new-chat").addEventListener("click", () => {
      if (!controller && current.messages.length) select(newConversation());
    });
    $("toggle-sidebar").addEventListener("click", () => {
      const open = document.body.classList.toggle("sidebar-open");
      $("toggle-sidebar").setAttribute("aria-expanded", String(open));
    });
    showModel();
  }

  start();
})();
