"""LoRA test helpers: random PEFT adapters for a base model (made with ``peft``, B non-zero so that
outputs really move) and the HF/PEFT reference outputs they are checked against.

The reference keeps one fp32 HF model per base folder, wrapped once in a ``PeftModel`` that loads
each adapter folder under its own name; base-model references run with the adapters disabled.
Several sequences under different adapters can be checked in one forward (PEFT's mixed-adapter
batch, ``adapter_names``): right-padded and masked, so a causal model's rows for real tokens never
see the padding.

Adapters are made once per process for a given recipe (base folder, rank, targets, seed, alpha,
rsLoRA, ...): a repeat request copies the first one's files into the new folder.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from tests.engine.hf_reference import TIE_GAP, Reference

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_model_dir, out_dir, *, rank: int, target_modules, seed: int, alpha: float = 16,
                      use_rslora: bool = False, b_std: float = 0.15, rank_pattern: dict | None = None,
                      alpha_pattern: dict | None = None) -> Path:
    """Saves a random LoRA adapter for ``base_model_dir`` in ``out_dir`` (PEFT's own files) and
    returns ``out_dir``. A is PEFT's initialisation, B is ``randn * b_std`` (PEFT's zeros would
    leave the model unchanged); both from ``seed``. The same recipe twice gives the same files (the
    first ones, copied: callers may edit their copy)."""
    recipe = json.dumps([str(Path(base_model_dir).resolve()), rank, sorted(target_modules), seed, alpha, use_rslora, b_std,
                         rank_pattern or {}, alpha_pattern or {}], sort_keys=True)
    made = _made.get(recipe)
    if made is None:
        global _made_root
        if _made_root is None:  # removed when the process exits
            _made_root = tempfile.TemporaryDirectory(prefix="lora-adapters-")
        made = Path(_made_root.name) / str(len(_made))
        _make_peft_adapter(base_model_dir, made, rank=rank, target_modules=target_modules, seed=seed, alpha=alpha,
                           use_rslora=use_rslora, b_std=b_std, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
        _made[recipe] = made
    out = Path(out_dir)
    shutil.copytree(made, out, dirs_exist_ok=True)
    return out


_made: dict[str, Path] = {}  # recipe -> the adapter's files, made once per process
_made_root: tempfile.TemporaryDirectory | None = None


def _make_peft_adapter(base_model_dir, out_dir, *, rank, target_modules, seed, alpha, use_rslora, b_std, rank_pattern,
                       alpha_pattern) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    key = str(Path(base_model_dir).resolve())
    model = _templates.get(key)
    if model is None:  # one base model per folder, restored after each adapter (unload)
        model = _templates[key] = _template(key)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                     lora_dropout=0.0, rank_pattern=rank_pattern or {}, alpha_pattern=alpha_pattern or {})
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    peft_model.save_pretrained(str(out_dir))
    restored = peft_model.unload()
    assert restored is model
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in vars(model):
            delattr(model, attr)


_templates: dict[str, object] = {}


def _template(model_dir: str):
    """The base model's modules, built from its config with uninitialised weights: an adapter only
    needs their names and shapes (PEFT's A initialisation and our B never read the base weights),
    so the checkpoint is not read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to_empty(device="cpu").eval()


def edit_adapter_config(adapter_dir, **changes) -> None:
    """Rewrites fields of ``adapter_config.json`` (a value of ``...`` deletes the field)."""
    path = Path(adapter_dir) / "adapter_config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


_references: dict[str, dict] = {}


def _reference_model(base_model_dir, adapter_dir):
    """(model, context manager factory) for the base model, or the PEFT model with the adapter set."""
    import contextlib

    from transformers import AutoModelForCausalLM

    key = str(Path(base_model_dir).resolve())
    ref = _references.get(key)
    if ref is None:
        # eager attention: what the family tests compare with (sdpa has no soft-capping)
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32, attn_implementation="eager").eval()
        # EOS neither stops nor is suppressed, like the engine's ignore_eos
        model.generation_config.eos_token_id = None
        ref = _references[key] = {"model": model, "peft": None, "names": {}}
    if adapter_dir is None:
        if ref["peft"] is None:
            return ref["model"], contextlib.nullcontext
        return ref["peft"], ref["peft"].disable_adapter
    name = _adapter_name(ref, adapter_dir)  # first: it makes ref["peft"] on the first adapter
    ref["peft"].set_adapter(name)
    return ref["peft"], contextlib.nullcontext


