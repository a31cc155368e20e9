// New job: upload the JSONL through /v1/files, show the dashboard's validation summary of the
// stored file (examples, tokens, bad lines with their numbers), optionally a dry run (steps,
// tokens, estimates), then POST /v1/fine_tuning/jobs with the LoRA shape and extension fields.
// Every field starts empty and only the fields the user set are sent: the server fills the rest
// ("auto" hyperparameters, a random seed, the LoRA shape's defaults), exactly as for a request from
// the CLI, the API or the openai client with the same choices.
// The Advanced section is built from the job request's JSON schema in /openapi.json, so its
// fields, defaults, ranges and descriptions are the API's own (worker/engine/training_config.py).
"use strict";

const uploaded = { train: null, valid: null }; // {id, summary}
const models = {}; // id -> its /v1/models entry
const DEFAULT_MODEL = "smollm2-135m-instruct";
// Top-level fields of the job request that are not training settings, or that have their own
// control above; every other field of the request is an Advanced field.
const NOT_ADVANCED = new Set([
  "model", "training_file", "validation_file", "hyperparameters", "method", "suffix", "metadata",
  "integrations", "dry_run", "seed", "max_seq_len", "lora", "queue", "eval_prompts",
]);
// The controls above, each a field of the API's schema: input id -> [schema name, field]. Their
// placeholders (the default), notes, bounds and the checkbox's initial state come from it.
const BASIC = {
  n_epochs: ["Hyperparameters", "n_epochs"],
  batch_size: ["Hyperparameters", "batch_size"],
  learning_rate_multiplier: ["Hyperparameters", "learning_rate_multiplier"],
  seed: ["JobCreate", "seed"],
  max_seq_len: ["JobCreate", "max_seq_len"],
  lora_r: ["LoraConfig", "r"],
  lora_alpha: ["LoraConfig", "alpha"],
  lora_dropout: ["LoraConfig", "dropout"],
  lora_target_modules: ["LoraConfig", "target_modules"],
  lora_use_rslora: ["LoraConfig", "use_rslora"],
};
const advanced = []; // names of the Advanced fields the page rendered

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
    const model = chosenModel();
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

// Marks the control of the field a 400 names (opening Advanced if it is there), or clears the mark.
function markInvalid(param) {
  for (const el of document.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  // a 400 on `model` names the Hub id typed in, when one is
  const id = param === "model" && typedHubModel() ? "hub_model"
    : (param || "").replace(/^hyperparameters\./, "").replace(".", "_");
  const el = id && document.getElementById(id);
  if (!el || !el.closest("#newjob")) return;
  const section = el.closest("details");
  if (section) section.open = true;
  el.setAttribute("aria-invalid", "true");
  el.focus();
}

// A number field's value, or undefined when it is empty (the server's default).
function numberField(id) {
  const v = document.getElementById(id).value.trim();
  return v === "" ? undefined : Number(v);
}

// "all-linear" or a list of module names; undefined when empty.
function targetModules() {
  const v = document.getElementById("lora_target_modules").value.trim();
  if (!v) return undefined;
  return v === "all-linear" ? v : v.split(",").map((t) => t.trim()).filter(Boolean);
}

// A checkbox's value only when it differs from the schema's default (kept in data-default).
function changedCheckbox(id) {
  const el = document.getElementById(id);
  return el.checked === (el.dataset.default === "true") ? undefined : el.checked;
}

// `fields` without its unset entries; undefined when none is set (the whole object is left out).
function setOnly(fields) {
  const out = Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined));
  return Object.keys(out).length ? out : undefined;
}

// The POST /v1/fine_tuning/jobs body from the form: the model, the files and only the fields the
// user set. JSON.stringify leaves out the undefined ones.
function jobBody() {
  const body = {
    model: chosenModel(),
    training_file: uploaded.train.file.id,
    hyperparameters: setOnly({
      n_epochs: numberField("n_epochs"),
      batch_size: numberField("batch_size"),
      learning_rate_multiplier: numberField("learning_rate_multiplier"),
    }),
    seed: numberField("seed"),
    max_seq_len: numberField("max_seq_len"),
    lora: setOnly({
      r: numberField("lora_r"),
      alpha: numberField("lora_alpha"),
      dropout: numberField("lora_dropout"),
      target_modules: targetModules(),
      use_rslora: changedCheckbox("lora_use_rslora"),
    }),
  };
  if (uploaded.valid) body.validation_file = uploaded.valid.file.id;
  const suffix = document.getElementById("suffix").value.trim();
  if (suffix) body.suffix = suffix;
  const queue = document.getElementById("queue").value.trim();
  if (queue) body.queue = queue;
  const prompts = document.getElementById("eval_prompts").value.split("\n").map((p) => p.trim()).filter(Boolean);
  if (prompts.length) body.eval_prompts = prompts;
  return { ...body, ...advancedValues() };
}

