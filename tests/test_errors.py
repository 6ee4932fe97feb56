"""Bad input gets a clear error naming the argument, from the direct API and from the ops."""
import re

import pytest
import torch

import flashsdpa

sdpa = flashsdpa.scaled_dot_product_attention
fwd_op = torch.ops.flashsdpa.flash_attn_fwd
bwd_op = torch.ops.flashsdpa.flash_attn_bwd


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


API_CASES = [
    # (id, args, kwargs, exception, message fragment)
    ("query rank 1", (r(8), r(5, 8), r(5, 8)), {}, ValueError, "query must have at least 2"),
    ("key not tensor", (r(1, 2, 4, 8), [1.0], r(1, 2, 5, 8)), {}, RuntimeError,
     "for argument 'key'"),
    ("mixed dtypes", (r(1, 2, 4, 8), r(1, 2, 5, 8, dtype=torch.float64), r(1, 2, 5, 8)), {},
     ValueError, "key.dtype"),
    ("value dtype", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8, dtype=torch.bfloat16)), {},
     ValueError, "value.dtype"),
    ("integer dtype", (torch.ones(1, 2, 4, 8, dtype=torch.int32),) * 3, {}, ValueError,
     "query.dtype must be a floating-point"),
    ("batch mismatch", (r(2, 2, 4, 8), r(3, 2, 5, 8), r(3, 2, 5, 8)), {}, ValueError,
     "key batch size"),
    ("head dim mismatch", (r(1, 2, 4, 8), r(1, 2, 5, 7), r(1, 2, 5, 8)), {}, ValueError,
     "key head_dim"),
    ("kv seq mismatch", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 6, 8)), {}, ValueError,
     "key seq_len"),
    ("kv heads mismatch", (r(1, 4, 4, 8), r(1, 2, 5, 8), r(1, 4, 5, 8)), {}, ValueError,
     "key heads"),
    ("gqa not multiple", (r(1, 6, 4, 8), r(1, 4, 5, 8), r(1, 4, 5, 8)), {"enable_gqa": True},
     ValueError, "multiple of key/value heads"),
    ("gqa without flag", (r(1, 6, 4, 8), r(1, 3, 5, 8), r(1, 3, 5, 8)), {}, ValueError,
     "enable_gqa=True"),
    ("negative dropout", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)), {"dropout_p": -0.1},
     ValueError, "dropout_p"),
    ("dropout > 1", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)), {"dropout_p": 1.5},
     ValueError, "dropout_p"),
    ("mask shape", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)),
     {"attn_mask": torch.zeros(4, 6)}, ValueError, "attn_mask of shape"),
    ("mask rank 5", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)),
     {"attn_mask": torch.zeros(1, 1, 2, 4, 5)}, ValueError, "attn_mask of shape"),
    ("mask int dtype", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)),
     {"attn_mask": torch.zeros(4, 5, dtype=torch.int32)}, ValueError, "attn_mask.dtype"),
    ("mask f16 with f32 query", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)),
     {"attn_mask": torch.zeros(4, 5, dtype=torch.float16)}, ValueError, "attn_mask.dtype"),
    ("scale string", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)), {"scale": "big"},
     RuntimeError, "for argument 'scale'"),
]


@pytest.mark.parametrize("case", API_CASES, ids=[c[0] for c in API_CASES])
def test_direct_api_errors(case):
    _, args, kwargs, exc, fragment = case
    with pytest.raises(exc, match=re.escape(fragment)):
        sdpa(*args, **kwargs)


# The ops take the direct API's validation (ValueError naming the argument) plus their own
# preconditions on what routing hands them (RuntimeError): 4-D, a kernel dtype, key / value batch
# already broadcast (or 1 for both: the kernel reads them at batch stride 0), dropout below 1.
OP_CASES = [
    ("query 3-D", (r(2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)), {}, RuntimeError, "query must be 4-D"),
    ("key 3-D", (r(1, 2, 4, 8), r(2, 5, 8), r(1, 2, 5, 8)), {}, RuntimeError, "key must be 4-D"),
    ("float64", (r(1, 2, 4, 8, dtype=torch.float64),) * 3, {}, RuntimeError,
     "query.dtype must be float32"),
    ("mixed", (r(1, 2, 4, 8), r(1, 2, 5, 8, dtype=torch.bfloat16), r(1, 2, 5, 8)), {},
     ValueError, "key.dtype"),
    ("batch", (r(2, 2, 4, 8), r(1, 2, 5, 8), r(2, 2, 5, 8)), {}, RuntimeError, "key batch size"),
    ("heads", (r(1, 3, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)), {}, ValueError,
     "multiple of key/value heads"),
    ("v heads", (r(1, 4, 4, 8), r(1, 2, 5, 8), r(1, 4, 5, 8)), {}, ValueError, "value heads"),
    ("head dim", (r(1, 2, 4, 8), r(1, 2, 5, 4), r(1, 2, 5, 8)), {}, ValueError, "key head_dim"),
    ("seq", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 6, 8)), {}, ValueError, "value seq_len"),
    ("mask shape", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8), torch.zeros(3, 5)), {},
     ValueError, "attn_mask of shape"),
    ("mask dtype", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8),
                    torch.zeros(4, 5, dtype=torch.float64)), {}, ValueError, "attn_mask.dtype"),
    ("dropout", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8), None, -0.5), {}, ValueError,
     "dropout_p"),
    ("dropout one", (r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8), None, 1.0), {}, RuntimeError,
     "dropout_p"),
]


@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_op_errors(case):
    _, args, kwargs, exc, fragment = case
    with pytest.raises(exc, match=re.escape(fragment)):
        fwd_op(*args, **kwargs)


def test_backward_op_checks_saved_tensors():
    q, k, v = r(1, 2, 4, 8), r(1, 2, 5, 8), r(1, 2, 5, 8)
    out, lse, rng, _ = fwd_op(q, k, v)
    with pytest.raises(RuntimeError, match="logsumexp must be float32"):
        bwd_op(out, q, k, v, out, lse[:, :1], rng, None, 0.0, False)
    with pytest.raises(RuntimeError, match="grad_out must have shape"):
        bwd_op(out[:, :1], q, k, v, out, lse, rng, None, 0.0, False)
    with pytest.raises(RuntimeError, match="rng_state"):
        bwd_op(out, q, k, v, out, lse, rng[:1], None, 0.0, False)


def test_explain_reports_invalid_arguments():
    text = flashsdpa.explain(r(1, 2, 4, 8), r(1, 2, 5, 7), r(1, 2, 5, 8))
    assert "invalid arguments" in text and "key head_dim" in text


def test_cpu_isa_rejects_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        flashsdpa.cpu_isa(torch.int8)