def _adapter_name(ref: dict, adapter_dir) -> str:
    """The PEFT model's name for ``adapter_dir``, loading it (and wrapping the model) the first time."""
    from peft import PeftModel

    adapter_key = str(Path(adapter_dir).resolve())
    name = ref["names"].get(adapter_key)
    if name is None:
        name = ref["names"][adapter_key] = f"a{len(ref['names'])}"
        if ref["peft"] is None:
            ref["peft"] = PeftModel.from_pretrained(ref["model"], adapter_key, adapter_name=name).eval()
        else:
            ref["peft"].load_adapter(adapter_key, adapter_name=name)
    return name


def peft_logits(base_model_dir, adapter_dir, token_ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[len(token_ids), vocab]`` of one sequence under the adapter (None: base)."""
    model, ctx = _reference_model(base_model_dir, adapter_dir)
    with torch.inference_mode(), ctx():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


def peft_logits_many(base_model_dir, items) -> list[torch.Tensor]:
    """fp32 logits ``[len(token_ids), vocab]`` of each ``(adapter_dir or None, token_ids)`` in
    ``items``, all in one forward: PEFT's mixed-adapter batch (``adapter_names``, the base model's
    rows as ``__base__``), sequences right-padded under an attention mask (rows of real tokens
    attend to real tokens only, at their own positions)."""
    items = [(adapter, list(ids)) for adapter, ids in items]
    _reference_model(base_model_dir, None)  # the base model, loaded once
    ref = _references[str(Path(base_model_dir).resolve())]
    names = [_adapter_name(ref, adapter) if adapter is not None else "__base__" for adapter, _ in items]
    width = max(len(ids) for _, ids in items)
    input_ids = torch.zeros(len(items), width, dtype=torch.long)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for i, (_, ids) in enumerate(items):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
    kw = {} if ref["peft"] is None else {"adapter_names": names}
    model = ref["model"] if ref["peft"] is None else ref["peft"]
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=mask, **kw).logits.float()
    return [logits[i, :len(ids)] for i, (_, ids) in enumerate(items)]


def peft_reference(base_model_dir, adapter_dir, prompt_token_ids: list[int], max_tokens: int) -> Reference:
    """Greedy tokens and per-position top-2 logprob gaps (for the tie-aware comparison)."""
    model, ctx = _reference_model(base_model_dir, adapter_dir)
    ids = list(prompt_token_ids)
    with torch.inference_mode(), ctx():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(ids):].tolist()
    gaps = []
    for scores in out.logits:
        top = torch.log_softmax(scores[0].float(), -1).topk(2).values
        gaps.append((top[0] - top[1]).item())
    return Reference(tokens, gaps)


def peft_greedy(base_model_dir, adapter_dir_or_none, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """HF/PEFT's greedy continuation (fp32, ``do_sample=False``, EOS not stopping)."""
    return peft_reference(base_model_dir, adapter_dir_or_none, prompt_token_ids, max_tokens).token_ids


def assert_peft_greedy(base_model_dir, adapter_dir, prompt_token_ids: list[int], tokens: list[int], what: str = "") -> None:
    """``tokens`` are PEFT's greedy continuation of the prompt, checked teacher-forced in one
    forward: at every position PEFT's argmax given the prompt and ``tokens`` before it is the
    token (or ties with it within float noise, :data:`TIE_GAP` in logprob). Equivalent to
    comparing with :func:`peft_greedy` token for token (stricter after a tie: later positions are
    still checked), at the cost of one forward instead of one per token."""
    prompt = list(prompt_token_ids)
    logits = peft_logits(base_model_dir, adapter_dir, prompt + list(tokens[:-1]))
    _assert_greedy_rows(logits[len(prompt) - 1:], tokens, what)


def assert_peft_greedy_many(base_model_dir, cases) -> None:
    """:func:`assert_peft_greedy` for each ``(adapter_dir or None, prompt_token_ids, tokens, what)``
    in ``cases``, all teacher-forced in one mixed-adapter forward (:func:`peft_logits_many`)."""
    cases = [(adapter, list(prompt), list(tokens), what) for adapter, prompt, tokens, what in cases]
    logits = peft_logits_many(base_model_dir, [(adapter, prompt + tokens[:-1]) for adapter, prompt, tokens, _ in cases])
    for rows, (_, prompt, tokens, what) in zip(logits, cases):
        _assert_greedy_rows(rows[len(prompt) - 1:], tokens, what)


def _assert_greedy_rows(logits: torch.Tensor, tokens: list[int], what: str) -> None:
    for i, (tok, row) in enumerate(zip(tokens, logits)):
        logp = torch.log_softmax(row, -1)
        top = int(logp.argmax())
        gap = (logp[top] - logp[tok]).item()
        assert top == tok or gap < TIE_GAP, f"{what}: token {i} is {tok}, PEFT's greedy choice is {top} (logprob gap {gap:.4f})"
