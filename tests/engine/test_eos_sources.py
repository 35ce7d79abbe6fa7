"""Where a model's end-of-sequence ids come from, as transformers' generate reads them:
``generation_config.json``, else config.json's ``eos_token_id`` (a folder without a generation
config is common); a malformed generation config or an id outside the vocabulary is refused at
start-up in one line naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from qworker.engine.llm import LLM
from qworker.engine.sampling_params import SamplingParams
from tests.engine.family_models import VOCAB, build_family_model

PROMPT = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir) -> Path:
    out = build_family_model("llama", tmp_path_factory.mktemp("eos") / "llama", Path(model_dir), seed=3)
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def _copy(src: Path, dst: Path, config: dict | None = None, generation: str | None = None) -> Path:
    shutil.copytree(src, dst)
    if config:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}))
    if generation is not None:
        (dst / "generation_config.json").write_text(generation)
    return dst


def _greedy(path: Path, n: int = 12) -> tuple[list[int], str]:
    out = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=n))[0].outputs[0]
    return list(out.token_ids), out.finish_reason


def _hf_greedy(path: Path, n: int = 12) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return model.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("as_list", [False, True])
def test_an_eos_in_config_json_alone_ends_the_job_as_in_transformers(tiny, tmp_path, as_list):
    free, _ = _greedy(tiny)
    eos = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # a token first emitted at step 3 or later
    path = _copy(tiny, tmp_path / "m", config={"eos_token_id": [7, eos] if as_list else eos})
    tokens, reason = _greedy(path)
    assert tokens == free[:free.index(eos) + 1] and reason == "stop"
    assert tokens == _hf_greedy(path)


def test_the_generation_config_wins_over_config_json(tiny, tmp_path):
    free, _ = _greedy(tiny)
    late = next(t for i, t in enumerate(free) if i >= 4 and t not in free[:i])
    path = _copy(tiny, tmp_path / "m", config={"eos_token_id": free[0]}, generation=json.dumps({"eos_token_id": late}))
    tokens, _ = _greedy(path)
    assert tokens == free[:free.index(late) + 1] == _hf_greedy(path)


@pytest.mark.parametrize("text,why", [('{"eos_token_id": "2"}', "eos_token_id '2'"), ("null", "not a JSON object"),
                                      ("{not json", "not JSON"), ('{"eos_token_id": -1}', "eos_token_id -1"),
                                      (json.dumps({"eos_token_id": [2, VOCAB]}), f"eos_token_id {VOCAB}"),
                                      ('{"eos_token_id": true}', "eos_token_id True")])
def test_a_malformed_generation_config_is_refused_naming_the_file(tiny, tmp_path, text, why):
    path = _copy(tiny, tmp_path / "m", generation=text)
    with pytest.raises(ValueError, match="generation_config.json") as err:
        LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    assert why in str(err.value)