// ---- the Advanced section, from the schema

// The schema of a field's values, without its null alternative.
function valueSchema(prop) {
  return (prop.anyOf || [prop]).find((b) => b.type !== "null" && !("const" in b)) || prop;
}

function bounds(b) {
  return { lo: b.minimum ?? b.exclusiveMinimum, hi: b.maximum ?? b.exclusiveMaximum };
}

// "[0, 1)": the range in interval notation, open where the bound is exclusive.
function rangeText(b) {
  const { lo, hi } = bounds(b);
  if (lo === undefined && hi === undefined) return "";
  const open = lo === undefined || b.exclusiveMinimum !== undefined ? "(" : "[";
  const close = hi === undefined || b.exclusiveMaximum !== undefined ? ")" : "]";
  return `${open}${lo ?? "−∞"}, ${hi ?? "∞"}${close}`;
}

// min/max only guide the spinner (the form has novalidate): the server's 400 is the check.
function setBounds(input, b) {
  const { lo, hi } = bounds(b);
  if (lo !== undefined) input.min = String(lo);
  else input.removeAttribute("min");
  if (hi !== undefined) input.max = String(hi);
  else input.removeAttribute("max");
}

// A control whose empty value means "the server's default"; null for a shape with no control here.
function advancedControl(name, prop) {
  const b = valueSchema(prop);
  const hint = "default" in prop ? `default: ${prop.default}` : "server default";
  const choices = b.type === "boolean" ? ["true", "false"] : b.enum;
  if (choices) {
    const options = [`<option value="">${loraq.esc(hint)}</option>`]
      .concat(choices.map((c) => `<option value="${loraq.esc(String(c))}">${loraq.esc(String(c))}</option>`));
    return `<select id="${loraq.esc(name)}" data-type="${b.type}">${options.join("")}</select>`;
  }
  if (b.type === "integer" || b.type === "number") {
    const step = b.type === "integer" ? "1" : "any";
    return `<input id="${loraq.esc(name)}" type="number" step="${step}" data-type="${b.type}" placeholder="${loraq.esc(hint)}">`;
  }
  return null;
}

function renderAdvanced(schemas) {
  const props = schemas.JobCreate.properties;
  const fields = [];
  for (const [name, prop] of Object.entries(props)) {
    if (NOT_ADVANCED.has(name)) continue;
    const control = advancedControl(name, prop);
    if (!control) continue;
    const range = rangeText(valueSchema(prop));
    const note = [range, prop.description || ""].filter(Boolean).join(" · ");
    fields.push(`<label data-field="${loraq.esc(name)}"><span>${loraq.esc(name)}</span>${control}<small class="muted">${loraq.esc(note)}</small></label>`);
    advanced.push(name);
  }
  document.getElementById("advancedfields").innerHTML = fields.join("");
  for (const name of advanced) {
    const el = document.getElementById(name);
    if (el.type === "number") setBounds(el, valueSchema(props[name]));
  }
}

// The controls above take their default (as the placeholder, or a checkbox's initial state), bounds
// and descriptions from the same schema. A default of null (the seed) keeps the page's placeholder,
// which says what the server does instead ("random").
function describeBasicFields(schemas) {
  for (const [id, [model, field]] of Object.entries(BASIC)) {
    const prop = (schemas[model] && schemas[model].properties[field]) || null;
    if (!prop) continue;
    const el = document.getElementById(id);
    const note = el.parentElement.querySelector("small");
    if (note && prop.description) note.textContent = prop.description;
    el.title = [rangeText(valueSchema(prop)), prop.description || ""].filter(Boolean).join(" · ");
    if (el.type === "checkbox") {
      el.dataset.default = String(prop.default === true);
      el.checked = prop.default === true;
      continue;
    }
    if (el.type === "number") setBounds(el, valueSchema(prop));
    if (prop.default === "auto") el.placeholder = "auto";
    else if (prop.default !== undefined && prop.default !== null) el.placeholder = `default: ${prop.default}`;
  }
}

