// Workers page: the Redis registry each training worker refreshes every 5 s (see
// worker/metrics/registry.py), then the inference workers (`loraq inference`, chat completions) from
// their heartbeats: those report no job, kernels or GPUs. Each cell is labelled for the narrow
// layout (app.css), where a row is one block.
"use strict";

function gpuHtml(g) {
  const mem = `${loraq.bytes(g.memory_used_bytes)} / ${loraq.bytes(g.memory_total_bytes)}`;
  return `<div class="gpu" data-gpu="${g.index}">#${g.index} ${loraq.esc(g.name)}: ${g.utilization_percent.toFixed(0)}% util,
    ${mem}, ${g.temperature_celsius.toFixed(0)} °C, ${g.power_watts.toFixed(0)} W, ${(g.sm_clock_hertz / 1e6).toFixed(0)} MHz</div>`;
}

function trainingCells(w) {
  const job = w.job && !w.job.job_id
    ? '<span class="muted">busy (another tenant\'s job)</span>'
    : w.job
    ? `<a href="/jobs/${encodeURIComponent(w.job.job_id)}">${loraq.esc(w.job.job_id)}</a>
       <span class="muted">${loraq.esc(w.job.model)} ${w.job.total_steps ? `${w.job.step}/${w.job.total_steps}` : ""}</span>`
    : '<span class="muted">idle</span>';
  const kernels = w.kernels.compiled
    ? '<span class="ok">yes</span>'
    : `<span class="muted" title="${loraq.esc(w.kernels.reason)}">no: ${loraq.esc(w.kernels.reason)}</span>`;
  const gpus = w.gpus.length ? w.gpus.map(gpuHtml).join("") : '<span class="muted">none (no NVML)</span>';
  return { job, kernels, gpus };
}

function row(w) {
  const kind = w.kind || "training";
  const none = '<span class="muted">–</span>';
  const cells = kind === "training"
    ? trainingCells(w)
    : { job: '<span class="muted">serves chat completions</span>', kernels: none, gpus: none };
  return `<tr data-node="${loraq.esc(w.node)}" data-kind="${loraq.esc(kind)}">
    <td class="node" data-label="worker">${loraq.esc(w.node)}</td>
    <td class="kind" data-label="kind">${loraq.esc(kind)}</td>
    <td class="queue" data-label="queue">${loraq.esc(w.queue)}</td>
    <td class="job wrap" data-label="job">${cells.job}</td>
    <td class="kernels wrap" data-label="kernels">${cells.kernels}</td>
    <td class="gpus wrap" data-label="GPUs">${cells.gpus}</td>
    <td class="seen" data-label="seen">${loraq.time(w.last_seen)}</td>
    <td class="metrics" data-label="metrics">${w.metrics_port ? `:${w.metrics_port}/metrics` : "–"}</td>
  </tr>`;
}

async function refresh() {
  const body = await loraq.json("/dashboard/api/workers");
  document.querySelector("#workers tbody").innerHTML = body.data.map(row).join("");
  document.getElementById("noworkers").hidden = body.data.length > 0;
  document.getElementById("loaderror").hidden = true;
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

document.addEventListener("DOMContentLoaded", () => {
  loraq.poll(refresh, 2000, (e) => {
    const el = document.getElementById("loaderror");
    el.textContent = e.message;
    el.hidden = false;
  });
});
