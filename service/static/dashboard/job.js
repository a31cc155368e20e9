// Job page: loss / learning-rate / grad-norm charts (uPlot) over step, tokens seen or wall time,
// health warnings as badges (header, above and on the loss chart), events with the per-step lines
// folded, checkpoints, downloads (adapter, metrics CSV), cancel, pause and resume, webhook deliveries
// and their attempts.
// Polls every second while the job is not finished; metric rows are fetched incrementally.
"use strict";

const POLL_MS = 1000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const jobId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop());
const jobPath = `/v1/fine_tuning/jobs/${encodeURIComponent(jobId)}`;
const dashPath = `/dashboard/api/jobs/${encodeURIComponent(jobId)}`;

// Column arrays, one entry per step (uPlot's data layout). tokens and time are running sums of
// each step's tokens and seconds: the "tokens seen" and "wall time" x-axes.
const rows = { step: [], tokens: [], time: [], train: [], valid: [], lr: [], gn: [] };
// a DPO job's readings (null on supervised jobs): chosen/rejected rewards, margin, accuracy,
// the chosen answers' NLL per token
const DPO_FIELDS = ["chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy",
  "valid_reward_margin", "valid_reward_accuracy", "chosen_nll", "valid_chosen_nll"];
for (const f of DPO_FIELDS) rows[f] = [];
const charts = {};
let job = null;
let checkpoints = [];
let warnings = []; // [{health, step}] from the progress endpoint
let lastEvents = [];

// Fewer steps than this are not smoothed: on a short curve the average lags far behind the last
// losses (0.6 on 3 points ends at 4.1 where the last loss is 3.84) and only hides them.
const SMOOTH_MIN_POINTS = 20;
const RAW_COLOR = "#3355dd";
// Markers on every raw loss point while there are few enough to tell apart.
const MARKERS_MAX_POINTS = 200;

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
// One tick label with `digits` significant digits; small values (learning rates) in scientific
// notation: 2.0e-4, not 0.000.
function tickLabel(v, digits) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  return a < 0.01 || a >= 1e6 ? v.toExponential(digits - 1) : String(+v.toPrecision(digits));
}

// Tick labels with the fewest significant digits (2 to 6) that tell every tick apart: 1.95e-4,
// 2.00e-4, 2.05e-4 rather than 2.0e-4 three times.
function distinctTicks(u, vals) {
  let labels = [];
  for (let digits = 2; digits <= 6; digits++) {
    labels = vals.map((v) => tickLabel(v, digits));
    if (new Set(labels).size === labels.length) break;
  }
  return labels;
}

// The learning rate's axis starts at 0 (warmup starts there, cosine and linear decay end there), so
// a flat or nearly flat schedule gets a few well-spaced ticks instead of a sliver of its range.
function fromZero(u, min, max) {
  return [Math.min(0, min ?? 0), max > 0 ? max * 1.1 : 1];
}
const compact = (v) => (v >= 1e9 ? `${+(v / 1e9).toFixed(1)}G` : v >= 1e6 ? `${+(v / 1e6).toFixed(1)}M` : v >= 1e3 ? `${+(v / 1e3).toFixed(1)}k` : `${v}`);

const X_AXES = {
  step: { label: "step", incrs: STEP_INCRS },
  tokens: { label: "tokens seen", values: (u, vals) => vals.map(compact) },
  time: { label: "wall time (training)", values: (u, vals) => vals.map((v) => loraq.duration(v)) },
};

function xMode() { return document.getElementById("xaxis").value; }
function xs() { return rows[xMode()]; }

function chartWidth(el) { return Math.max(260, el.clientWidth || el.parentElement.clientWidth - 32); }

// What the loss chart marks: each health warning at its step, and where a diverged run blew up
// (its last reported step: the one the optimizer never applied).
function chartMarks() {
  const marks = [...warnings];
  if (job && job.error && job.error.code === "diverged" && rows.step.length) {
    marks.push({ health: "diverged", step: rows.step[rows.step.length - 1] });
  }
  return marks;
}

