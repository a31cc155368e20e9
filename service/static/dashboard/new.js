// New job: upload the JSONL through /v1/files, show the dashboard's validation summary of the
// stored file (examples, tokens, bad lines with their numbers), optionally a dry run (steps,
// tokens, estimates), then POST /v1/fine_tuning/jobs with the LoRA shape and extension fields.
"use strict";

const uploaded = { train: null, valid: null }; // {id, summary}
const DEFAULT_MODEL = "smollm2-135m-instruct";

function summaryHtml(label, file, s) {
  const bad = s.bad_lines.map((b) => `<li>line ${b.line}: ${loraq.esc(b.reason)}</li>`).join("");
  const more = s.bad_line_count > s.bad_lines.length ? `<li>… and ${s.bad_line_count - s.bad_lines.length} more</li>` : "";
  return `<div class="card summary" data-kind="${label}" data-valid="${s.valid}">
    <h2>${loraq.esc(label)}: ${loraq.esc(file.filename)} <span class="muted">(${loraq.esc(file.id)}, ${loraq.bytes(file.bytes)})</span></h2>
    <dl class="kv">
      <dt>Examples</dt><dd class="examples">${loraq.int(s.examples)}</dd>
      <dt>Tokens</dt><dd class="tokens">${loraq.int(s.tokens)} <span class="muted">(${loraq.esc(s.token_count_method)})</span></dd>
      <dt>Messages</dt><dd>${loraq.int(s.messages)} (${loraq.int(s.assistant_messages)} from the assistant)</dd>
      <dt>Bad lines</dt><dd class="badcount">${s.bad_line_count}</dd>
    </dl>
    ${s.valid ? '<p class="ok">Every line is a valid chat example.</p>' : `<ul class="error badlines">${bad}${more}</ul>`}
  </div>`;
}

async function uploadAndCheck(kind, input) {
  const file = input.files[0];
  uploaded[kind] = null;
  renderSummaries();
  if (!file) return;
  const state = document.getElementById("submitstate");
  state.textContent = `Uploading ${file.name}…`;
  const form = new FormData();
  form.append("purpose", "fine-tune");
  form.append("file", file, file.name);
  try {
    const stored = await loraq.json("/v1/files", { method: "POST", body: form });
    const model = document.getElementById("model").value;
    const summary = await loraq.json(
      `/dashboard/api/files/${encodeURIComponent(stored.id)}/summary?model=${encodeURIComponent(model)}`);
    uploaded[kind] = { file: stored, summary };
    state.textContent = "";
  } catch (e) {
    state.textContent = "";
    showError(`Upload of ${file.name} failed: ${e.message}`);
  }
  renderSummaries();
}

function renderSummaries() {
  const parts = [];
  if (uploaded.train) parts.push(summaryHtml("training file", uploaded.train.file, uploaded.train.summary));
  if (uploaded.valid) parts.push(summaryHtml("validation file", uploaded.valid.file, uploaded.valid.summary));
  document.getElementById("summaries").innerHTML = parts.join("");
  const ok = uploaded.train && uploaded.train.summary.valid && (!uploaded.valid || uploaded.valid.summary.valid);
  document.getElementById("submit").disabled = !ok;
  document.getElementById("dryrun").disabled = !uploaded.train;
  if (uploaded.train && !ok) document.getElementById("submitstate").textContent = "Fix the bad lines and upload again.";
  else if (ok) document.getElementById("submitstate").textContent = "Ready.";
}

function showError(message) {
  const el = document.getElementById("submiterror");
  el.textContent = message;
  el.hidden = !message;
}

function intField(id) {
  const v = document.getElementById(id).value;
  return v === "" ? undefined : Number(v);
}

// The POST /v1/fine_tuning/jobs body from the form, extension fields included.
function jobBody() {
  const body = {
    model: document.getElementById("model").value,
    training_file: uploaded.train.file.id,
    hyperparameters: {
      n_epochs: intField("n_epochs"),
      batch_size: intField("batch_size"),
      learning_rate_multiplier: intField("learning_rate_multiplier"),
    },
    seed: intField("seed"),
    max_seq_len: intField("max_seq_len"),
    lora: {
      r: intField("lora_r"),
      alpha: intField("lora_alpha"),
      dropout: intField("lora_dropout"),
      use_rslora: document.getElementById("lora_use_rslora").checked,
    },
  };
  const targets = document.getElementById("lora_target_modules").value.trim();
  body.lora.target_modules = !targets || targets === "all-linear" ? "all-linear" : targets.split(",").map((t) => t.trim()).filter(Boolean);
  if (uploaded.valid) body.validation_file = uploaded.valid.file.id;
  const suffix = document.getElementById("suffix").value.trim();
  if (suffix) body.suffix = suffix;
  const queue = document.getElementById("queue").value.trim();
  if (queue) body.queue = queue;
  const prompts = document.getElementById("eval_prompts").value.split("\n").map((p) => p.trim()).filter(Boolean);
  if (prompts.length) body.eval_prompts = prompts;
  return body;
}

