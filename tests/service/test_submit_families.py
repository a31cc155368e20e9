"""At submit, a job is checked against its base model's family (worker/engine/families.py): the
architecture a local directory names now, and `lora.target_modules` against that family's layer
names (Phi-3 fuses q/k/v and gate/up, so a job asking for q_proj would fail in the worker)."""

from __future__ import annotations

import json
from pathlib import Path

from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, job_body
from tests.engine.tiny_families import save_tiny_family
from worker.engine.catalog import register_local_model
from worker.engine.families import SUPPORTED_ARCHITECTURES


def refused(r: object, param: str, code: str) -> str:
    assert r.status_code == 400, r.text  # type: ignore[attr-defined]
    err = r.json()["error"]  # type: ignore[attr-defined]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    message: str = err["message"]
    return message


def test_phi3_targets_are_its_fused_layers(api: ApiClient, tmp_path: Path) -> None:
    directory = save_tiny_family("Phi3ForCausalLM", tmp_path / "phi")
    register_local_model("my-phi", directory, get_settings().model_store)
    file_id = api.upload(DATASET)
    split = job_body(file_id, model="my-phi", lora={"r": 4, "target_modules": ["q_proj", "o_proj"]})
    message = refused(
        api.post("/v1/fine_tuning/jobs", json=split), "lora.target_modules", "invalid_target_modules"
    )
    assert "'q_proj' is not a linear layer of model 'my-phi' (Phi3ForCausalLM)" in message
    assert "self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj, mlp.down_proj" in message
    assert message.endswith("Phi-3 fuses q_proj/k_proj/v_proj into one layer, qkv_proj")
    fused = job_body(
        file_id, model="my-phi", lora={"r": 4, "target_modules": ["self_attn.qkv_proj", "gate_up_proj"]}
    )
    assert api.post("/v1/fine_tuning/jobs", json=fused).status_code == 200
    # Llama's split names stay right for a Llama base
    llama = job_body(file_id, lora={"r": 4, "target_modules": ["q_proj", "up_proj"]})
    assert api.post("/v1/fine_tuning/jobs", json=llama).status_code == 200


def test_a_directory_changed_to_an_unsupported_architecture_is_refused(
    api: ApiClient, tmp_path: Path
) -> None:
    directory = save_tiny_family("Qwen3ForCausalLM", tmp_path / "qwen")
    register_local_model("my-qwen", directory, get_settings().model_store)
    file_id = api.upload(DATASET)
    assert api.post("/v1/fine_tuning/jobs", json=job_body(file_id, model="my-qwen")).status_code == 200
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3MoeForCausalLM"]}))
    for dry_run in (False, True):
        body = job_body(file_id, model="my-qwen", dry_run=dry_run)
        message = refused(api.post("/v1/fine_tuning/jobs", json=body), "model", "unsupported_model")
        assert (
            "unsupported architecture ['Qwen3MoeForCausalLM'] in the config.json of model 'my-qwen'"
            in message
        )
        assert message.endswith("supported: " + ", ".join(SUPPORTED_ARCHITECTURES))
        assert str(tmp_path) not in message  # no path of the server's disk


def test_a_directory_gone_since_models_add_is_what_it_was_before(api: ApiClient, tmp_path: Path) -> None:
    """Not local: accepted with auto-pull (the worker then fails naming the directory), as before
    families; its target modules cannot be checked, and no 500 comes of trying."""
    directory = save_tiny_family("Phi3ForCausalLM", tmp_path / "gone")
    register_local_model("gone-phi", directory, get_settings().model_store)
    for file in directory.iterdir():
        file.unlink()
    directory.rmdir()
    body = job_body(api.upload(DATASET), model="gone-phi", lora={"r": 4, "target_modules": ["q_proj"]})
    assert api.post("/v1/fine_tuning/jobs", json=body).status_code == 200


def test_a_multimodal_gemma3_submits_as_its_language_model(api: ApiClient, tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration directory (Gemma 3 4B and up as the Hub ships them) is
    accepted as its language model: its layer names are checked as Gemma 3's, and a layer of the
    vision tower (SigLIP's out_proj) is no target."""
    from tests.engine.test_multimodal_text import build_multimodal

    directory = build_multimodal(tmp_path / "gemma3-mm")
    register_local_model("my-gemma", directory, get_settings().model_store)
    file_id = api.upload(DATASET)
    ok = job_body(file_id, model="my-gemma", lora={"r": 4, "target_modules": ["q_proj", "down_proj"]})
    assert api.post("/v1/fine_tuning/jobs", json=ok).status_code == 200
    vision = job_body(file_id, model="my-gemma", lora={"r": 4, "target_modules": ["out_proj"]})
    message = refused(
        api.post("/v1/fine_tuning/jobs", json=vision), "lora.target_modules", "invalid_target_modules"
    )
    assert "'out_proj' is not a linear layer of model 'my-gemma' (Gemma3ForCausalLM)" in message
    assert "its linear layers are self_attn.q_proj, self_attn.k_proj" in message