// The last raw loss, drawn last so no line covers it: a ringed dot in the raw series' colour with
// its value beside it.
function lastLossMarker() {
  return {
    hooks: {
      draw: [(u) => {
        const i = lastIndex(rows.train);
        if (i < 0) return;
        const x = u.valToPos(xs()[i], "x", true);
        const y = u.valToPos(rows.train[i], "y", true);
        if (!isFinite(x) || !isFinite(y)) return;
        const ctx = u.ctx;
        const px = devicePixelRatio;
        ctx.save();
        ctx.beginPath();
        ctx.arc(x, y, 5 * px, 0, 2 * Math.PI);
        ctx.fillStyle = RAW_COLOR;
        ctx.strokeStyle = "#fff";
        ctx.lineWidth = 2 * px;
        ctx.fill();
        ctx.stroke();
        ctx.font = `600 ${12 * px}px system-ui, sans-serif`;
        const right = x > u.bbox.left + 0.75 * u.bbox.width;
        ctx.textAlign = right ? "right" : "left";
        ctx.textBaseline = "bottom";
        ctx.fillText(loraq.num(rows.train[i]), x + (right ? -8 : 8) * px, y - 6 * px);
        ctx.restore();
      }],
    },
  };
}

// Index of the last finite value, or -1.
function lastIndex(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && isFinite(values[i])) return i;
  return -1;
}

// Health warnings on the loss chart: a dashed line at the step, labelled.
function healthMarkers() {
  return {
    hooks: {
      draw: [(u) => {
        const ctx = u.ctx;
        ctx.save();
        ctx.strokeStyle = ctx.fillStyle = "#b26a00";
        ctx.setLineDash([5, 4]);
        ctx.lineWidth = 1.5 * devicePixelRatio;
        ctx.font = `${11 * devicePixelRatio}px system-ui, sans-serif`;
        chartMarks().forEach((w, n) => {
          const i = rows.step.indexOf(w.step);
          if (i < 0) return;
          const x = u.valToPos(xs()[i], "x", true);
          ctx.strokeStyle = ctx.fillStyle = w.health === "diverged" ? "#c62828" : "#b26a00";
          ctx.beginPath();
          ctx.moveTo(x, u.bbox.top);
          ctx.lineTo(x, u.bbox.top + u.bbox.height);
          ctx.stroke();
          // labels one line apart, so two warnings close together stay readable; left of the line
          // near the right edge, where the text would be cut off
          const y = u.bbox.top + (12 + 14 * n) * devicePixelRatio;
          const right = x > u.bbox.left + 0.75 * u.bbox.width;
          ctx.textAlign = right ? "right" : "left";
          ctx.fillText(loraq.HEALTH_LABELS[w.health] || w.health, x + (right ? -4 : 4) * devicePixelRatio, y);
        });
        ctx.restore();
      }],
    },
  };
}

function makeLossChart() {
  const el = document.getElementById("losschart");
  if (charts.loss) charts.loss.destroy();
  const log = document.getElementById("logscale").checked;
  charts.loss = new uPlot({
    width: chartWidth(el), height: 300,
    scales: { x: { time: false }, y: log ? { distr: 3 } : {} },
    axes: [X_AXES[xMode()], { label: "loss" }],
    plugins: [healthMarkers(), lastLossMarker()],
    series: [
      {},
      {
        label: "train", stroke: RAW_COLOR, width: 1.5,
        points: { show: (u, si, i0, i1) => i1 - i0 < MARKERS_MAX_POINTS, size: 6, fill: RAW_COLOR },
      },
      // dashed and grey: a trend line, never mistaken for the losses themselves
      { label: "train (smoothed)", stroke: "rgba(20,26,42,0.55)", width: 2, dash: [6, 4], points: { show: false } },
      { label: "validation", stroke: "#d9480f", width: 2, spanGaps: true, points: { show: true, size: 6 } },
    ],
  }, lossData(), el);
}

// A short curve has no smoothed line (all null): its raw points are the curve.
function lossData() {
  const w = Number(document.getElementById("smoothing").value);
  const smoothed = rows.train.length >= SMOOTH_MIN_POINTS ? smooth(rows.train, w) : rows.train.map(() => null);
  const note = document.getElementById("smoothing-note");
  note.hidden = rows.train.length >= SMOOTH_MIN_POINTS;
  note.textContent = `(off under ${SMOOTH_MIN_POINTS} steps)`;
  return [xs(), rows.train, smoothed, rows.valid];
}

