"""Compile the kernels for Hopper (sm_90) without a GPU and report what came out.

Run as a script in a fresh interpreter with TRITON_INTERPRET unset (compiled
and interpreted Triton do not mix in one process); prints one JSON object:
``{name: {"ops": [...PTX instruction kinds...], "shared": bytes}}``.
``--full`` adds fp32/fp16 variants and the store_kv/rms_norm kernels. The
sliding-window + softcap variants of the attention kernels (bf16) are always built.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import decode_attention, fused_moe, kv_store, lora_sgmv, prefill_attention, rmsnorm, rotary, swiglu  # noqa: E402

OPS = r"(ld\.global\.b16|cp\.async\.cg\.shared\.global|wgmma\.mma_async|mma\.sync)"


def compile_sm90(fn, types: dict[str, str], consts: dict, num_warps: int = 4, num_stages: int = 2,
                 divisible: tuple[str, ...] = ()) -> dict:
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    # What the JIT launcher would specialize on: 16-byte aligned pointers, strides divisible by 16
    # (and the integer arguments in ``divisible``, e.g. a model's widths).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("stride") or n == "split_size"
                                     or n in divisible)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    return {"ops": sorted(set(re.findall(OPS, k.asm["ptx"]))), "shared": k.metadata.shared}


def paged_types(dt: str) -> dict[str, str]:
    return {"k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}", "bt_ptr": "*i32", "seq_lens_ptr": "*i32",
            "q_ptr": f"*{dt}", "out_ptr": f"*{dt}", "qk_scale": "fp32", "cap_log2e": "fp32", "qsl_ptr": "*i32",
            "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "sinks_ptr": "*fp32"}


def main(full: bool) -> dict:
    res = {}
    plain = dict(HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_SINKS=False)
    for dt in ["bf16"] + (["fp16", "fp32"] if full else []):
        prec = "ieee" if dt == "fp32" else "tf32"
        t = paged_types(dt)
        res[f"decode_split_{dt}"] = compile_sm90(decode_attention._decode_split_kernel, t, dict(
            HQ=32, NUM_SPLITS=4, G=4, G_PAD=16, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64, DIRECT=False,
            DOT_PREC=prec, **plain))
        res[f"decode_reduce_{dt}"] = compile_sm90(decode_attention._decode_reduce_kernel, t, dict(
            HQ=32, NUM_SPLITS=5, S_PAD=8, D=128, D_PAD=128, HAS_WINDOW=False, HAS_SINKS=False))
        res[f"prefill_{dt}"] = compile_sm90(prefill_attention._prefill_kernel, t, dict(
            G=4, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64, DOT_PREC=prec, **plain))
        # sliding window + softcap (Gemma 2's local layers: 16 heads of 256 in GQA groups of 2, prefill
        # with 128-wide heads); window + sinks (gpt-oss's: 64 heads of 64, groups of 8)
        variants = (("window", dict(HAS_SOFTCAP=True, HAS_SINKS=False), 16, 2, 256, 128),
                    ("sinks", dict(HAS_SOFTCAP=False, HAS_SINKS=True), 64, 8, 64, 64))
        for name, flags, hq, g, d, d_prefill in variants if dt == "bf16" else ():
            opts = dict(HAS_WINDOW=True, **flags)
            res[f"decode_split_{name}_{dt}"] = compile_sm90(decode_attention._decode_split_kernel, t, dict(
                HQ=hq, NUM_SPLITS=4, G=g, G_PAD=16, D=d, D_PAD=d, BLOCK_SIZE=16, BLOCK_N=64, DIRECT=False,
                DOT_PREC=prec, **opts))
            res[f"decode_reduce_{name}_{dt}"] = compile_sm90(decode_attention._decode_reduce_kernel, t, dict(
                HQ=hq, NUM_SPLITS=4, S_PAD=4, D=d, D_PAD=d, HAS_WINDOW=True, HAS_SINKS=flags["HAS_SINKS"]))
            res[f"prefill_{name}_{dt}"] = compile_sm90(prefill_attention._prefill_kernel, t, dict(
                G=g, D=d_prefill, D_PAD=d_prefill, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_N=64, DOT_PREC=prec, **opts))
        # mixture of experts: decode-sized (16-row) and prefill-sized (64-row) expert tiles
        moe_t = {**{n: f"*{dt}" for n in ("x_ptr", "w_ptr", "out_ptr", "h_ptr")}, "sorted_ids_ptr": "*i32",
                 "block_expert_ptr": "*i32", "topk_w_ptr": "*fp32"}
        for bm in (16, 64):
            res[f"moe_gate_up_m{bm}_{dt}"] = compile_sm90(fused_moe._gate_up_kernel, moe_t, dict(
                TOP_K=8, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=32 if dt == "fp32" else 64, DOT_PREC=prec, EVEN_K=True))
            res[f"moe_down_m{bm}_{dt}"] = compile_sm90(fused_moe._down_kernel, moe_t, dict(
                BLOCK_M=bm, BLOCK_N=64, BLOCK_K=32 if dt == "fp32" else 64, DOT_PREC=prec, W_IN_ACT=False, EVEN_K=True))
        # multi-LoRA shrink/expand, rank 16: decode-sized (16-row) tiles, prefill-sized with --full
        lora_t = {**{n: f"*{dt}" for n in ("x_ptr", "a_ptr", "b_ptr", "y_ptr")}, "h_ptr": "*fp32",
                  **{n: "*i32" for n in ("seg_start_ptr", "seg_len_ptr", "seg_slot_ptr", "tile_seg_ptr", "tile_row_ptr")}}
        for bm in (16, 64) if full else (16,):
            res[f"lora_shrink_m{bm}_{dt}"] = compile_sm90(lora_sgmv._shrink_kernel, lora_t, dict(
                BLOCK_M=bm, BLOCK_N=64, BLOCK_K=32 if dt == "fp32" else 64, SPLIT_K=1, DOT_PREC=prec, EVEN_K=True),
                divisible=("K", "N"))
            res[f"lora_expand_m{bm}_{dt}"] = compile_sm90(lora_sgmv._expand_kernel, lora_t, dict(
                R=16, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=16, DOT_PREC="ieee" if dt == "fp32" else "tf32"),
                divisible=("N",))
        # the per-layer elementwise kernels of a decode step (SmolLM2's shapes: 9/3 heads of 64, I = 1536)
        res[f"rotary_{dt}"] = compile_sm90(rotary._rotary_kernel, {
            **{n: f"*{dt}" for n in ("q_ptr", "k_ptr", "cos_ptr", "sin_ptr")}, "pos_ptr": "*i64"},
            dict(HALF=32, H_PAD=16, HALF_PAD=32, ROUND=dt != "fp32"))
        res[f"silu_and_mul_{dt}"] = compile_sm90(swiglu._silu_and_mul_kernel, {
            **{n: f"*{dt}" for n in ("x_ptr", "out_ptr")}}, dict(BLOCK=1024), divisible=("width",))
        if full:
            res[f"decode_direct_{dt}"] = compile_sm90(decode_attention._decode_split_kernel, t, dict(
                HQ=24, NUM_SPLITS=1, G=3, G_PAD=16, D=64, D_PAD=64, BLOCK_SIZE=32, BLOCK_N=64, DIRECT=True,
                DOT_PREC=prec, **plain))
            res[f"store_kv_{dt}"] = compile_sm90(kv_store._store_kv_kernel, {
                **{n: f"*{dt}" for n in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}, "slot_ptr": "*i64"},
                dict(BLOCK_SIZE=16, HKV=8, D=128, HD_PAD=1024))
            res[f"rms_norm_{dt}"] = compile_sm90(rmsnorm._rms_norm_kernel, {
                **{n: f"*{dt}" for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "new_res_ptr")}, "eps": "fp32"},
                dict(N_PAD=1024, HAS_RES=True))
    return res


if __name__ == "__main__":
    print(json.dumps(main("--full" in sys.argv)))
