"""Regenerate tests/golden/kvpress_kept.json: the kept sets of NVIDIA kvpress's own presses on a
tiny random Llama, for tests/test_oracle.py to compare with this project's kvpress conventions
(polykv.KVPRESS). Not part of the test suite; it needs kvpress and transformers, which the project
does not depend on:

    python -m venv /tmp/kvenv --system-site-packages && /tmp/kvenv/bin/pip install kvpress==0.5.5
    /tmp/kvenv/bin/python tests/golden/make_kvpress_golden.py

It writes the tiny checkpoint (tests/golden/tiny-llama/, made by this project's model.save from a
fixed seed, with a character-level tokenizer: id = the ASCII code, no chat template) and the kept
positions at compression ratio 0.5 of SnapKV, StreamingLLM, TOVA, K-norm and Expected Attention
(presses that shrink the cache: recovered by matching each kept key to the prompt's full keys),
and of AdaKV over SnapKV and KVzip (presses that mask: each head keeps what its
`masked_key_indices` do not name); and KVzip's once more on a copy of the folder given a chat
template (`kvzip_template`; the template is `chat_template` in the JSON): kvpress's KVzipPress
then skips the template's prefix and puts its suffix after the repeat instruction.
"""
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import model as M  # noqa: E402

T, RATIO, SEED = 200, 0.5, 0
# a chat template in SmolLM2's form, in the characters the tiny tokenizer knows
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_checkpoint(folder: Path):
    torch.manual_seed(SEED)
    cfg = M.Config(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   hidden_dim=96, max_seq_len=512, tie_embeddings=False, rope_theta=10000.0,
                   bos_id=None, eos_ids=(0,))
    m = M.Llama(cfg)
    with torch.no_grad():                      # peaked attention, so the presses disagree
        for blk in m.layers:
            blk.self_attn.q_proj.weight.mul_(4)
    M.save(m, folder)
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.BPE(vocab={chr(i): i for i in range(128)}, merges=[]))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def masked_kept(hf, name_or_path, press, ids):
    """Per layer and KV head the positions a masking press (AdaKV, KVzip) keeps on ids."""
    from transformers import DynamicCache
    hf.config.name_or_path = str(name_or_path)         # where KVzipPress reads the tokenizer
    cache = DynamicCache()
    with torch.no_grad(), press(hf):
        hf(ids, past_key_values=cache)
    G = hf.config.num_key_value_heads
    per_layer = []
    for l in range(hf.config.num_hidden_layers):
        _, heads, seqs = hf.model.layers[l].self_attn.masked_key_indices
        per_layer.append([sorted(set(range(T)) - set(seqs[heads == g].tolist())) for g in range(G)])
    return per_layer


def main():
    import shutil
    import tempfile

    import kvpress
    import transformers
    from transformers import DynamicCache, LlamaForCausalLM
    folder = HERE / "tiny-llama"
    tiny_checkpoint(folder)
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.randint(1, 128, (1, T), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        full = DynamicCache()
        hf(ids, past_key_values=full)
    presses = {"snapkv": kvpress.SnapKVPress(RATIO), "streaming": kvpress.StreamingLLMPress(RATIO),
               "tova": kvpress.TOVAPress(RATIO), "knorm": kvpress.KnormPress(RATIO),
               "expected": kvpress.ExpectedAttentionPress(RATIO),
               "adakv": kvpress.AdaKVPress(kvpress.SnapKVPress(RATIO)), "kvzip": kvpress.KVzipPress(RATIO)}
    kept = {}
    for name, press in presses.items():
        cache = DynamicCache()
        with torch.no_grad(), press(hf):
            hf(ids, past_key_values=cache)
        per_layer = []
        for l in range(hf.config.num_hidden_layers):
            if name in ("adakv", "kvzip"):              # masked, not removed: the complement per head
                _, heads, seqs = hf.model.layers[l].self_attn.masked_key_indices
                G = hf.config.num_key_value_heads
                per_layer.append([sorted(set(range(T)) - set(seqs[heads == g].tolist())) for g in range(G)])
                continue
            k_full, k_kept = full.layers[l].keys[0], cache.layers[l].keys[0]      # (G, T, D), (G, n, D)
            d = torch.cdist(k_kept, k_full, compute_mode="donot_use_mm_for_euclid_dist")   # (G, n, T)
            assert float(d.min(-1).values.max()) < 1e-5, "a kept key matches no prompt key"
            per_layer.append([sorted(row.tolist()) for row in d.argmin(-1)])
        kept[name] = per_layer
    with tempfile.TemporaryDirectory() as tmp:          # the same checkpoint with a chat template
        chat = Path(tmp) / "tiny-llama-chat"
        shutil.copytree(folder, chat)
        (chat / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        kept["kvzip_template"] = masked_kept(hf, chat, kvpress.KVzipPress(RATIO), ids)
    out = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
           "transformers": transformers.__version__, "torch": torch.__version__,
           "compression_ratio": RATIO, "T": T, "n_kept": len(kept["snapkv"][0][0]),
           "tokens": ids[0].tolist(), "kept": kept, "chat_template": CHAT_TEMPLATE}
    (HERE / "kvpress_kept.json").write_text(json.dumps(out))
    print(f"wrote {HERE / 'kvpress_kept.json'}: kvpress {out['kvpress']}, transformers {out['transformers']}")


if __name__ == "__main__":
    main()
