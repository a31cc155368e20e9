// Shared by every dashboard page: the API key (kept in localStorage), fetch helpers, formatting.
"use strict";

const KEY_STORAGE = "loraq.apiKey";

const loraq = {
  key() { return localStorage.getItem(KEY_STORAGE) || ""; },

  setKey(key) { localStorage.setItem(KEY_STORAGE, key.trim()); },

  // Ask for the key once; resolves when one is stored. `message` explains a rejected key.
  askKey(message) {
    const dialog = document.getElementById("keydialog");
    const input = document.getElementById("apikey");
    document.getElementById("keyerror").textContent = message || "";
    dialog.hidden = false;
    input.focus();
    return new Promise((resolve) => {
      document.getElementById("keyform").onsubmit = (ev) => {
        ev.preventDefault();
        if (!input.value.trim()) return;
        loraq.setKey(input.value);
        dialog.hidden = true;
        loraq.showKey();
        resolve();
      };
    });
  },

  showKey() {
    const k = loraq.key();
    document.getElementById("keyinfo").textContent = k ? `key …${k.slice(-4)}` : "no key";
  },

  // fetch with the Bearer key; a 401 asks for a new key and retries once. Returns the Response.
  async request(path, options = {}) {
    if (!loraq.key()) await loraq.askKey();
    const send = () => fetch(path, {
      ...options,
      headers: { ...(options.headers || {}), Authorization: `Bearer ${loraq.key()}` },
    });
    let resp = await send();
    if (resp.status === 401) {
      await loraq.askKey("That API key was not accepted; enter a valid one.");
      resp = await send();
    }
    return resp;
  },

  // JSON request; throws Error(message) with the API's OpenAI-style error message on failure.
  async json(path, options = {}) {
    const resp = await loraq.request(path, options);
    const body = await resp.json().catch(() => null);
    if (!resp.ok) {
      const err = body && body.error ? body.error : { message: `HTTP ${resp.status}` };
      const e = new Error(err.param ? `${err.message} (${err.param})` : err.message);
      e.status = resp.status;
      e.param = err.param || null; // the field a 400 names, for the page to mark
      throw e;
    }
    return body;
  },

  // POST /v1/chat/completions with stream: true; `onDelta(text)` gets each content piece as the
  // server-sent chunks arrive. Resolves with the finish reason; an error chunk or status throws.
  async streamChat(body, onDelta) {
    const resp = await loraq.request("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...body, stream: true }),
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => null);
      throw new Error(err && err.error ? err.error.message : `HTTP ${resp.status}`);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", finish = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return finish;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") return finish;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const choice = chunk.choices && chunk.choices[0];
          if (choice && choice.delta && choice.delta.content) onDelta(choice.delta.content);
          if (choice && choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
  },

  // Download an authenticated file: fetch as a blob, then click a temporary object-URL link.
  async download(path, filename) {
    const resp = await loraq.request(path);
    if (!resp.ok) throw new Error(`download failed: HTTP ${resp.status}`);
    const url = URL.createObjectURL(await resp.blob());
    const a = document.createElement("a");
    a.href = url;
    a.download = filename;
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  },

  // Call `fn` now and then every `ms` until it returns false; errors are shown, polling goes on.
  poll(fn, ms, onError) {
    let stopped = false;
    const tick = async () => {
      if (stopped) return;
      let again = true;
      try { again = (await fn()) !== false; } catch (e) { if (onError) onError(e); }
      if (again && !stopped) setTimeout(tick, ms);
    };
    tick();
    return () => { stopped = true; };
  },

  // HTML-escapes text for innerHTML. A NUL (a model under training can emit one) becomes U+FFFD:
  // the HTML parser would silently drop it, and the user should see that something was there.
  esc(s) {
    return String(s ?? "")
      .replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]))
      .replace(/\0/g, "\uFFFD");
  },
  time(unix) { return unix ? new Date(unix * 1000).toLocaleString() : "–"; },
  // The time of day for today's events, the date and time for older ones.
  clock(unix) {
    if (!unix) return "–";
    const d = new Date(unix * 1000);
    return d.toDateString() === new Date().toDateString() ? d.toLocaleTimeString() : d.toLocaleString();
  },
  num(x, digits = 4) { return x === null || x === undefined ? "–" : Number(x).toPrecision(digits); },
  int(x) { return x === null || x === undefined ? "–" : Math.round(x).toLocaleString(); },
  duration(s) {
    if (s === null || s === undefined || !isFinite(s)) return "–";
    s = Math.max(0, Math.round(s));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
  },
  bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  },
  statusBadge(status) { return `<span class="status ${loraq.esc(status)}">${loraq.esc(status)}</span>`; },

  // "2 min ago"; the exact time is in the title.
  ago(unix) {
    if (!unix) return "–";
    const s = Date.now() / 1000 - unix;
    if (s < 10) return "just now";
    if (s < 60) return `${Math.floor(s)} s ago`;
    if (s < 3600) return `${Math.floor(s / 60)} min ago`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
    const d = Math.floor(s / 86400);
    return `${d} day${d > 1 ? "s" : ""} ago`;
  },

  // Start to finish (to now while it runs).
  jobDuration(j) {
    if (!j.started_at) return "–";
    return loraq.duration((j.finished_at || Date.now() / 1000) - j.started_at);
  },

  // Health warnings ({health, step}) and a diverged run's code, as badges; `title` says the step.
  HEALTH_LABELS: { overfitting: "overfitting", memorizing: "memorizing", not_training: "nothing trained", diverged: "diverged" },
  healthBadges(warnings, errorCode) {
    const seen = new Set();
    const out = [];
    for (const w of warnings || []) {
      if (seen.has(w.health)) continue;
      seen.add(w.health);
      const label = loraq.HEALTH_LABELS[w.health] || w.health;
      out.push(`<span class="badge warn" data-health="${loraq.esc(w.health)}" title="from step ${loraq.esc(w.step)}">⚠ ${loraq.esc(label)}</span>`);
    }
    if (errorCode === "diverged") out.push('<span class="badge bad" data-health="diverged">✖ diverged</span>');
    return out.join(" ");
  },
};

document.addEventListener("DOMContentLoaded", () => {
  loraq.showKey();
  document.getElementById("changekey").onclick = () => loraq.askKey().then(() => location.reload());
  for (const a of document.querySelectorAll("header nav a")) {
    if (a.getAttribute("href") === location.pathname) a.classList.add("active");
  }
});
