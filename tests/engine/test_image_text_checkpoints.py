"""Image-text checkpoints (Gemma 3 4B+, Mistral 3, LLaVA, Qwen2.5-VL, Qwen3-VL) served as their language model
(:mod:`qworker.model.wrappers`): greedy outputs token for token against transformers' own
image-text model given the same text-only prompts, in both of transformers' naming forms; a
PEFT adapter trained on the image-text model (its vision tower adapted too) against PEFT; and
the refusals."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from qworker import LLM, SamplingParams
from qworker.model.loader import load_config, load_state_dict
from qworker.model.lora.adapter import MODULES, LoRAAdapterError, load_lora_adapter
from tests.engine.family_models import IMAGE_TEXT, IMAGE_TEXT_CONFIGS, build_image_text_model
from tests.engine.hf_reference import Reference, assert_greedy_matches

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def image_text_models(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("image-text")
    return {mt: build_image_text_model(mt, root / mt, model_dir) for mt in IMAGE_TEXT}


def prompts(seed: str) -> list[list[int]]:
    """A short prompt and two past every test window (24-40)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in (rng.randrange(3, 12), 50 + rng.randrange(20), 100 + rng.randrange(40))]


def hf_greedy(model, prompt: list[int], n: int = MAX_TOKENS) -> Reference:
    """transformers' greedy continuation of a text-only prompt with its top-2 gaps."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    gaps = [(lambda top: (top[0] - top[1]).item())(torch.log_softmax(s[0].float(), -1).topk(2).values) for s in out.logits]
    return Reference(out.sequences[0, len(prompt):].tolist(), gaps)


def eager_image_text(path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if model.config.model_type == "llama4":
        # its generate fails on a text-only prompt (transformers 5.24 reads image outputs it never
        # made); the loaded wrapper's own language model is what a text-only prompt runs
        model = model.language_model
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("model_type", IMAGE_TEXT)
def test_the_language_model_matches_transformers_image_text_model(image_text_models, model_type):
    path = image_text_models[model_type]
    config = load_config(path)
    text = IMAGE_TEXT_CONFIGS[model_type][0]
    assert config.model_type == (text if isinstance(text, str) else text["model_type"]) and config.wrapped_by == model_type
    ps = prompts(model_type)
    outs = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=16).generate(ps, greedy())
    reference = eager_image_text(path)
    for p, o in zip(ps, outs):
        assert_greedy_matches(o.outputs[0].token_ids, hf_greedy(reference, p), f"{model_type}, prompt of {len(p)}")


@pytest.mark.parametrize("model_type", IMAGE_TEXT)
def test_both_naming_forms_load_the_same_language_model_and_no_image_part(image_text_models, model_type, model_dir, tmp_path):
    """transformers 4's names (``language_model.model.*``, as saved) and transformers 5's
    (``model.language_model.*``) give the same tensors under the causal-LM names."""
    saved = load_state_dict(image_text_models[model_type], torch.device("cpu"), torch.float32)
    v5 = build_image_text_model(model_type, tmp_path / "v5", model_dir, save_original_format=False)
    other = load_state_dict(v5, torch.device("cpu"), torch.float32)
    assert sorted(saved) == sorted(other)
    assert all(torch.equal(saved[n], other[n]) for n in saved)
    assert all(n.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")) for n in saved), sorted(saved)[:5]
    untied = IMAGE_TEXT_CONFIGS[model_type][1].get("tie_word_embeddings") is False
    assert ("lm_head.weight" in saved) == untied


def test_a_stray_or_doubled_tensor_in_an_image_text_checkpoint_is_refused(image_text_models, tmp_path):
    src = image_text_models["gemma3"]
    weights = load_file(src / "model.safetensors")
    for case, extra in (("stray", {"language_model.model.layers.0.mlp.extra.weight": torch.ones(2)}),
                        ("doubled", {"model.language_model.norm.weight": weights["language_model.model.norm.weight"].clone()})):
        out = tmp_path / case
        out.mkdir()
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes((src / name).read_bytes())
        save_file({**weights, **extra}, out / "model.safetensors")
        with pytest.raises(ValueError) as err:
            LLM(str(out), dtype="float32", kv_cache_memory=8 << 20, block_size=16)
        assert ("model.layers.0.mlp.extra.weight" if case == "stray" else "stored twice") in str(err.value)


def test_an_image_text_checkpoint_around_an_unsupported_language_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "text_config": {"model_type": "bloom"}}))
    with pytest.raises(ValueError, match="unsupported model type 'bloom' \\(the language model of this llava checkpoint\\)"):
        load_config(tmp_path)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_a_peft_adapter_of_the_image_text_model_matches_peft(image_text_models, tmp_path, targets):
    """An adapter PEFT trained on the image-text model: ``q_proj``/``v_proj`` adapt the vision
    tower too (skipped: a text-only prompt never runs it), the language model's layers are named
    under ``model.language_model``. Served as PEFT serves the text-only prompt. "all-linear"
    (helper-91: refused for the vision tower's fc1/fc2/out_proj it lists) adapts every linear."""
    from peft import LoraConfig, get_peft_model

    from qworker import LoRARequest

    path = image_text_models["gemma3"]
    torch.manual_seed(3)
    peft_model = get_peft_model(eager_image_text(path), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(str(adapter))
    names = list(load_file(adapter / "adapter_model.safetensors"))
    assert any("vision_tower" in n for n in names) and any(".language_model.layers." in n for n in names), names[:4]
    config = load_config(path)
    loaded = load_lora_adapter(adapter, config, max_rank=8)
    modules = ("q_proj", "v_proj") if isinstance(targets, list) else MODULES
    assert sorted(loaded.weights) == sorted((i, m) for i in range(config.num_hidden_layers) for m in modules)

    ps = prompts("gemma3-lora")
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=16, enable_lora=True, max_lora_rank=8)
    outs = llm.generate(ps, greedy(), lora_request=LoRARequest("a", 1, str(adapter)))
    base = llm.generate(ps, greedy())
    peft_model.eval()
    for p, o, b in zip(ps, outs, base):
        ref = hf_greedy(peft_model, p)
        assert_greedy_matches(o.outputs[0].token_ids, ref, f"adapter, prompt of {len(p)}")
        assert o.outputs[0].token_ids != b.outputs[0].token_ids or len(p) < 12  # the adapter changes the long prompts' outputs


def test_an_adapter_naming_a_layer_twice_is_refused(image_text_models, tmp_path):
    """One weight under both of a wrapper's prefixes: which would be served is not the file's to leave open."""
    from tests.engine.lora_support import make_peft_adapter

    path = image_text_models["gemma3"]
    adapter = make_peft_adapter(_text_model(path, tmp_path), tmp_path / "adapter", rank=4, target_modules=["q_proj"], seed=1)
    tensors = load_file(adapter / "adapter_model.safetensors")
    doubled = {n.replace("base_model.model.model.", "base_model.model.model.language_model."): t.clone() for n, t in tensors.items()}
    save_file({**tensors, **doubled}, adapter / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="are the same LoRA weight"):
        load_lora_adapter(adapter, load_config(path), max_rank=8)
    save_file(doubled, adapter / "adapter_model.safetensors")  # one form alone loads
    assert len(load_lora_adapter(adapter, load_config(path), max_rank=8).weights) == 3


def _text_model(path, tmp_path):
    """A folder whose config is the wrapper's language model alone (PEFT's template for it)."""
    out = tmp_path / "text"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(load_config(path).to_dict()))
    return out


