// Jobs page: the table refreshes every second from /dashboard/api/jobs (filtered by status).
// Narrow screens hide the .opt columns (app.css); the table scrolls sideways if still too wide.
// Ticking several jobs and "Compare selected" opens /compare?ids=… (selection survives refreshes).
"use strict";

const REFRESH_MS = 1000;
const selected = new Set();

function progressCell(j) {
  if (!j.total_steps) return `<span class="muted">${j.step ? j.step : "–"}</span>`;
  return `<progress max="${j.total_steps}" value="${j.step}"></progress> ${j.step} / ${j.total_steps}`;
}

function filesCell(j) {
  // Every job with steps has a metrics CSV; the job page lists its checkpoints.
  const id = encodeURIComponent(j.id);
  const csv = j.step ? `<a href="#" data-csv="${loraq.esc(j.id)}">CSV</a>` : "";
  return `${csv} <a href="/jobs/${id}#checkpoints-card">checkpoints</a>`;
}

function row(j) {
  const running = j.status === "running";
  const checked = selected.has(j.id) ? " checked" : "";
  return `<tr data-job-id="${loraq.esc(j.id)}" data-status="${loraq.esc(j.status)}">
    <td class="pickcell"><input type="checkbox" class="pick" data-job="${loraq.esc(j.id)}"${checked} aria-label="compare ${loraq.esc(j.id)}"></td>
    <td class="id"><a href="/jobs/${encodeURIComponent(j.id)}" title="${loraq.esc(j.id)}">${loraq.esc(j.id)}</a></td>
    <td class="status-cell wrapcell">${loraq.statusBadge(j.status)} ${loraq.healthBadges(j.warnings, j.error_code)}</td>
    <td class="model" data-label="model" title="${loraq.esc(j.model)}">${loraq.esc(j.model)}</td>
    <td class="suffix" data-label="suffix">${loraq.esc(j.suffix || "–")}</td>
    <td class="num progress-cell" data-label="steps">${progressCell(j)}</td>
    <td class="num opt">${loraq.num(j.train_loss)}</td>
    <td class="num duration" data-label="took">${loraq.jobDuration(j)}</td>
    <td class="num opt">${running || j.tokens_per_s ? loraq.int(j.tokens_per_s) : "–"}</td>
    <td class="num opt">${running ? loraq.duration(j.eta_seconds) : "–"}</td>
    <td class="opt" title="${loraq.esc(loraq.time(j.created_at))}">${loraq.ago(j.created_at)}</td>
    <td class="opt files">${filesCell(j)}</td>
  </tr>`;
}

async function refresh() {
  const status = document.getElementById("statusfilter").value;
  const params = new URLSearchParams({ limit: "100" });
  if (status) params.set("status", status);
  const body = await loraq.json(`/dashboard/api/jobs?${params}`);
  document.querySelector("#jobs tbody").innerHTML = body.data.map(row).join("");
  for (const bar of document.querySelectorAll(".progress div[data-pct]")) bar.style.width = `${bar.dataset.pct}%`;
  document.getElementById("empty").hidden = body.data.length > 0;
  document.getElementById("loaderror").hidden = true;
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function updateCompare() {
  const btn = document.getElementById("compare");
  btn.disabled = selected.size < 2;
  btn.textContent = selected.size ? `Compare selected (${selected.size})` : "Compare selected";
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelector("#jobs tbody").onchange = (ev) => {
    const box = ev.target.closest("input.pick");
    if (!box) return;
    if (box.checked) selected.add(box.dataset.job); else selected.delete(box.dataset.job);
    updateCompare();
  };
  document.getElementById("compare").onclick = () => {
    location.href = `/compare?ids=${[...selected].map(encodeURIComponent).join(",")}`;
  };
  const filter = document.getElementById("statusfilter");
  filter.value = new URLSearchParams(location.search).get("status") || "";
  filter.onchange = () => {
    history.replaceState(null, "", filter.value ? `/?status=${filter.value}` : "/");
    refresh();
  };
  document.getElementById("jobs").onclick = (ev) => {
    const link = ev.target.closest("a[data-csv]");
    if (!link) return;
    ev.preventDefault();
    const id = link.dataset.csv;
    loraq.download(`/dashboard/api/jobs/${encodeURIComponent(id)}/metrics.csv`, `${id}-metrics.csv`);
  };
  loraq.poll(refresh, REFRESH_MS, (e) => {
    const el = document.getElementById("loaderror");
    el.textContent = e.message;
    el.hidden = false;
  });
});