function makeSmallChart(id, label, color) {
  const el = document.getElementById(id);
  const axis = X_AXES[xMode()];
  const y = id === "lrchart" ? { range: fromZero } : {};
  return new uPlot({
    width: chartWidth(el), height: 160,
    scales: { x: { time: false }, y },
    axes: [{ incrs: axis.incrs, values: axis.values }, { size: 70, values: distinctTicks }],
    legend: { show: true },
    series: [{}, { label, stroke: color, width: 1.5 }],
  }, [xs(), rows[id === "lrchart" ? "lr" : "gn"]], el);
}

// DPO's own curves, on the steps that have them; validation points where a pass ran. A line's
// fourth entry names its y scale: the chosen answers' NLL is in nats per token, not reward units
// (about 1-3 where rewards are within ±1), so it has its own axis on the right.
const DPO_CHARTS = {
  reward: ["rewardchart", [["chosen", "chosen_reward", "#2b8a3e"], ["rejected", "rejected_reward", "#c92a2a"],
    ["margin", "reward_margin", "#1864ab"], ["validation margin", "valid_reward_margin", "#d9480f"],
    ["chosen NLL / token", "chosen_nll", "#862e9c", "nll"],
    ["validation chosen NLL / token", "valid_chosen_nll", "#e67700", "nll"]]],
  acc: ["accchart", [["train", "reward_accuracy", "#1864ab"], ["validation", "valid_reward_accuracy", "#d9480f"]]],
};

function isDpo() {
  return rows.chosen_reward.some((v) => v !== null);
}

function dpoData(key) {
  return [xs(), ...DPO_CHARTS[key][1].map(([, field]) => rows[field])];
}

function makeDpoChart(key) {
  const [id, lines] = DPO_CHARTS[key];
  const el = document.getElementById(id);
  const axis = X_AXES[xMode()];
  const scales = { x: { time: false }, y: key === "acc" ? { range: [0, 1] } : {} };
  const axes = [{ incrs: axis.incrs, values: axis.values }, { size: 70, values: distinctTicks }];
  for (const scale of new Set(lines.map((line) => line[3]).filter(Boolean))) {
    scales[scale] = {};
    axes.push({ scale, side: 1, size: 60, values: distinctTicks, grid: { show: false } });
  }
  return new uPlot({
    width: chartWidth(el), height: 200, scales, axes,
    legend: { show: true },
    series: [{}, ...lines.map(([label, field, color, scale]) => ({
      label, scale: scale || "y", stroke: color, width: 1.5, spanGaps: field.startsWith("valid_"),
      points: { show: field.startsWith("valid_"), size: 5 },
    }))],
  }, dpoData(key), el);
}

function makeCharts() {
  makeLossChart();
  for (const key of ["lr", "gn", "reward", "acc"]) if (charts[key]) charts[key].destroy();
  charts.lr = makeSmallChart("lrchart", "lr", "#2b8a3e");
  charts.gn = makeSmallChart("gnchart", "grad norm", "#862e9c");
  document.getElementById("dpocharts").hidden = !isDpo();
  if (isDpo()) for (const key of Object.keys(DPO_CHARTS)) charts[key] = makeDpoChart(key);
  window.loraqCharts = charts; // for tests and the curious: charts.loss.data[0] are the x values
}

function resizeCharts() {
  for (const [key, id] of [["loss", "losschart"], ["lr", "lrchart"], ["gn", "gnchart"],
    ["reward", "rewardchart"], ["acc", "accchart"]]) {
    const el = document.getElementById(id);
    if (charts[key] && el.clientWidth) charts[key].setSize({ width: chartWidth(el), height: charts[key].height });
  }
}

function redraw() {
  charts.loss.setData(lossData());
  charts.lr.setData([xs(), rows.lr]);
  charts.gn.setData([xs(), rows.gn]);
  if (isDpo() && !charts.reward) makeCharts(); // the first DPO step arrived: its charts appear
  for (const key of Object.keys(DPO_CHARTS)) if (charts[key]) charts[key].setData(dpoData(key));
  const el = document.getElementById("losschart");
  el.dataset.points = String(rows.step.length);
  document.getElementById("points").textContent = `${rows.step.length} steps`;
}

