"""Compile the Triton kernels ahead of time for an NVIDIA target, without a GPU.

The interpreter (the rest of test_triton.py) checks what the kernels compute; this checks that
they go through Triton's real compiler - front end, layouts, tensor-descriptor lowering, ptxas -
for the block configurations the launchers use, something the interpreter never exercises.
Run by tests/test_triton.py in a subprocess (the interpreter must be off when Triton is first
imported):   python tests/triton_aot_check.py 90
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashsdpa.kernels import attention_bwd, attention_fwd, attention_kvcache, configs  # noqa: E402

PTR_ELEM = {"Q": "T", "K": "T", "V": "T", "O": "T", "DO": "T", "DK": "T", "DV_": "T", "DQ": "T",
            "Mask": "M", "LSE": "fp32", "DELTA": "fp32", "SHIFT": "fp32", "Keep": "u8",
            "Alibi": "fp32", "Sinks": "fp32", "CuQ": "i32", "CuK": "i32", "Kc": "M", "Vc": "M",
            "BlockTable": "i32", "SeqLens": "i32", "OutP": "fp32", "LseP": "fp32", "Out": "T",
            "Lse": "fp32",
            "KScale": "fp32", "VScale": "fp32"}
FLOATS = {"qk_scale", "sm_scale", "dropout_p", "cap_in", "cap_out", "lse_empty"}
I64 = {"seed", "rng_offset"}


def signature(fn, dtype, mask_dtype, consts):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in PTR_ELEM:
            elem = PTR_ELEM[name]
            sig[name] = "*" + {"T": dtype, "M": mask_dtype}.get(elem, elem)
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name in I64:
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


def compile_kernel(fn, dtype, mask_dtype, consts, opts, target):
    src = ASTSource(fn, signature(fn, dtype, mask_dtype, consts), constexprs=consts)
    opts = {k: v for k, v in opts.items() if k != "grf_mode"}
    return triton.compile(src, target=target, options=opts)


# (dtype, head dim, mask dtype (None: no mask), band (HAS_LO, HAS_HI), dropout, variants
# (softcap, ALiBi, sinks), packed (varlen: no mask))
CASES = [("fp16", 64, "fp16", (False, True), True, False, False),
         ("bf16", 128, "u8", (False, False), False, False, False),
         ("fp32", 64, "fp32", (False, True), False, False, False),
         ("bf16", 128, "fp32", (True, True), False, True, False),
         ("fp16", 64, "u8", (True, False), True, True, False),
         ("bf16", 128, None, (True, True), True, True, True)]


KVCACHE_CASES = [("bf16", 128, True, False, 4), ("fp16", 64, False, True, 256),
                 ("fp32", 256, True, True, 1), ("bf16", 128, True, True, 8)]


def main(arch):
    target = GPUTarget("cuda", arch, 32)
    for dtype, d, mask_dtype, (has_lo, has_hi), dropout, variants, packed in CASES:
        common = dict(HAS_MASK=mask_dtype is not None, MASK_BOOL=mask_dtype == "u8",
                      MASK_SHIFT=mask_dtype not in (None, "u8"), HAS_LO=has_lo, HAS_HI=has_hi, SOFTCAP=variants, HAS_ALIBI=variants,
                      DROPOUT=dropout, UPCAST=False, PRECISION="ieee" if dtype == "fp32" else
                      "tf32", VARLEN=packed, BLOCK_D=d, BLOCK_DV=d)
        mask_dtype = mask_dtype or dtype
        fwd_blocks, fwd_opts = configs.forward_config(d)
        (kv_blocks, kv_opts), (q_blocks, q_opts) = configs.backward_config(d)
        compile_kernel(attention_fwd.attn_fwd_kernel, dtype, mask_dtype,
                       dict(common, HAS_SINKS=variants, **fwd_blocks), fwd_opts, target)
        compile_kernel(attention_bwd.attn_bwd_dkdv_kernel, dtype, mask_dtype,
                       dict(common, **kv_blocks), kv_opts, target)
        compile_kernel(attention_bwd.attn_bwd_dq_kernel, dtype, mask_dtype,
                       dict(common, **q_blocks), q_opts, target)
        print(f"sm_{arch} {dtype} D={d} band={(has_lo, has_hi)} variants={variants} "
              f"packed={packed}: forward, dK/dV, dQ compiled", flush=True)
    # the xpu block shapes (BLOCK_M 128, 16 warps) through the same front end
    compile_kernel(attention_fwd.attn_fwd_kernel, "fp16", "fp16",
                   dict(HAS_MASK=False, MASK_BOOL=False, MASK_SHIFT=False, HAS_LO=False,
                        HAS_HI=True,
                        SOFTCAP=False, HAS_ALIBI=False, HAS_SINKS=False, DROPOUT=False,
                        UPCAST=False, PRECISION="tf32", VARLEN=False, BLOCK_D=128, BLOCK_DV=128,
                        BLOCK_M=128, BLOCK_N=64), dict(num_warps=16, num_stages=2), target)
    print(f"sm_{arch} xpu-shaped forward compiled")
    # the KV-cache kernel: (q dtype, head dim, paged, float8 cache, query rows of a kv head)
    for dtype, d, paged, fp8, rows in KVCACHE_CASES:
        blocks, opts = configs.kvcache_config(d, rows)
        consts = dict(PAGED=paged, FP8=fp8, SCALE_PER_HEAD=int(fp8), HAS_LO=fp8, HAS_HI=True,
                      SOFTCAP=fp8, HAS_ALIBI=fp8, UPCAST=False,
                      PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_D=d, BLOCK_DV=d,
                      **blocks)
        compile_kernel(attention_kvcache.attn_kvcache_kernel, dtype, "u8" if fp8 else dtype,
                       consts, opts, target)
        # the largest split count (one row a program) and a few splits (several rows)
        for n_splits in (configs.MAX_SPLITS, 4):
            compile_kernel(attention_kvcache.attn_kvcache_combine_kernel, dtype, dtype,
                           dict(HAS_SINKS=fp8, **configs.combine_config(rows * 64, n_splits, d)),
                           dict(num_warps=4), target)
    print(f"sm_{arch} KV-cache kernels ({len(KVCACHE_CASES)} configurations) compiled")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
