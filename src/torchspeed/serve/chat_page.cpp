#include "torchspeed/serve/chat_page.h"

namespace torchspeed::serve {

// One page, no external resources: the conversation is kept in the page and sent whole to
// /v1/chat/completions with stream: true; the events are read with fetch's stream reader. An API
// key (when the server asks for one) is kept in the browser's localStorage. URL parameters:
// ?q=TEXT sends TEXT on load (links and tests), key=, temperature=, max_tokens=.
const char* chat_page_html() {
  return R"HTML(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>torchspeed chat</title>
<style>
  body { font-family: system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
  header { padding: 10px 16px; background: #1d2330; color: #fff; display: flex; gap: 16px; align-items: center; flex-wrap: wrap; }
  header b { font-size: 16px; }
  header label { font-size: 13px; opacity: .9; }
  header input { width: 70px; }
  #key { width: 160px; }
  #log { max-width: 860px; margin: 16px auto; padding: 0 16px 140px; }
  .msg { padding: 10px 14px; margin: 8px 0; border-radius: 10px; white-space: pre-wrap; line-height: 1.4; }
  .user { background: #dbe8ff; margin-left: 80px; }
  .assistant { background: #fff; border: 1px solid #dde1e8; margin-right: 80px; }
  .error { background: #ffe3e3; }
  form { position: fixed; bottom: 0; left: 0; right: 0; background: #fff; border-top: 1px solid #dde1e8; padding: 12px; display: flex; gap: 8px; justify-content: center; }
  textarea { width: min(720px, 70vw); height: 54px; font: inherit; padding: 6px; }
  button { padding: 0 18px; font: inherit; }
  #status { font-size: 12px; opacity: .8; }
</style>
</head>
<body>
<header>
  <b>torchspeed</b><span id="model">…</span>
  <label>temperature <input id="temperature" type="number" min="0" max="2" step="0.1" value="0.7"></label>
  <label>max tokens <input id="max_tokens" type="number" min="1" value="256"></label>
  <label>API key <input id="key" type="password" placeholder="if the server asks"></label>
  <span id="status"></span>
</header>
<div id="log"></div>
<form id="form">
  <textarea id="input" placeholder="Message (Enter sends, Shift+Enter is a new line)"></textarea>
  <button id="send" type="submit">Send</button>
</form>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const conversation = [];
let model = null;
if (params.get("key")) localStorage.setItem("torchspeed-key", params.get("key"));
$("key").value = localStorage.getItem("torchspeed-key") || "";
$("key").addEventListener("change", () => localStorage.setItem("torchspeed-key", $("key").value));
for (const f of ["temperature", "max_tokens"]) if (params.get(f) !== null) $(f).value = params.get(f);
function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}
function bubble(role, text) {
  const d = document.createElement("div");
  d.className = "msg " + role;
  d.textContent = text;
  $("log").appendChild(d);
  window.scrollTo(0, document.body.scrollHeight);
  return d;
}
async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  const j = await r.json();
  if (!r.ok) throw new Error(j.error ? j.error.message : r.statusText);
  model = j.data[0].id;
  $("model").textContent = model + " (context " + j.data[0].max_model_len + ")";
}
async function send(text) {
  if (!text.trim()) return;
  $("send").disabled = true;
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  let answer = "";
  const t0 = performance.now();
  let tokens = 0;
  try {
    if (!model) await loadModel();
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(),
      body: JSON.stringify({ model, messages: conversation, stream: true, stream_options: { include_usage: true },
                             temperature: Number($("temperature").value), max_tokens: Number($("max_tokens").value) }) });
    if (!r.ok) {
      const j = await r.json().catch(() => ({}));
      throw new Error(j.error ? j.error.message : r.status + " " + r.statusText);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const ev = buf.slice(0, at);
        buf = buf.slice(at + 2);
        for (const line of ev.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const j = JSON.parse(data);
          if (j.error) throw new Error(j.error.message);
          if (j.usage) tokens = j.usage.completion_tokens;
          for (const c of j.choices || []) {
            if (c.delta && c.delta.content) { answer += c.delta.content; out.textContent = answer; }
          }
        }
      }
    }
    conversation.push({ role: "assistant", content: answer });
    const s = (performance.now() - t0) / 1000;
    $("status").textContent = tokens + " tokens in " + s.toFixed(2) + " s (" + (tokens / s).toFixed(1) + " tok/s)";
    out.dataset.done = "1";
  } catch (e) {
    out.className = "msg error";
    out.textContent = "error: " + e.message;
    conversation.pop();
  } finally {
    $("send").disabled = false;
  }
}
$("form").addEventListener("submit", (e) => { e.preventDefault(); const t = $("input").value; $("input").value = ""; send(t); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
loadModel().catch((e) => { $("status").textContent = "models: " + e.message; });
if (params.get("q")) send(params.get("q"));
</script>
</body>
</html>
)HTML";
}

}  // namespace torchspeed::serve