async function loadSchema() {
  const resp = await fetch("/openapi.json"); // public: the schema holds no data
  if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
  const schemas = (await resp.json()).components.schemas;
  renderAdvanced(schemas);
  describeBasicFields(schemas);
  document.getElementById("advanced").dataset.loaded = "true";
}

// The Advanced fields that are set, typed as the schema says; empty ones are not sent.
function advancedValues() {
  const values = {};
  for (const name of advanced) {
    const el = document.getElementById(name);
    if (el.value === "") continue;
    const type = el.dataset.type;
    values[name] = type === "boolean" ? el.value === "true" : type === "string" ? el.value : Number(el.value);
  }
  return values;
}

// Dry run: what the job would do (steps, tokens, estimates, bad lines), nothing queued.
async function dryRun() {
  showError("");
  markInvalid(null);
  const btn = document.getElementById("dryrun");
  btn.disabled = true;
  try {
    const plan = await loraq.json("/v1/fine_tuning/jobs", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ ...jobBody(), dry_run: true }),
    });
    const t = plan.training;
    // per worker class: the memory plan's peak on its GPU and how (micro-batches, checkpointing),
    // the wall time from its benchmark (`basis`: scaled from another model's row); a figure that
    // cannot be had is left out and `unavailable` says why
    const est = plan.estimates.map((e) => `<span class="estimate" data-class="${loraq.esc(e.worker_class)}">` + [
      `${loraq.esc(e.worker_class)}:`,
      e.memory_plan ? `${loraq.num(e.peak_gpu_memory_gib, 3)} GiB peak <span class="muted">(${loraq.esc(e.memory_plan.plan)})</span>` : "",
      e.wall_seconds !== null ? loraq.duration(e.wall_seconds) : "",
      e.basis ? `<span class="muted">(${loraq.esc(e.basis)})</span>` : "",
      e.unavailable ? `<span class="muted">${loraq.esc(e.unavailable)}</span>` : "",
    ].filter(Boolean).join(" ") + "</span>").join("<br>");
    document.getElementById("plankv").innerHTML = [
      ["Valid", plan.valid ? "yes" : "no"],
      ["Examples", `${loraq.int(t.examples)} trained, ${loraq.int(t.held_out_examples)} held out for validation`],
      ["Tokens", `${loraq.int(t.tokens)} (${loraq.int(t.trainable_tokens)} trainable) in ${loraq.int(t.rows)} rows`],
      ["Epochs", `<span id="planepochs">${plan.hyperparameters.n_epochs}</span>`],
      ["Batch size", `${plan.hyperparameters.batch_size} × ${plan.grad_accum} accumulated`],
      ["Learning rate multiplier", loraq.esc(plan.hyperparameters.learning_rate_multiplier)],
      ["Rows", `${plan.max_seq_len} tokens at most, ${plan.packing ? "packed" : "one example each"}`],
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
    markInvalid(e.param);
  } finally {
    btn.disabled = false;
  }
}

async function submit(ev) {
  ev.preventDefault();
  showError("");
  markInvalid(null);
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
    markInvalid(e.param);
    btn.disabled = false;
  }
}

// The base the job trains: a Hugging Face Hub id typed in (owner/name), else the model picked.
function typedHubModel() {
  return document.getElementById("hub_model").value.trim();
}

function chosenModel() {
  return typedHubModel() || document.getElementById("model").value;
}

// Random-init models (tests, benchmarks) and models not downloaded yet are labelled as such (the
// option's value stays the bare name). A model that is not local is downloaded by its first job
// only where the server pulls on first use (`auto_pull`, LORAQ_AUTO_PULL); else the job is refused.
function modelLabel(m) {
  const pull = m.auto_pull === false ? "not local: run `loraq models pull` first" : "not local: downloaded on first use";
  return [
    modelShape(m),
    m.use === "tests" ? "random weights, tests only" : m.random ? "random weights" : "",
    m.local ? "local" : pull,
  ].filter(Boolean).join("; ");
}

