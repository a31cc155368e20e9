// Job page: loss / learning-rate / grad-norm charts (uPlot), events, checkpoints, downloads, cancel.
// Polls every second while the job is not finished; metric rows are fetched incrementally.
"use strict";

const POLL_MS = 1000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const jobId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop());

// Column arrays, one entry per step (uPlot's data layout): steps[i] is the x of every series.
const rows = { step: [], train: [], valid: [], lr: [], gn: [] };
const charts = {};
let job = null;
let checkpoints = [];

// TensorBoard's smoothing: an exponential moving average, de-biased so early points are not
// pulled toward zero. weight 0 = raw values.
function smooth(values, weight) {
  const out = [];
  let last = 0, n = 0;
  for (const v of values) {
    if (v === null || !isFinite(v)) { out.push(null); continue; }
    last = last * weight + (1 - weight) * v;
    n += 1;
    out.push(last / (1 - Math.pow(weight, n)));
  }
  return out;
}

// Steps are integers: never put a tick between two steps.
const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
const stepAxis = { label: "step", incrs: STEP_INCRS };
// Learning rates are small: 2e-4, not 0.000.
const sciValues = (u, vals) => vals.map((v) => (v === 0 ? "0" : Math.abs(v) < 0.01 ? v.toExponential(1) : v.toPrecision(3)));

function chartWidth(el) { return Math.max(300, el.clientWidth || el.parentElement.clientWidth - 32); }

function makeLossChart() {
  const el = document.getElementById("losschart");
  if (charts.loss) charts.loss.destroy();
  const log = document.getElementById("logscale").checked;
  charts.loss = new uPlot({
    width: chartWidth(el), height: 300,
    scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
    axes: [stepAxis, { label: "loss" }],
    series: [
      {},
      { label: "train", stroke: "rgba(51,85,221,0.25)", width: 1 },
      { label: "train (smoothed)", stroke: "#3355dd", width: 2 },
      { label: "validation", stroke: "#d9480f", width: 2, spanGaps: true, points: { show: true, size: 6 } },
    ],
  }, lossData(), el);
}

function lossData() {
  const w = Number(document.getElementById("smoothing").value);
  return [rows.step, rows.train, smooth(rows.train, w), rows.valid];
}

function makeSmallChart(id, label, color) {
  const el = document.getElementById(id);
  return new uPlot({
    width: chartWidth(el), height: 160,
    scales: { x: { time: false } },
    axes: [{ incrs: STEP_INCRS }, { size: 70, values: sciValues }],
    legend: { show: true },
    series: [{}, { label, stroke: color, width: 1.5 }],
  }, [[], []], el);
}

function redraw() {
  charts.loss.setData(lossData());
  charts.lr.setData([rows.step, rows.lr]);
  charts.gn.setData([rows.step, rows.gn]);
  const el = document.getElementById("losschart");
  el.dataset.points = String(rows.step.length);
  document.getElementById("points").textContent = `${rows.step.length} steps`;
}

async function fetchMetrics() {
  const after = rows.step.length ? rows.step[rows.step.length - 1] : 0;
  const body = await loraq.json(`/dashboard/api/jobs/${encodeURIComponent(jobId)}/metrics?after=${after}`);
  for (const m of body.data) {
    rows.step.push(m.step);
    rows.train.push(m.train_loss);
    rows.valid.push(m.valid_loss ?? null);
    rows.lr.push(m.lr ?? null);
    rows.gn.push(m.grad_norm ?? null);
  }
  return body.data.length > 0;
}

function kv(el, pairs) {
  el.innerHTML = pairs.map(([k, v]) => `<dt>${loraq.esc(k)}</dt><dd>${v}</dd>`).join("");
}

