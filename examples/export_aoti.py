"""A torch.export + AOTInductor package of a model whose attention runs on flashsdpa.

With flashsdpa.enable(), the model's F.scaled_dot_product_attention calls are lowered to
flashsdpa's ops (flashsdpa::flash_attn_fwd), so the compiled package calls them by name through
PyTorch's dispatcher: it needs flashsdpa imported in the process that loads it (import flashsdpa
registers the ops; enable() is not needed there). This example exports the model of
tiny_transformer.py with a dynamic batch size, compiles and packages it
(aoti_compile_and_package: C++ compiled by the host's compiler, the slow part), loads the package,
checks its output against eager mode at two batch sizes, and shows what loading it does in a
process without flashsdpa.

    python examples/export_aoti.py
    python examples/export_aoti.py --package model.pt2     # keep the package
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

import flashsdpa
from tiny_transformer import Config, TinyTransformer, profiled

# fp32: the package's fused elementwise kernels (layer norm, GELU, residual adds) round
# differently from eager's separate ones; the attention and the matmuls run the same kernels
TOLERANCE = 1e-5

# a fresh process loads the package without flashsdpa, then after `import flashsdpa`
LOAD_ELSEWHERE = """
import sys, torch
try:
    torch._inductor.aoti_load_package(sys.argv[1])
    print("without flashsdpa: loaded")
except Exception as e:
    print(f"without flashsdpa: {type(e).__name__}: {str(e).splitlines()[0]}")
import flashsdpa  # registers flashsdpa's ops; routing (enable()) is not needed
out = torch._inductor.aoti_load_package(sys.argv[1])(torch.zeros(3, int(sys.argv[2]), dtype=int))
print(f"after import flashsdpa: loaded, output {tuple(out.shape)}")
"""


def export_and_check(path):
    """Exports, compiles and packages the model to `path`, then loads and checks the package."""
    flashsdpa.enable()
    torch.manual_seed(0)
    cfg = Config()
    model = TinyTransformer(cfg).eval()
    example = torch.randint(cfg.vocab, (2, cfg.max_len))

    t0 = time.perf_counter()
    with torch.no_grad():
        batch = torch.export.Dim("batch", min=1, max=64)
        exported = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    t1 = time.perf_counter()
    torch._inductor.aoti_compile_and_package(exported, package_path=path)
    t2 = time.perf_counter()
    print(f"exported in {t1 - t0:.1f} s, compiled and packaged in {t2 - t1:.1f} s: {path}")

    loaded = torch._inductor.aoti_load_package(path)
    for rows in (1, 5):
        idx = torch.randint(cfg.vocab, (rows, cfg.max_len), generator=torch.Generator()
                            .manual_seed(rows))
        with torch.no_grad():
            (out, kernels), ref = profiled(lambda: loaded(idx)), model(idx)
        diff = (out - ref).abs().max().item()
        print(f"batch {rows}: max |package - eager| = {diff:.2e} "
              f"(within {TOLERANCE:g}: {diff <= TOLERANCE})")
    print(f"flashsdpa kernels the package ran: {', '.join(kernels) or 'none'}")

    # the package calls flashsdpa's ops by name: without flashsdpa they are unknown
    done = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, path, str(cfg.max_len)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f"loading the package in a fresh process failed:\n{done.stderr}")
    for line in done.stdout.splitlines():
        print(f"loading it in a fresh process, {line}")
    print("note: the package holds flashsdpa ops; `import flashsdpa` (the same version) before "
          "aoti_load_package wherever it is loaded")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", help="where to write the package (default: a temporary file)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        export_and_check(args.package or os.path.join(tmp, "tiny_transformer.pt2"))


if __name__ == "__main__":
    main()
