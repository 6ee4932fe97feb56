"""Small random-weight models of four families, for the examples (they run offline, in
seconds; with a real checkpoint, from_pretrained replaces build)."""
import torch
import transformers

# family -> (config class, what the family adds: windows, softcap, sinks + experts)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=64)),
    "gemma2": ("Gemma2Config", dict(sliding_window=64, attn_logit_softcapping=50.0,
                                    query_pre_attn_scalar=64)),
    "gptoss": ("GptOssConfig", dict(sliding_window=64, num_local_experts=4,
                                    num_experts_per_tok=2)),
}


def build(family, attn_implementation, dtype=torch.float32):
    """A 4-layer model of `family` (hidden 256, 4 heads of 64, 2 kv heads, vocab 1024)."""
    cls, own = FAMILIES[family]
    config = getattr(transformers, cls)(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, **own)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=dtype)