// What a user picks a base by: "Qwen3, 0.6B parameters, context 40960" (the parts /v1/models knows).
function modelShape(m) {
  return [
    m.family,
    m.parameters ? `${humanCount(m.parameters)} parameters` : "",
    m.context_length ? `context ${m.context_length}` : "",
  ].filter(Boolean).join(", ");
}

// 134515008 -> "135M", as `loraq models list` writes it (three significant digits)
function humanCount(n) {
  for (const [scale, suffix] of [[1e9, "B"], [1e6, "M"], [1e3, "K"]]) {
    if (n >= scale) return `${Number((n / scale).toPrecision(3))}${suffix}`;
  }
  return String(n);
}

// The precision the job would train in: the Advanced section's quantization, unset = bf16.
function chosenPrecision() {
  const q = document.getElementById("quantization");
  return (q && q.value) || "bf16";
}

// Under the model: the smallest common GPU its default job trains on in the chosen precision, and
// in the others (/v1/models min_gpu: the worker's memory plan, service/gpu_fit.py).
function showMinGpu() {
  const el = document.getElementById("mingpu");
  const m = models[chosenModel()];
  const precision = chosenPrecision();
  const found = m && m.min_gpu ? m.min_gpu[precision] : undefined;
  el.dataset.precision = precision;
  el.dataset.memoryGb = found && found.memory_gb !== null ? String(found.memory_gb) : "";
  if (!m || !m.min_gpu) {
    el.textContent = m || !chosenModel() ? "" : "smallest GPU: known once its config.json is fetched (a submit or dry run)";
    return;
  }
  if (!found) {
    el.textContent = `${precision}: only for a GGUF base`;
    return;
  }
  const peak = `predicted peak ${loraq.num(found.plan.predicted_peak_gib, 3)} GiB`;
  const how = found.plan.activation_checkpointing === "none" ? "" : `, ${found.plan.activation_checkpointing} activation checkpointing`;
  const others = Object.entries(m.min_gpu).filter(([p]) => p !== precision)
    .map(([p, f]) => `${p}: ${f.memory_gb === null ? "none" : `${f.memory_gb} GB`}`).join(", ");
  el.textContent = `Smallest GPU in ${precision} (default settings): ${found.gpu}, ${peak}${how}. `
    + `Other precisions (Advanced › quantization): ${others}`;
}

async function loadModels() {
  const body = await loraq.json("/v1/models");
  const select = document.getElementById("model");
  // Base models first; fine-tuned ones ("ft:...") cannot be fine-tuned again.
  const base = body.data.filter((m) => !m.id.startsWith("ft:"));
  for (const m of base) models[m.id] = m;
  const names = base.map((m) => m.id);
  const option = (m) => `<option value="${loraq.esc(m.id)}" title="${loraq.esc(m.warning || m.description || "")}">${loraq.esc(m.id)}${modelLabel(m) ? ` (${modelLabel(m)})` : ""}</option>`;
  // Real bases apart from the random-weight presets, which only tests and benchmarks want.
  const group = (label, models) => models.length ? `<optgroup label="${label}">${models.map(option).join("")}</optgroup>` : "";
  select.innerHTML = group("Base models", base.filter((m) => !m.random))
    + group("Random weights: tests and benchmarks only", base.filter((m) => m.random));
  // The real pretrained model by default: a first job on random weights teaches nothing.
  if (names.includes(DEFAULT_MODEL)) select.value = DEFAULT_MODEL;
  showMinGpu();
}

document.addEventListener("DOMContentLoaded", () => {
  loadModels().catch((e) => showError(`Could not list models: ${e.message}`));
  loadSchema().catch((e) => showError(`Could not load the training fields' schema: ${e.message}`));
  document.getElementById("trainfile").onchange = (ev) => uploadAndCheck("train", ev.target);
  document.getElementById("validfile").onchange = (ev) => uploadAndCheck("valid", ev.target);
  document.getElementById("newjob").onsubmit = submit;
  document.getElementById("dryrun").onclick = dryRun;
  // the model, a Hub id typed in, or the precision (rendered with the Advanced fields) changed
  document.getElementById("model").addEventListener("change", showMinGpu);
  document.getElementById("hub_model").addEventListener("input", showMinGpu);
  document.getElementById("advancedfields").addEventListener("change", (ev) => {
    if (ev.target.id === "quantization") showMinGpu();
  });
});
