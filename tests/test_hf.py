"""The Hugging Face transformers backend (flashsdpa.hf): tiny random-weight models of each family
against transformers' own "eager" attention: logits, greedy generate() with the dynamic and
static caches, a training step's gradients, packed sequences, padding, and which of flashsdpa's
kernels ran (profiler events)."""
import importlib.metadata
import subprocess
import sys

import pytest
import torch

from conftest import ATOL, ERR_FACTOR, STRICT

try:
    import transformers  # noqa: F401
except ImportError:  # `make test` installs it; CI must not silently lose these tests
    if STRICT:
        raise
    pytest.skip("transformers is not installed (make test installs it)", allow_module_level=True)

import flashsdpa.hf  # noqa: E402
from transformers import (AutoModelForCausalLM, DataCollatorWithFlattening,  # noqa: E402
                          Gemma2Config, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                          MistralConfig)

NAME = flashsdpa.hf.register()
WINDOW = 8  # shorter than the test sequences, so the sliding layers' windows matter
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW),
    "gemma2": lambda: Gemma2Config(**_COMMON, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=None, query_pre_attn_scalar=16),
    "gemma3": lambda: Gemma3TextConfig(**_COMMON, sliding_window=WINDOW,
                                       query_pre_attn_scalar=16),
    "gptoss": lambda: GptOssConfig(**_COMMON, sliding_window=WINDOW, num_local_experts=4,
                                   num_experts_per_tok=2),
}
FAMILIES = list(CONFIGS)


def model(family, dtype=torch.float32, impl="eager"):
    torch.manual_seed(0)
    extra = {"experts_implementation": "eager"} if family == "gptoss" else {}  # fp64 experts
    try:
        m = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation=impl,
                                             dtype=dtype, **extra)
    except TypeError:  # transformers 4.x: no experts_implementation (its experts take fp64)
        m = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation=impl,
                                             dtype=dtype)
    if family == "gptoss":  # the sinks start at zero: give them values that matter
        with torch.no_grad():
            for layer in m.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return m.eval()


