// Compare runs: the loss curves of several jobs overlaid (train and validation, by step or by
// trained tokens) and their hyperparameters side by side, differing fields highlighted.
// /compare?ids=ftjob-a,ftjob-b,…
"use strict";

const COLORS = ["#3355dd", "#d9480f", "#2b8a3e", "#862e9c", "#e8590c", "#1098ad", "#5c940d", "#c2255c"];
const ids = (new URLSearchParams(location.search).get("ids") || "").split(",").filter(Boolean);
const runs = []; // {job, rows: [{step, train_loss, valid_loss, tokens}]}
let chart = null;

// One (x, y) table per series; uPlot.join aligns them on the union of their x values.
function seriesTables(xKey, withValid) {
  const tables = [], series = [{}];
  runs.forEach((run, i) => {
    const color = COLORS[i % COLORS.length];
    let cum = 0;
    const xs = run.rows.map((r) => (xKey === "tokens" ? (cum += r.tokens || 0) : r.step));
    tables.push([xs, run.rows.map((r) => r.train_loss)]);
    series.push({ label: `${run.job.id} train`, stroke: color, width: 2, spanGaps: true });
    if (withValid) {
      tables.push([xs, run.rows.map((r) => r.valid_loss ?? null)]);
      series.push({ label: `${run.job.id} valid`, stroke: color, dash: [6, 4], width: 2, spanGaps: true,
                    points: { show: true, size: 5 } });
    }
  });
  return { data: uPlot.join(tables), series };
}

function drawChart() {
  const el = document.getElementById("comparechart");
  const xKey = document.getElementById("xaxis").value;
  const { data, series } = seriesTables(xKey, document.getElementById("showvalid").checked);
  if (chart) chart.destroy();
  chart = new uPlot({
    width: Math.max(300, el.clientWidth), height: 320,
    scales: { x: { time: false } },
    axes: [{ label: xKey }, { label: "loss" }],
    series,
  }, data, el);
  window.loraqCompareChart = chart; // tests read chart.series and chart.data
  el.dataset.series = String(series.length - 1);
  document.getElementById("comparepoints").textContent =
    runs.map((r) => `${r.job.id}: ${r.rows.length} steps`).join(" · ");
}

// The fields worth comparing, flattened: "hyperparameters.n_epochs", "lora.r", …
function fields(job) {
  const out = {
    model: job.model,
    status: job.status,
    training_file: job.training_file,
    validation_file: job.validation_file,
    seed: job.seed,
    max_seq_len: job.max_seq_len,
    suffix: job.user_provided_suffix,
    trained_tokens: job.trained_tokens,
    "final train loss": job.progress && job.progress.train_loss,
  };
  for (const [k, v] of Object.entries(job.hyperparameters || {})) out[`hyperparameters.${k}`] = v;
  for (const [k, v] of Object.entries(job.lora || {})) out[`lora.${k}`] = Array.isArray(v) ? v.join(",") : v;
  for (const [k, v] of Object.entries(job.eval_prompts ? { eval_prompts: job.eval_prompts.length } : {})) out[k] = v;
  return out;
}

function drawTable() {
  const all = runs.map((r) => fields(r.job));
  const names = [...new Set(all.flatMap((f) => Object.keys(f)))];
  const show = (v) => (v === null || v === undefined ? "–" : typeof v === "number" && !Number.isInteger(v) ? loraq.num(v) : String(v));
  document.querySelector("#comparehp thead").innerHTML =
    `<tr><th>field</th>${runs.map((r) => `<th><a href="/jobs/${encodeURIComponent(r.job.id)}">${loraq.esc(r.job.id)}</a></th>`).join("")}</tr>`;
  document.querySelector("#comparehp tbody").innerHTML = names.map((name) => {
    const values = all.map((f) => show(f[name]));
    const differs = new Set(values).size > 1;
    return `<tr data-field="${loraq.esc(name)}" data-differs="${differs}"><td>${loraq.esc(name)}</td>${
      values.map((v) => `<td class="${differs ? "diff" : ""}">${loraq.esc(v)}</td>`).join("")}</tr>`;
  }).join("");
}

async function load() {
  if (ids.length < 2) throw new Error("pick at least two jobs in the jobs list to compare");
  const loaded = await Promise.all(ids.map(async (id) => {
    const path = encodeURIComponent(id);
    const [job, metrics] = await Promise.all([
      loraq.json(`/v1/fine_tuning/jobs/${path}`),
      loraq.json(`/dashboard/api/jobs/${path}/metrics`),
    ]);
    return { job, rows: metrics.data };
  }));
  runs.push(...loaded);
  drawChart();
  drawTable();
  document.body.dataset.loaded = "true";
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("xaxis").onchange = drawChart;
  document.getElementById("showvalid").onchange = drawChart;
  load().catch((e) => {
    const el = document.getElementById("compareerror");
    el.textContent = e.message;
    el.hidden = false;
  });
});