async function fetchMetrics() {
  const after = rows.step.length ? rows.step[rows.step.length - 1] : 0;
  const body = await loraq.json(`${dashPath}/metrics?after=${after}`);
  for (const m of body.data) {
    const n = rows.step.length;
    rows.step.push(m.step);
    rows.tokens.push((n ? rows.tokens[n - 1] : 0) + (m.tokens || 0));
    rows.time.push((n ? rows.time[n - 1] : 0) + (m.step_seconds || 0));
    rows.train.push(m.train_loss);
    rows.valid.push(m.valid_loss ?? null);
    rows.lr.push(m.lr ?? null);
    rows.gn.push(m.grad_norm ?? null);
    for (const f of DPO_FIELDS) rows[f].push(m[f] ?? null);
  }
  return body.data.length > 0;
}

// No step ran (yet): charts would be empty boxes, so a sentence stands in for them.
function showCharts(status) {
  const empty = rows.step.length === 0;
  const wasHidden = document.getElementById("charts").hidden;
  document.getElementById("charts").hidden = empty;
  const note = document.getElementById("nocharts");
  note.hidden = !empty;
  note.textContent = TERMINAL.has(status)
    ? "No training step ran, so there is nothing to chart."
    : "Charts appear with the first training step.";
  if (wasHidden && !empty) resizeCharts(); // drawn while hidden: take the real width now
}

function kv(el, pairs) {
  el.innerHTML = pairs.map(([k, v]) => `<dt>${loraq.esc(k)}</dt><dd>${v}</dd>`).join("");
}

function renderHealth(j) {
  document.getElementById("badges").innerHTML = loraq.healthBadges(warnings, j.error && j.error.code);
  const notes = warnings.map((w) => {
    const label = loraq.HEALTH_LABELS[w.health] || w.health;
    return `<span class="badge warn" data-health="${loraq.esc(w.health)}">⚠ ${loraq.esc(label)} at step ${loraq.esc(w.step)}</span>`;
  });
  document.getElementById("healthnotes").innerHTML = notes.join(" ");
}