function renderJob(j, progress) {
  document.getElementById("jobid").textContent = j.id;
  document.getElementById("status").innerHTML = loraq.statusBadge(j.status);
  document.getElementById("status").dataset.status = j.status;
  document.getElementById("cancel").hidden = TERMINAL.has(j.status);
  document.getElementById("download-adapter").hidden = j.status !== "succeeded";
  const err = document.getElementById("joberror");
  err.hidden = !j.error || !j.error.message;
  if (j.error && j.error.message) {
    err.textContent = `${j.error.code || "error"}: ${j.error.message}${j.error.param ? ` (param: ${j.error.param})` : ""}`;
  }
  const p = progress || {};
  kv(document.getElementById("summary"), [
    ["Model", loraq.esc(j.model)],
    ["Fine-tuned model", loraq.esc(j.fine_tuned_model || "–")],
    ["Progress", p.total_steps ? `${p.step} / ${p.total_steps} steps` : "–"],
    ["Train loss", loraq.num(p.train_loss)],
    ["Tokens/s (real)", j.status === "running" ? loraq.int(p.tokens_per_s) : "–"],
    ["Padding", p.padding_fraction == null ? "–" : `${(100 * p.padding_fraction).toFixed(1)}% of token slots`],
    ["ETA", j.status === "running" ? loraq.duration(p.eta_seconds) : "–"],
    ["Trained tokens", loraq.int(j.trained_tokens)],
    ["Training file", loraq.esc(j.training_file)],
    ["Validation file", loraq.esc(j.validation_file || "–")],
    ["Created", loraq.time(j.created_at)],
    ["Finished", loraq.time(j.finished_at)],
  ]);
  const method = j.method && j.method.supervised && j.method.supervised.hyperparameters;
  const hp = { ...(method || {}), ...(j.hyperparameters || {}) };
  if (j.seed !== undefined) hp.seed = j.seed;
  if (j.max_seq_len !== undefined) hp.max_seq_len = j.max_seq_len;
  for (const [k, v] of Object.entries(j.lora || {})) hp[`lora.${k}`] = v;
  if (j.user_provided_suffix) hp.suffix = j.user_provided_suffix;
  kv(document.getElementById("hyperparameters"),
    Object.entries(hp).map(([k, v]) => [k, loraq.esc(typeof v === "object" ? JSON.stringify(v) : v)]));
}

async function fetchEvents() {
  const body = await loraq.json(`/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}/events?limit=200`);
  document.getElementById("events").innerHTML = body.data.map((e) =>
    `<div class="level-${loraq.esc(e.level)}">${loraq.esc(loraq.time(e.created_at))} [${loraq.esc(e.level)}] ${loraq.esc(e.message)}</div>`
  ).join("");
}

async function fetchCheckpoints() {
  const body = await loraq.json(`/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}/checkpoints?limit=100`);
  const data = [...body.data].sort((a, b) => a.step_number - b.step_number);
  checkpoints = data;
  document.getElementById("nocheckpoints").hidden = data.length > 0;
  document.querySelector("#checkpoints tbody").innerHTML = data.map((c) => `<tr>
      <td class="num">${c.step_number}</td>
      <td class="num">${loraq.num(c.metrics && c.metrics.train_loss)}</td>
      <td class="num">${loraq.num(c.metrics && c.metrics.valid_loss)}</td>
      <td>${loraq.time(c.created_at)}</td>
      <td><button class="secondary" type="button" data-checkpoint="${loraq.esc(c.id)}" data-step="${c.step_number}">Download</button></td>
    </tr>`).join("");
}

async function refresh() {
  const [j, progress] = await Promise.all([
    loraq.json(`/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}`),
    loraq.json(`/dashboard/api/jobs/${encodeURIComponent(jobId)}/progress`),
  ]);
  job = j;
  if (await fetchMetrics()) redraw();
  renderJob(j, progress);
  await Promise.all([fetchEvents(), fetchCheckpoints()]);
  await fetchSamples();
  if (TERMINAL.has(j.status)) {
    // Rows written in the job's last flush may land after the status: read once more, then stop.
    if (await fetchMetrics()) redraw();
    if (j.status === "succeeded") showPlayground(j);
    document.body.dataset.final = "true";
    return false;
  }
  return true;
}

