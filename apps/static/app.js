// The chat page: a conversation over /v1/chat/completions, streamed as server-sent
// events, with a live readout of the speculative figures the server adds ("redrafter").
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = []; // {role, content}
let controller = null; // AbortController of the reply in flight

function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = `message ${role}`;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  box.appendChild(body);
  $("messages").appendChild(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function setMeta(box, text) {
  let meta = box.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("span");
    meta.className = "meta";
    box.appendChild(meta);
  }
  meta.textContent = text;
}

function showFigures(figures) {
  $("tau").textContent = figures.tokens_per_step.toFixed(2);
  $("tps").textContent = figures.generation_tps.toFixed(1);
  $("accepted").textContent = String(figures.accepted_tokens);
  $("tree").textContent = figures.tree === "1x1" ? "plain" : figures.tree;
  $("batch").textContent = String(figures.batch_size);
}

function numberSetting(id) {
  const value = $(id).value.trim();
  return value === "" ? null : Number(value);
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberSetting("temperature") ?? 0,
    top_p: numberSetting("top_p") ?? 1,
    max_tokens: numberSetting("max_tokens") ?? 256,
  };
  const seed = numberSetting("seed");
  if (seed !== null) body.seed = Math.trunc(seed);
  return body;
}

// Yields the JSON payload of every "data:" event of a server-sent event stream.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const body = box.querySelector(".text");
  controller = new AbortController();
  busy(true);
  let reply = "";
  let usage = null;
  let figures = null;
  let finish = null;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) {
      const answer = await response.json().catch(() => ({}));
      throw new Error(answer.error ? answer.error.message : `HTTP ${response.status}`);
    }
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      if (chunk.redrafter) {
        figures = chunk.redrafter;
        showFigures(figures);
      }
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) {
          reply += choice.delta.content;
          body.textContent = reply;
          box.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  } catch (error) {
    if (error.name === "AbortError") {
      finish = "stopped";
    } else {
      box.classList.add("error");
      body.textContent = reply + (reply ? "\n" : "") + `error: ${error.message}`;
      finish = "error";
    }
  } finally {
    box.classList.remove("streaming");
    busy(false);
    controller = null;
  }
  conversation.push({ role: "assistant", content: reply });
  const seconds = (performance.now() - started) / 1000;
  const parts = [];
  if (usage) parts.push(`${usage.completion_tokens} tokens`);
  if (figures) parts.push(`τ ${figures.tokens_per_step.toFixed(2)}`, `${figures.generation_tps.toFixed(1)} tokens/s`);
  parts.push(`${seconds.toFixed(1)} s`);
  if (finish) parts.push(finish);
  setMeta(box, parts.join(" · "));
  box.dataset.finish = finish || "";
}

async function loadModels() {
  try {
    const [models, status] = await Promise.all([
      fetch("/v1/models").then((r) => r.json()),
      fetch("/v1/redrafter/status").then((r) => r.json()),
    ]);
    for (const model of models.data) {
      const option = document.createElement("option");
      option.value = model.id;
      option.textContent = model.id;
      $("model").appendChild(option);
    }
    $("mode").textContent = status.speculative
      ? `ReDrafter speculative decoding: ${status.policy}`
      : "plain decoding (no drafter loaded)";
  } catch (error) {
    $("mode").textContent = `server unreachable: ${error.message}`;
  }
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});

$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => controller && controller.abort());

$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("messages").textContent = "";
});

loadModels();