function renderJob(j, progress) {
  document.getElementById("jobid").textContent = j.id;
  document.getElementById("status").innerHTML = loraq.statusBadge(j.status);
  document.getElementById("status").dataset.status = j.status;
  document.getElementById("cancel").hidden = TERMINAL.has(j.status);
  // Pause: a queued or running job (a running one shows "Pausing…" until its worker stops it
  // with a checkpoint); Resume: a paused job, or one whose pause its worker has not reached yet.
  const pause = document.getElementById("pause");
  pause.hidden = !["queued", "running"].includes(j.status) || j.cancel_requested;
  pause.disabled = Boolean(j.pause_requested);
  pause.textContent = j.pause_requested ? "Pausing…" : "Pause";
  document.getElementById("resume").hidden = !(j.status === "paused" || j.pause_requested);
  document.getElementById("download-adapter").hidden = j.status !== "succeeded";
  document.getElementById("download-csv").hidden = rows.step.length === 0;
  // The error, once, at the top (the event log leaves out its copy of it).
  const err = document.getElementById("joberror");
  err.hidden = !j.error || !j.error.message;
  if (j.error && j.error.message) {
    err.textContent = `${j.error.code || "error"}: ${j.error.message}${j.error.param ? ` (param: ${j.error.param})` : ""}`;
  }
  renderHealth(j);
  const p = progress || {};
  kv(document.getElementById("summary"), [
    ["Model", loraq.esc(j.model)],
    ["Suffix", loraq.esc(j.user_provided_suffix || "–")],
    ["Fine-tuned model", loraq.esc(j.fine_tuned_model || "–")],
    ["Progress", p.total_steps ? `${p.step} / ${p.total_steps} steps` : "–"],
    ["Train loss", loraq.num(p.train_loss)],
    ["Tokens/s (real)", j.status === "running" ? loraq.int(p.tokens_per_s) : "–"],
    ["Padding", p.padding_fraction == null ? "–" : `${(100 * p.padding_fraction).toFixed(1)}% of token slots`],
    ["ETA", j.status === "running" ? loraq.duration(p.eta_seconds) : "–"],
    ["Duration", loraq.jobDuration(p)],
    ["Trained tokens", loraq.int(j.trained_tokens)],
    ["Training file", loraq.esc(j.training_file)],
    // the server's sentence: the rule and the words of the job's own event (worker/engine/holdout.py)
    ["Validation", loraq.esc(p.validation || "–")],
    ["Created", `${loraq.ago(j.created_at)} <span class="muted">(${loraq.esc(loraq.time(j.created_at))})</span>`],
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

// Events oldest first. Routine lines (per-step metrics, "Checkpoint created") fold into one line
// per run of them, unless "per-step lines" is ticked: the charts and the Checkpoints table have
// them. Milestones, warnings and errors always show. The job's own error is at the top of the
// page, so its copy here is left out.
const isRoutine = (e) => e.type === "metrics" || (e.level === "info" && e.message.startsWith("Checkpoint created"));

function renderEvents() {
  const showSteps = document.getElementById("showsteps").checked;
  const errorText = job && job.error ? job.error.message : null;
  const out = [];
  let steps = 0, checkpoints = 0;
  const flush = () => {
    const parts = [];
    if (steps) parts.push(`${steps} per-step line${steps > 1 ? "s" : ""}`);
    if (checkpoints) parts.push(`${checkpoints} checkpoint${checkpoints > 1 ? "s" : ""}`);
    if (parts.length) out.push(`<div class="folded muted">… ${parts.join(", ")}</div>`);
    steps = checkpoints = 0;
  };
  for (const e of [...lastEvents].reverse()) {
    if (!showSteps && isRoutine(e)) {
      if (e.type === "metrics") steps += 1; else checkpoints += 1;
      continue;
    }
    if (e.level === "error" && e.message === errorText) continue;
    flush();
    const health = e.data && e.data.health ? ` data-health="${loraq.esc(e.data.health)}"` : "";
    out.push(`<div class="level-${loraq.esc(e.level)}"${health}><span class="muted">${loraq.esc(loraq.clock(e.created_at))}</span> ${loraq.esc(e.message)}</div>`);
  }
  flush();
  document.getElementById("events").innerHTML = out.join("");
}

async function fetchEvents() {
  const body = await loraq.json(`${jobPath}/events?limit=200`);
  lastEvents = body.data;
  renderEvents();
}

async function fetchCheckpoints() {
  const body = await loraq.json(`${jobPath}/checkpoints?limit=100`);
  const data = [...body.data].sort((a, b) => a.step_number - b.step_number);
  checkpoints = data;
  document.getElementById("nocheckpoints").hidden = data.length > 0;
  document.getElementById("checkpoints").hidden = data.length === 0; // no header row over nothing
  document.getElementById("checkpoints-link").textContent = `Checkpoints (${data.length})`;
  document.querySelector("#checkpoints tbody").innerHTML = data.map((c) => `<tr>
      <td class="num">${c.step_number}</td>
      <td class="num">${loraq.num(c.metrics && c.metrics.train_loss)}</td>
      <td class="num">${loraq.num(c.metrics && c.metrics.valid_loss)}</td>
      <td class="opt" title="${loraq.esc(loraq.time(c.created_at))}">${loraq.ago(c.created_at)}</td>
      <td><button class="secondary" type="button" data-checkpoint="${loraq.esc(c.id)}" data-step="${c.step_number}">Download</button></td>
    </tr>`).join("");
}

// The job's events sent to the organization's webhook endpoints (hidden while there are none),
// each with its attempts: status code or error, duration. True while one is still pending.
async function fetchWebhooks() {
  const body = await loraq.json(`${dashPath}/webhook_deliveries`);
  document.getElementById("webhooks-card").hidden = body.data.length === 0;
  document.querySelector("#webhooks tbody").innerHTML = body.data.map(webhookRow).join("");
  return body.data.some((d) => d.state === "pending");
}

const WEBHOOK_ATTEMPTS_SHOWN = 5; // the latest; the count of the earlier ones says the rest

function webhookRow(d) {
  const hidden = Math.max(0, d.attempts.length - WEBHOOK_ATTEMPTS_SHOWN);
  const attempts = d.attempts.slice(hidden).map((a) => {
    const ok = a.status_code !== null && a.status_code >= 200 && a.status_code < 300;
    const what = a.status_code !== null ? `HTTP ${a.status_code}` : a.error;
    const text = `#${a.attempt} ${loraq.clock(a.started_at)} ${what} (${Math.round(a.duration_ms)} ms)`;
    return `<li class="${ok ? "" : "failed"}" title="${loraq.esc(a.error || "")}">${loraq.esc(text)}</li>`;
  });
  if (hidden) attempts.unshift(`<li class="muted">${hidden} earlier attempt${hidden > 1 ? "s" : ""}</li>`);
  if (d.state === "pending" && d.next_attempt_at) {
    attempts.push(`<li class="muted">next attempt ${loraq.esc(loraq.clock(d.next_attempt_at))}</li>`);
  }
  return `<tr data-delivery-id="${loraq.esc(d.id)}" data-state="${loraq.esc(d.state)}">
      <td>${loraq.esc(d.event_type.replace("fine_tuning.job.", ""))}</td>
      <td class="wrap mono">${loraq.esc(d.url)}</td>
      <td>${loraq.statusBadge(d.state)}</td>
      <td class="wrap"><ul class="attempts">${attempts.join("")}</ul></td>
    </tr>`;
}

// Deliveries are sent after the job ends: keep reading them while one is pending.
async function followWebhooks() {
  const pending = await fetchWebhooks().catch(() => true);
  if (pending) setTimeout(followWebhooks, POLL_MS);
}

async function refresh() {
  const [j, progress] = await Promise.all([loraq.json(jobPath), loraq.json(`${dashPath}/progress`)]);
  job = j;
  warnings = progress.warnings || [];
  if (await fetchMetrics()) redraw();
  showCharts(j.status);
  renderJob(j, progress);
  await Promise.all([fetchEvents(), fetchCheckpoints(), fetchWebhooks()]);
  await fetchSamples();
  document.getElementById("loaderror").hidden = true;
  if (TERMINAL.has(j.status)) {
    // Rows written in the job's last flush may land after the status: read once more, then stop.
    if (await fetchMetrics()) redraw();
    showCharts(j.status);
    renderJob(j, progress);
    if (j.status === "succeeded") showPlayground(j);
    followWebhooks();
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
  makeCharts();
  const slider = document.getElementById("smoothing");
  slider.oninput = () => {
    document.getElementById("smoothing-value").textContent = Number(slider.value).toFixed(2);
    charts.loss.setData(lossData());
  };
  document.getElementById("logscale").onchange = makeLossChart;
  document.getElementById("xaxis").onchange = () => { makeCharts(); redraw(); };
  document.getElementById("showsteps").onchange = renderEvents;
  window.addEventListener("resize", resizeCharts);
  for (const [id, label] of [["cancel", "Cancel"], ["pause", "Pause"], ["resume", "Resume"]]) {
    document.getElementById(id).onclick = async () => {
      const btn = document.getElementById(id);
      btn.disabled = true;
      try {
        await loraq.json(`${jobPath}/${id}`, { method: "POST" });
        await refresh();
      } catch (e) {
        alert(`${label} failed: ${e.message}`);
      } finally {
        btn.disabled = id === "pause" && Boolean(job.pause_requested);
      }
    };
  }
  document.getElementById("download-adapter").onclick = () =>
    loraq.download(`${jobPath}/adapter`, `${jobId}-adapter.zip`);
  document.getElementById("download-csv").onclick = () =>
    loraq.download(`${dashPath}/metrics.csv`, `${jobId}-metrics.csv`);
  document.getElementById("checkpoints").onclick = (ev) => {
    const btn = ev.target.closest("button[data-checkpoint]");
    if (!btn) return;
    loraq.download(
      `${jobPath}/checkpoints/${encodeURIComponent(btn.dataset.checkpoint)}/adapter`,
      `${jobId}-step-${btn.dataset.step}.zip`);
  };
  loraq.poll(refresh, POLL_MS, (e) => {
    const el = document.getElementById("loaderror");
    el.textContent = e.message;
    el.hidden = false;
  });
});
