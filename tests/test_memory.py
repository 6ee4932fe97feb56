"""Memory stays O(L): no L x S buffer anywhere. A (1, 8, 16384, 64) fp32 forward + backward
(whose score matrix alone would take 8 GiB) must peak under 0.5 GiB above its tensors."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import re, torch, flashsdpa

    def hwm():  # peak resident set of this process, bytes
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) * 1024

    B, H, L, D = 1, 8, 16384, 64
    q, k, v = [torch.randn(B, H, L, D, requires_grad=True) for _ in range(3)]
    grad = torch.randn(B, H, L, D)
    flashsdpa.scaled_dot_product_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256],
                                           is_causal=True).sum().backward()  # warm up
    for t in (q, k, v):
        t.grad = None
    base = hwm()
    out = flashsdpa.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    tensors = out.nbytes + sum(t.grad.nbytes for t in (q, k, v))  # what the call returns
    print((hwm() - base - tensors) / 2**30)
""")


def test_forward_backward_peak_memory_is_o_of_l():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=900, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    extra_gib = float(res.stdout.strip().splitlines()[-1])
    assert extra_gib < 0.5, f"forward+backward used {extra_gib:.2f} GiB above its tensors"