// Dry run: what the job would do (steps, tokens, estimates, bad lines), nothing queued.
async function dryRun() {
  showError("");
  const btn = document.getElementById("dryrun");
  btn.disabled = true;
  try {
    const plan = await loraq.json("/v1/fine_tuning/jobs", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...jobBody(), dry_run: true }),
    });
    const t = plan.training;
    // a class without a benchmark row for the model says why instead of a figure
    const est = plan.estimates.map((e) => e.unavailable === null
      ? `${loraq.esc(e.worker_class)}: ${loraq.num(e.peak_gpu_memory_gib, 3)} GiB peak, ${loraq.duration(e.wall_seconds)}`
      : `${loraq.esc(e.worker_class)}: <span class="muted">${loraq.esc(e.unavailable)}</span>`).join("<br>");
    document.getElementById("plankv").innerHTML = [
      ["Valid", plan.valid ? "yes" : "no"],
      ["Examples", `${loraq.int(t.examples)} trained, ${loraq.int(t.held_out_examples)} held out for validation`],
      ["Tokens", `${loraq.int(t.tokens)} (${loraq.int(t.trainable_tokens)} trainable) in ${loraq.int(t.rows)} rows`],
      ["Epochs", plan.hyperparameters.n_epochs],
      ["Batch size", `${plan.hyperparameters.batch_size} × ${plan.grad_accum} accumulated`],
      ["Steps", `<span id="plansteps">${plan.steps}</span> (${plan.micro_batches_per_epoch} micro-batches per epoch)`],
      ["Trained tokens", loraq.int(plan.trained_tokens)],
      ["Estimates", est],
    ].map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
    const errors = document.getElementById("planerrors");
    errors.innerHTML = plan.errors.map((e) =>
      `<li>${loraq.esc(e.param)}${e.line ? ` line ${e.line}` : ""}: ${loraq.esc(e.message)}</li>`).join("");
    errors.hidden = plan.errors.length === 0;
    document.getElementById("plan").hidden = false;
  } catch (e) {
    showError(`Dry run failed: ${e.message}`);
  } finally {
    btn.disabled = false;
  }
}

async function submit(ev) {
  ev.preventDefault();
  showError("");
  const body = jobBody();
  const btn = document.getElementById("submit");
  btn.disabled = true;
  try {
    const job = await loraq.json("/v1/fine_tuning/jobs", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    location.href = `/jobs/${encodeURIComponent(job.id)}`;
  } catch (e) {
    showError(e.message);
    btn.disabled = false;
  }
}

async function loadModels() {
  const body = await loraq.json("/v1/models");
  const select = document.getElementById("model");
  // Base models first; fine-tuned ones ("ft:...") cannot be fine-tuned again.
  const base = body.data.filter((m) => !m.id.startsWith("ft:"));
  const names = base.map((m) => m.id);
  // Random-init models (tests, benchmarks) and models not downloaded yet are labelled as such;
  // the value stays the bare name.
  const label = (m) => [
    m.use === "tests" ? "random weights, tests only" : m.random ? "random weights" : "",
    m.local ? "" : "not local: downloaded on first use",
  ].filter(Boolean).join("; ");
  select.innerHTML = base
    .map((m) => `<option value="${loraq.esc(m.id)}">${loraq.esc(m.id)}${label(m) ? ` (${label(m)})` : ""}</option>`)
    .join("");
  // The real pretrained model by default: a first job on random weights teaches nothing.
  if (names.includes(DEFAULT_MODEL)) select.value = DEFAULT_MODEL;
}

document.addEventListener("DOMContentLoaded", () => {
  loadModels().catch((e) => showError(`Could not list models: ${e.message}`));
  document.getElementById("trainfile").onchange = (ev) => uploadAndCheck("train", ev.target);
  document.getElementById("validfile").onchange = (ev) => uploadAndCheck("valid", ev.target);
  document.getElementById("newjob").onsubmit = submit;
  document.getElementById("dryrun").onclick = dryRun;
});
