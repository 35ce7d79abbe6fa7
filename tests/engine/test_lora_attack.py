"""Attacks on LoRA serving, each a regression test of a defect found by reproducing it on the
tiny model (2 layers, random weights; the PEFT reference is one HF forward of it).

- An adapter id dropped from the CPU cache while its weights still sat in a device slot: the id
  came back under another folder (vLLM's remove/add under one id) and the step ran the old
  folder's weights from the slot.
- Hostile adapter folders that made the loader raise something other than its own error (a
  symlink loop, JSON nested past Python's recursion limit): ``add_lora`` / ``LLM.generate`` must
  refuse them as ``invalid_lora`` like any other bad folder.
"""

from __future__ import annotations

import os
import shutil

import pytest

from qworker.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from qworker.engine.errors import InvalidRequestError
from qworker.model.lora.stack import ProjectionSlots
from tests.engine.lora_support import ALL_MODULES, assert_peft_greedy, make_peft_adapter

BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k,v) * block * kv_heads * head_dim * fp32
PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("attack-loras")
    return [make_peft_adapter(tiny_model_dir, root / f"x{i}", rank=4, seed=70 + i, target_modules=ALL_MODULES, b_std=0.5)
            for i in range(3)]


def make_engine(tiny_model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 128 * BLOCK_BYTES_TINY)
    kw.setdefault("max_loras", 2)
    kw.setdefault("max_cpu_loras", 2)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", enable_lora=True,
                                  max_lora_rank=8, scheduling_policy="fcfs", **kw))


def generate(engine: LLMEngine, rid: str, lora: LoRARequest | None, n: int = 6) -> list[int]:
    req = engine.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), lora_request=lora)
    while engine.has_unfinished():
        engine.step()
    assert req.seqs[0].finish_reason == "length", req.error
    return list(req.seqs[0].output_token_ids)


def test_an_id_evicted_from_the_cache_never_serves_its_old_slot(tiny_model_dir, folders):
    engine = make_engine(tiny_model_dir)
    old = generate(engine, "old", LoRARequest("old", 1, str(folders[0])))  # id 1 -> a slot
    generate(engine, "other", LoRARequest("other", 2, str(folders[1])))
    engine.add_lora(LoRARequest("third", 3, str(folders[2])))  # the cache (2) drops id 1, its slot kept it
    assert 1 not in engine.list_loras()
    new = generate(engine, "new", LoRARequest("new", 1, str(folders[2])))  # id 1, another folder
    assert new != old
    assert_peft_greedy(tiny_model_dir, folders[2], PROMPT, new, "id 1 reused for another folder")