def tokens(batch, length, seed=1):
    # from 3: no pad, bos or eos id (generate() reads pad ids in the prompt as padding)
    return torch.randint(3, _COMMON["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


def padding(batch, length, side):
    mask = torch.ones(batch, length, dtype=torch.long)
    if side == "left":
        mask[1, :5] = 0
        mask[-1, :length - 3] = 0
    elif side == "right":
        mask[1, -5:] = 0
        mask[-1, 3:] = 0
    return mask


class Ran:
    """The flashsdpa ops the block called (profiler events)."""

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        self.ops = {e.name for e in self.prof.events() if e.name.startswith("flashsdpa::")}


def logits(m, impl, *args, **kw):
    m.set_attn_implementation(impl)
    with torch.no_grad():
        return m(*args, **kw).logits


@pytest.mark.parametrize("side", ["none", "left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_eager(family, side):
    m = model(family)
    ids, mask = tokens(3, 20), padding(3, 20, side)
    ref = logits(m, "eager", ids, attention_mask=mask)
    with Ran() as ran:
        out = logits(m, NAME, ids, attention_mask=mask)
    kept = mask.bool()  # padded positions' logits are meaningless in both
    assert (out - ref)[kept].abs().max() <= 1e-4
    # no padding: the plain kernel; padding: the valid rows packed for the varlen kernel
    assert ("flashsdpa::flash_attn" if side == "none" else "flashsdpa::flash_attn_varlen_fwd") \
        in ran.ops


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_within_the_suite_rule(family):
    # no padding: eager's fp64 padded rows are NaN (rows of nothing but the mask's fill value)
    ids, mask = tokens(2, 24), padding(2, 24, "none")
    ref = logits(model(family, torch.float64), "eager", ids, attention_mask=mask)
    m = model(family, torch.bfloat16)
    eager = logits(m, "eager", ids, attention_mask=mask).double()
    ours = logits(m, NAME, ids, attention_mask=mask).double()
    kept = mask.bool()
    err = (ours - ref)[kept].abs().max()
    torch_err = (eager - ref)[kept].abs().max()
    assert err <= ERR_FACTOR * torch_err + ATOL[torch.bfloat16] * max(1.0, ref.abs().max()), \
        (err, torch_err)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_equals_eager(family, cache):
    m = model(family)
    ids, mask = tokens(3, 12), padding(3, 12, "left")
    kw = dict(max_new_tokens=10, do_sample=False, attention_mask=mask)
    if cache == "static":
        kw["cache_implementation"] = "static"
    m.set_attn_implementation("eager")
    ref = m.generate(ids, **kw)
    m.set_attn_implementation(NAME)
    with Ran() as ran:
        out = m.generate(ids, **kw)
    assert torch.equal(out, ref)
    # a left-padded batch decodes through the boolean-mask kernel call
    assert "flashsdpa::sdpa" in ran.ops and "flashsdpa::flash_attn_varlen_fwd" in ran.ops
    # one unpadded sequence decodes on the plain kernel (its decode path)
    m.set_attn_implementation("eager")
    ref1 = m.generate(ids[:1], max_new_tokens=10, do_sample=False)
    m.set_attn_implementation(NAME)
    with Ran() as ran:
        assert torch.equal(m.generate(ids[:1], max_new_tokens=10, do_sample=False), ref1)
    assert "flashsdpa::flash_attn" in ran.ops and "flashsdpa::sdpa" not in ran.ops


def grads(m, impl, **batch):
    m.set_attn_implementation(impl)
    m.train()
    m.zero_grad()
    m(**batch, use_cache=False).loss.backward()  # no cache: eager also reads packing
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def assert_close_grads(ours, ref, rtol=1e-3):
    assert ours.keys() == ref.keys()
    for n in ref:
        rel = (ours[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)
        assert rel <= rtol, (n, rel.item())


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradients_equal_eager(family):
    m = model(family)
    ids, mask = tokens(2, 24), padding(2, 24, "right")
    labels = ids.masked_fill(mask == 0, -100)
    ref = grads(m, "eager", input_ids=ids, attention_mask=mask, labels=labels)
    with Ran() as ran:
        ours = grads(m, NAME, input_ids=ids, attention_mask=mask, labels=labels)
    assert_close_grads(ours, ref)
    assert "flashsdpa::flash_attn_varlen_bwd" in ran.ops  # the padded batch, packed
    if family == "gptoss":  # the sinks are trained too
        assert any("sinks" in n and ours[n].abs().sum() > 0 for n in ours)


def packed_batch(lengths, **collator_kw):
    feats = [{"input_ids": tokens(1, n, seed=10 + i)[0].tolist()}
             for i, n in enumerate(lengths)]
    batch = DataCollatorWithFlattening(**collator_kw)(feats, return_tensors="pt")
    return feats, batch


@pytest.mark.parametrize("kwargs", ["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_equal_one_by_one(family, kwargs):
    m = model(family)
    lengths = [5, 17, 1, 11]
    feats, batch = packed_batch(lengths, return_flash_attn_kwargs=kwargs == "cu_seq_lens")
    batch.pop("labels")
    with Ran() as ran:
        packed = logits(m, NAME, **batch)[0]
    assert "flashsdpa::flash_attn_varlen_fwd" in ran.ops
    alone = torch.cat([logits(m, "eager", torch.tensor([f["input_ids"]]))[0] for f in feats])
    assert (packed - alone).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "gptoss"])
def test_packed_training_step_equals_the_padded_batch(family):
    """DataCollatorWithFlattening's packed step against eager on the same sequences padded (the
    same mean loss: each sequence's first token is no label in either)."""
    m = model(family)
    lengths = [9, 30, 4, 20]
    feats, batch = packed_batch(lengths, return_flash_attn_kwargs=True)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(feats):
        ids[i, :lengths[i]] = torch.tensor(f["input_ids"])
        mask[i, :lengths[i]] = 1
    ref = grads(m, "eager", input_ids=ids, attention_mask=mask,
                labels=ids.masked_fill(mask == 0, -100))
    with Ran() as ran:
        ours = grads(m, NAME, **batch)
    assert_close_grads(ours, ref)
    assert "flashsdpa::flash_attn_varlen_fwd" in ran.ops


@pytest.mark.parametrize("family", ["mistral", "gptoss"])
def test_a_custom_4d_mask_is_used_as_given(family):
    m = model(family)
    ids = tokens(2, 14)
    keep = torch.rand(2, 1, 14, 14, generator=torch.Generator().manual_seed(3)) < 0.7
    keep |= torch.eye(14, dtype=torch.bool)  # every row sees at least itself
    ref = logits(m, "eager", ids, attention_mask=torch.where(keep, 0.0, torch.finfo().min))
    with Ran() as ran:
        out = logits(m, NAME, ids, attention_mask=torch.where(keep, 0.0, torch.finfo().min))
    assert (out - ref).abs().max() <= 1e-4
    assert "flashsdpa::sdpa" in ran.ops


def test_a_mask_with_holes_is_not_packed():
    """Packing rows of a mask with holes would shift the windows: the mask path serves it."""
    m = model("mistral")
    ids = tokens(2, 20)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 6:9] = 0
    ref = logits(m, "eager", ids, attention_mask=mask)
    with Ran() as ran:
        out = logits(m, NAME, ids, attention_mask=mask)
    assert (out - ref)[mask.bool()].abs().max() <= 1e-4
    assert "flashsdpa::sdpa" in ran.ops and "flashsdpa::flash_attn_varlen_fwd" not in ran.ops


def test_mask_functions_of_the_model_give_transformers_own_mask():
    import inspect

    from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

    def odd_keys(b, h, q, kv):
        return kv % 2 == 1

    # the mask interface's arguments changed in transformers 5.x (cache_position -> q_length)
    if "q_length" in inspect.signature(sdpa_mask).parameters:
        size = dict(batch_size=2, q_length=6, kv_length=6)
    else:
        size = dict(batch_size=2, cache_position=torch.arange(6), kv_length=6)
    fn = and_masks(causal_mask_function, odd_keys)
    ours = flashsdpa.hf.attention_mask(use_vmap=True, mask_function=fn, **size)
    assert torch.equal(ours, sdpa_mask(allow_is_causal_skip=False, use_vmap=True,
                                       mask_function=fn, **size))
    # without them: no mask (causality is a kernel argument) or the 2-D padding mask
    assert flashsdpa.hf.attention_mask(**size) is None
    pad = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6], dtype=torch.bool)
    assert torch.equal(flashsdpa.hf.attention_mask(attention_mask=pad, **size), pad)


def test_output_attentions_is_refused_by_name():
    m = model("llama")
    m.set_attn_implementation(NAME)
    with pytest.raises(ValueError, match="output_attentions"):
        m(tokens(1, 5), output_attentions=True)


@pytest.mark.parametrize("name", ["flash_cpu", "my_sdpa", "", None])
def test_register_refuses_names_transformers_treats_specially(name):
    with pytest.raises(ValueError, match="name"):
        flashsdpa.hf.register(name)


def test_register_another_name_serves_too():
    assert flashsdpa.hf.register("fused_cpu") == "fused_cpu"
    m = model("gemma2")
    ids = tokens(1, 12)
    assert (logits(m, "fused_cpu", ids) - logits(m, "eager", ids)).abs().max() <= 1e-4


@pytest.mark.parametrize("found", [None, "4.55.4"])
def test_missing_or_old_transformers_names_the_version_needed(monkeypatch, found):
    def version(dist):
        if found is None:
            raise importlib.metadata.PackageNotFoundError(dist)
        return found

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(ImportError, match=r"transformers >= 4\.56"):
        flashsdpa.hf.register()


def test_importing_flashsdpa_never_imports_transformers():
    code = ("import sys, flashsdpa, flashsdpa.hf; "
            "assert 'transformers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_compiled_model_equals_eager():
    """torch.compile (not fullgraph: the padding and packing checks read tensor values, graph
    breaks)."""
    m = model("gemma2")
    ids, mask = tokens(2, 20), padding(2, 20, "left")
    ref = logits(m, "eager", ids, attention_mask=mask)
    m.set_attn_implementation(NAME)
    compiled = torch.compile(m)
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).logits
    assert (out - ref)[mask.bool()].abs().max() <= 1e-4
