"""The random tiny LLaMA most tests run on: float64, vocabulary 50, width 32, 4 query heads over
2 KV heads of width 8, untied, end token 0. Its query weights are scaled by 4 so that attention is
peaked: eviction rules then disagree and prototypes sit far from the exact tokens."""
import torch

from model import Config, Llama


def tiny(seed=0, L=3, H=4, G=2, sdpa=True, bias=False):
    torch.manual_seed(seed)
    cfg = Config(vocab_size=50, dim=32, n_layers=L, n_heads=H, n_kv_heads=G, head_dim=8,
                 hidden_dim=48, max_seq_len=256, tie_embeddings=False, attention_bias=bias, eos_ids=(0,))
    m = Llama(cfg, sdpa=sdpa).double().eval()
    with torch.no_grad():
        for blk in m.layers:
            blk.self_attn.q_proj.weight.mul_(4)
    return m