def test_rank_patterns_match_the_names_the_adapter_was_trained_under(image_text_models, tmp_path):
    """An adapter saved under transformers 4's names (``language_model.model.layers``): its
    ``rank_pattern`` keys are those names, so the module keys follow the tensors' own prefix
    (helper-91: they were always matched as ``model.language_model``)."""
    from tests.engine.lora_support import make_peft_adapter

    path = image_text_models["gemma3"]
    adapter = make_peft_adapter(_text_model(path, tmp_path), tmp_path / "adapter", rank=4, target_modules=["q_proj"], seed=2,
                                rank_pattern={"model.layers.1.self_attn.q_proj": 2})
    tensors = load_file(adapter / "adapter_model.safetensors")
    renamed = {n.replace("base_model.model.model.", "base_model.model.language_model.model."): t for n, t in tensors.items()}
    save_file(renamed, adapter / "adapter_model.safetensors")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {"language_model.model.layers.1.self_attn.q_proj": 2}
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    loaded = load_lora_adapter(adapter, load_config(path), max_rank=8)
    assert [loaded.weights[i, "q_proj"][0].shape[0] for i in range(3)] == [4, 2, 4]


@pytest.mark.parametrize("model_type,tied", [("qwen2_5_vl", False), ("qwen3_vl", False), ("gemma3", True)])
def test_a_config_without_tie_flags_takes_the_models_default(model_type, tied):
    """Neither config level says (helper-92: Qwen-VL's text config has no such field, and reading it
    raised AttributeError): the text model's default, else the wrapper's."""
    from transformers import AutoConfig

    from qworker.model.wrappers import text_config

    assert text_config(AutoConfig.for_model(model_type), {}).tie_word_embeddings is tied


@pytest.mark.parametrize("wrapper,family", [("mistral3", "falcon"), ("mistral3", "falcon_7b"), ("mistral3", "phimoe")])  # untied: as transformers runs them
def test_other_language_models_inside_a_wrapper(wrapper, family, model_dir, tmp_path):
    """helper-106: Falcon's own tensor names inside a wrapper were not renamed (refused as missing
    model.embed_tokens), and a text config's lm_head_bias was required of the wrapper's head, which
    transformers builds without one."""
    path = build_image_text_model(wrapper, tmp_path / wrapper, model_dir, text_family=family)
    ps = prompts(f"{wrapper}-{family}")
    outs = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=16).generate(ps, greedy())
    reference = eager_image_text(path)
    for p, o in zip(ps, outs):
        assert_greedy_matches(o.outputs[0].token_ids, hf_greedy(reference, p), f"{wrapper} around {family}, prompt of {len(p)}")
