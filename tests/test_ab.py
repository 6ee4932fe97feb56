"""bench/ab.py's renaming of a base revision's copy (flashsdpa -> flashsdpa_base), on a tiny
synthetic tree: nothing is exported or built."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ab  # noqa: E402  (imports neither torch nor flashsdpa at module level)

FILES = {
    "setup.py": 'ext = CppExtension(name="flashsdpa._C")\n'
                'packages=["flashsdpa", "flashsdpa.kernels"]\n'
                'package_dir={"flashsdpa": "flashsdpa", "flashsdpa.kernels": "kernels"}\n'
                'entry_points={"torch.backends": ["flashsdpa = flashsdpa_autoload:autoload"]}\n'
                'if os.environ.get("FLASHSDPA_NO_EXT") == "1": pass\n',
    "csrc/ops.cpp": "namespace flashsdpa {\n}  // namespace flashsdpa\n"
                    "TORCH_LIBRARY(flashsdpa, m) {\n  m.def(\"sdpa(Tensor q) -> Tensor\");\n}\n"
                    "TORCH_LIBRARY_IMPL(flashsdpa, CPU, m) {}\n#ifdef FLASHSDPA_EMULATE\n#endif\n"
                    'auto op = findSchemaOrThrow("flashsdpa::flash_attn_fwd", "");\r\n',
    "flashsdpa/__init__.py": "from . import _C\n_op = torch.ops.flashsdpa.sdpa.default\n"
                             'ENV = "FLASHSDPA_CPU_ISA"\nlogger = logging.getLogger("flashsdpa")\n',
    "flashsdpa/sub/flashsdpa_x.txt": "flashsdpa\n",
    "flashsdpa_autoload.py": "import flashsdpa\nflashsdpa.enable()\n",
    "kernels/common.py": "x = 1  # nothing to rename\n",
}
BINARY = b"\xff\xfe\x00flashsdpa\x80"


def test_rename_tree(tmp_path):
    for rel, text in FILES.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text.encode())
    (tmp_path / "flashsdpa" / "_C.so").write_bytes(BINARY)

    ab.rename_tree(str(tmp_path))

    got = {os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path)
           for f in fs}
    assert got == {"setup.py", "csrc/ops.cpp", "flashsdpa_base/__init__.py",
                   "flashsdpa_base/sub/flashsdpa_base_x.txt", "flashsdpa_base_autoload.py",
                   "kernels/common.py", "flashsdpa_base/_C.so"}
    read = lambda rel: (tmp_path / rel).read_bytes().decode()  # noqa: E731  (keeps \r\n)
    setup, ops, init = read("setup.py"), read("csrc/ops.cpp"), read("flashsdpa_base/__init__.py")
    assert 'name="flashsdpa_base._C"' in setup
    assert 'package_dir={"flashsdpa_base": "flashsdpa_base", "flashsdpa_base.kernels": ' \
           '"kernels"}' in setup
    assert '"flashsdpa_base = flashsdpa_base_autoload:autoload"' in setup
    assert "FLASHSDPA_NO_EXT" in setup  # upper case: environment variables keep their names
    assert "TORCH_LIBRARY(flashsdpa_base, m)" in ops
    assert "TORCH_LIBRARY_IMPL(flashsdpa_base, CPU, m)" in ops
    assert "namespace flashsdpa_base {" in ops and "#ifdef FLASHSDPA_EMULATE" in ops
    assert '"flashsdpa_base::flash_attn_fwd", "");\r\n' in ops  # line endings kept
    assert "torch.ops.flashsdpa_base.sdpa" in init and '"FLASHSDPA_CPU_ISA"' in init
    assert read("flashsdpa_base_autoload.py") == "import flashsdpa_base\nflashsdpa_base.enable()\n"
    assert read("kernels/common.py") == FILES["kernels/common.py"]
    for rel in got - {"flashsdpa_base/_C.so"}:  # no stray old name, none renamed twice
        text = read(rel)
        assert text.count("flashsdpa") == text.count("flashsdpa_base"), rel
        assert "flashsdpa_base_base" not in text, rel
    assert (tmp_path / "flashsdpa_base" / "_C.so").read_bytes() == BINARY  # binaries untouched


def test_kvcache_steps_layouts():
    """ab.py --mode kvcache's cases (bench_serving.kvcache_calls): the same keys and values in
    flash-attn's layout, contiguous, paged (shuffled pages) and float8, each step a
    flash_attn_with_kvcache call of the module it names; paged gives the contiguous output bit
    for bit, float8 its dequantised one's, and the bytes counted are the layout's."""
    import torch
    import flashsdpa
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_sdpa as bs
    import bench_serving
    q, k, v = bs.make_inputs(2, 4, 2, 40, 32, torch.bfloat16, "decode")
    outs, sizes = {}, {}
    for layout in bench_serving.KV_LAYOUTS:
        steps, sizes[layout] = bench_serving.kvcache_calls({"new": flashsdpa}, q, k, v, layout,
                                                           torch.Generator().manual_seed(0))
        outs[layout] = steps["new"]()
    want = flashsdpa.flash_attn_with_kvcache(
        q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
        v.transpose(1, 2).contiguous(), cache_seqlens=torch.full((2,), 40, dtype=torch.int32))
    assert torch.equal(outs["contiguous"], want) and torch.equal(outs["paged16"], want)
    torch.testing.assert_close(outs["float8"].float(), want.float(), atol=0.1, rtol=0.1)
    assert sizes["contiguous"] == sizes["paged16"] == 2 * 2 * 40 * 2 * 32 * 2
    assert sizes["float8"] == sizes["contiguous"] // 2