def _clone(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_hostile_folders_are_refused_as_invalid_lora(tiny_model_dir, folders, tmp_path):
    loop = _clone(folders[0], tmp_path / "loop")
    os.symlink(loop / "b", loop / "a")
    os.symlink(loop / "a", loop / "b")
    deep_config = _clone(folders[0], tmp_path / "deep-config")
    (deep_config / "adapter_config.json").write_text("[" * 200_000 + "]" * 200_000)
    deep_header = _clone(folders[0], tmp_path / "deep-header")
    header = b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (deep_header / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    engine = make_engine(tiny_model_dir)
    for i, folder in enumerate((loop, deep_config, deep_header)):
        with pytest.raises(InvalidRequestError) as err:
            engine.add_lora(LoRARequest(folder.name, 10 + i, str(folder)))
        assert err.value.code == "invalid_lora" and folder.name in str(err.value)
    assert engine.list_loras() == set()


def test_a_slot_write_that_fails_halfway_is_never_served(tiny_model_dir, folders, monkeypatch):
    """A slot write that raises after some layers were written (on a GPU: out of memory growing a
    padded stack) left the slot mapped to its previous adapter, whose next request then ran on
    half of the other adapter's weights. The failure is injected (one projection's write raises
    once): an allocation failure cannot be provoked here."""
    engine = make_engine(tiny_model_dir, max_loras=1, max_cpu_loras=2)
    a, b = LoRARequest("a", 1, str(folders[0])), LoRARequest("b", 2, str(folders[1]))
    before = generate(engine, "a1", a)
    target = engine.runner.lora.slots[1]["qkv"]  # layer 1: layer 0 is written before it
    write = ProjectionSlots.set
    calls = []

    def failing_set(self, slot, pairs):
        if self is target:
            calls.append(slot)
            if len(calls) == 1:
                raise RuntimeError("injected: out of memory writing a LoRA slot")
        write(self, slot, pairs)

    monkeypatch.setattr(ProjectionSlots, "set", failing_set)
    req = engine.add_request("b1", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), lora_request=b)
    while engine.has_unfinished():
        engine.step()
    # the step of b alone failed once: b ran again alone, on a slot written whole
    assert len(calls) >= 2 and req.error is None
    assert generate(engine, "a2", a) == before
    assert generate(engine, "b2", b, n=3) == list(req.seqs[0].output_token_ids)
    assert generate(engine, "b2b", b) != before
    assert_peft_greedy(tiny_model_dir, folders[1], PROMPT, generate(engine, "b3", b), "b after the failed write")


def test_an_adapter_that_overflows_never_reaches_other_requests_rows(tiny_model_dir, folders, tmp_path):
    """Finite weights (so the loader takes them) that overflow the activations to Inf/NaN: the
    CPU path's batched decode padded every slot's rows with row 0 and zeroed the padding by
    multiplying it by 0, and base rows read a padding position; 0 * Inf is NaN, so the base
    request decoding beside the adapter's got NaN logits from its second token on."""
    from safetensors.torch import load_file, save_file

    huge = _clone(folders[0], tmp_path / "huge")
    weights = load_file(str(huge / "adapter_model.safetensors"))
    save_file({k: v * 1e30 if "lora_B" in k else v for k, v in weights.items()}, str(huge / "adapter_model.safetensors"))
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("huge", PROMPT, params, lora_request=LoRARequest("huge", 1, str(huge)))
    base = engine.add_request("base", PROMPT, params)
    other = engine.add_request("other", PROMPT, params, lora_request=LoRARequest("other", 2, str(folders[1])))
    while engine.has_unfinished():
        engine.step()
    assert_peft_greedy(tiny_model_dir, None, PROMPT, list(base.seqs[0].output_token_ids), "base beside the overflowing adapter")
    assert_peft_greedy(tiny_model_dir, folders[1], PROMPT, list(other.seqs[0].output_token_ids), "adapter beside the overflowing one")


def test_an_adapter_loaded_again_never_hits_the_prefix_blocks_of_its_old_load(tiny_model_dir, folders, tmp_path):
    """vLLM's remove_lora then a request under the same id and folder whose files were rewritten
    in between: the prefix root was the id and folder only, so the new load's prompt hit the
    blocks the old weights computed (a stale mixture of both versions). Each load now roots its
    own blocks; requests of one load still share theirs."""
    folder = _clone(folders[0], tmp_path / "v")
    lora = LoRARequest("v", 1, str(folder))
    prompt = list(range(3, 43))  # two full blocks: prefix-cacheable
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = make_engine(tiny_model_dir)

    def run(rid):
        req = engine.add_request(rid, prompt, params, lora_request=lora)
        while engine.has_unfinished():
            engine.step()
        return req

    run("old")
    again = run("old-again")
    assert again.num_cached_tokens == 32  # one load: its requests share blocks
    assert engine.remove_lora(1)
    shutil.rmtree(folder)
    _clone(folders[1], folder)
    new = run("new")
    assert new.num_cached_tokens == 0
    assert_peft_greedy(tiny_model_dir, folders[1], prompt, list(new.seqs[0].output_token_ids), "the rewritten adapter")


def test_safetensors_the_header_check_passes_but_safetensors_refuses(tiny_model_dir, folders, tmp_path):
    """Two tensors over one byte range, or bytes past the last tensor: every range fits the file
    (the loader's header check passes) but safetensors refuses the file; its SafetensorError
    escaped ``add_lora`` instead of an ``invalid_lora`` refusal."""
    import json

    raw = (folders[0] / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    first = tensors[0]
    twin = next(k for k in tensors[1:] if header[k]["shape"] == header[first]["shape"])
    overlap = dict(header, **{twin: dict(header[twin], data_offsets=header[first]["data_offsets"])})
    engine = make_engine(tiny_model_dir)
    for i, (name, h, d) in enumerate((("overlap", overlap, data), ("trailing", header, data + bytes(64)))):
        folder = _clone(folders[0], tmp_path / name)
        body = json.dumps(h).encode()
        (folder / "adapter_model.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + d)
        with pytest.raises(InvalidRequestError, match="not a valid safetensors file") as err:
            engine.add_lora(LoRARequest(name, 20 + i, str(folder)))
        assert err.value.code == "invalid_lora"
