"""Random weights for a Llama config in the Hugging Face layout (bf16 safetensors), and one
long JSONL document of random token ids: a model of a real shape without downloading one.

    python3 bench/random_llama.py CONFIG.json OUT_DIR DATA.jsonl
"""
import json, os, sys, torch
from safetensors.torch import save_file
config, out, data = sys.argv[1:4]
cfg = json.load(open(config))
os.makedirs(out, exist_ok=True)
json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
h, f, layers, vocab = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
g = torch.Generator(device="cuda").manual_seed(0)
def w(*shape):
    return (torch.randn(*shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16).cpu()
heads = cfg["num_attention_heads"]
kv = cfg.get("num_key_value_heads", heads) * cfg.get("head_dim", h // heads)  # grouped-query keys/values
ones = lambda: torch.ones(h, dtype=torch.bfloat16)
t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": ones(), "lm_head.weight": w(vocab, h)}
for i in range(layers):
    p = f"model.layers.{i}."
    t[p + "self_attn.q_proj.weight"], t[p + "self_attn.o_proj.weight"] = w(h, h), w(h, h)
    t[p + "self_attn.k_proj.weight"], t[p + "self_attn.v_proj.weight"] = w(kv, h), w(kv, h)
    t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(f, h), w(f, h)
    t[p + "mlp.down_proj.weight"] = w(h, f)
    t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = ones(), ones()
save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
ids = torch.randint(3, vocab, (1 << 20,), generator=torch.Generator().manual_seed(1)).tolist()
open(data, "w").write(json.dumps({"input_ids": ids}) + "\n")