// Samples of the job's eval_prompts at each checkpoint: a row per prompt, a column per checkpoint.
async function fetchSamples() {
  const body = await loraq.json(`/dashboard/api/jobs/${encodeURIComponent(jobId)}/samples`);
  const card = document.getElementById("samplescard");
  card.hidden = body.data.length === 0;
  if (!body.data.length) return;
  const prompts = body.prompts;
  document.querySelector("#samples thead").innerHTML =
    `<tr><th>Prompt</th>${body.data.map((c) => `<th>step ${c.step}</th>`).join("")}</tr>`;
  document.querySelector("#samples tbody").innerHTML = prompts.map((p, i) =>
    `<tr><td>${loraq.esc(p)}</td>${body.data.map((c) =>
      `<td data-step="${c.step}">${loraq.esc(c.samples[i] ?? "")}</td>`).join("")}</tr>`).join("");
}

// Playground: one prompt, the base model's and the fine-tuned model's answers side by side, both
// streamed from /v1/chat/completions at once.
function showPlayground(j) {
  const card = document.getElementById("playground");
  if (!card.hidden) return;
  const select = document.getElementById("pg-model");
  const models = [[j.fine_tuned_model, "final"], ...checkpoints.map((c) => [c.fine_tuned_model_checkpoint, `step ${c.step_number}`])];
  select.innerHTML = models.map(([m, label]) => `<option value="${loraq.esc(m)}">${loraq.esc(label)}: ${loraq.esc(m)}</option>`).join("");
  document.getElementById("pg-base-name").textContent = j.model;
  card.hidden = false;
}

async function runPlayground() {
  const state = document.getElementById("pg-state");
  const btn = document.getElementById("pg-run");
  const tuned = document.getElementById("pg-model").value;
  document.getElementById("pg-tuned-name").textContent = tuned;
  const params = {
    messages: [{ role: "user", content: document.getElementById("pg-prompt").value }],
    temperature: Number(document.getElementById("pg-temperature").value),
    max_tokens: Number(document.getElementById("pg-max-tokens").value),
  };
  const run = async (model, el) => {
    el.textContent = "";
    el.dataset.done = "false";
    try {
      el.dataset.finish = await loraq.streamChat({ ...params, model }, (t) => { el.textContent += t; }) || "";
    } catch (e) {
      el.textContent = `error: ${e.message}`;
    }
    el.dataset.done = "true";
  };
  btn.disabled = true;
  state.textContent = "generating…";
  await Promise.all([run(job.model, document.getElementById("pg-base")), run(tuned, document.getElementById("pg-tuned"))]);
  state.textContent = "";
  btn.disabled = false;
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("pg-run").onclick = runPlayground;
  makeLossChart();
  charts.lr = makeSmallChart("lrchart", "lr", "#2b8a3e");
  charts.gn = makeSmallChart("gnchart", "grad norm", "#862e9c");
  window.loraqCharts = charts; // for tests and the curious: charts.loss.data[0] are the steps
  const slider = document.getElementById("smoothing");
  slider.oninput = () => {
    document.getElementById("smoothing-value").textContent = Number(slider.value).toFixed(2);
    charts.loss.setData(lossData());
  };
  document.getElementById("logscale").onchange = makeLossChart;
  document.getElementById("cancel").onclick = async () => {
    const btn = document.getElementById("cancel");
    btn.disabled = true;
    try {
      await loraq.json(`/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}/cancel`, { method: "POST" });
    } catch (e) {
      alert(`Cancel failed: ${e.message}`);
    } finally {
      btn.disabled = false;
    }
  };
  document.getElementById("download-adapter").onclick = () =>
    loraq.download(`/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}/adapter`, `${jobId}-adapter.zip`);
  document.getElementById("checkpoints").onclick = (ev) => {
    const btn = ev.target.closest("button[data-checkpoint]");
    if (!btn) return;
    loraq.download(
      `/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}/checkpoints/${encodeURIComponent(btn.dataset.checkpoint)}/adapter`,
      `${jobId}-step-${btn.dataset.step}.zip`);
  };
  loraq.poll(refresh, POLL_MS, (e) => {
    const el = document.getElementById("joberror");
    el.textContent = e.message;
    el.hidden = false;
  });
});
