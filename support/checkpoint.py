"""Checkpoint files: Hugging Face model folders in and out, and the tokenizer.

A Hugging Face folder is `config.json`, `*.safetensors` (possibly sharded, with
`model.safetensors.index.json`) and `tokenizer.json`. This module only moves tensors and JSON
between such a folder and Python; model.py turns them into a network (`model.load`,
`model.save`). The embedded default (SmolLM2-135M-Instruct) is converted once into such a folder
by support/embedded.py, so the default and any real checkpoint are read the same way.

A folder that cannot be read (a config that is not a LLaMA/Qwen3 one, a damaged tokenizer or
weights file) is a one-line UsageError that says how to rebuild it. A converted folder records
what its conversion wrote (RECORD: each file's size and sha256); every load compares the sizes
(free: a truncated or half-copied file is refused before it is read), and model.load refuses
weights that are not finite.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from support.errors import UsageError

# what a conversion wrote, beside the files it describes: {"files": {name: {size, sha256}}}
RECORD = "converted.json"


def default_model_dir() -> Path:
    """Where the embedded default lives in HF layout: $POLYKV_CACHE or ~/.cache/polykv. An empty
    POLYKV_CACHE is unset (as XDG_CACHE_HOME is): `POLYKV_CACHE= cmd` uses ~/.cache/polykv,
    never the working directory."""
    root = Path(os.environ.get("POLYKV_CACHE") or "~/.cache/polykv").expanduser()
    return root / "SmolLM2-135M-Instruct"


def rebuild(path: Path) -> str:
    """How to rebuild a damaged model folder: a converted one (the embedded default) is deleted
    and converted again on the next run; any other is fetched or saved again."""
    if (path / RECORD).is_file() or path.absolute() == default_model_dir().absolute():
        return f"delete {str(path)!r} and rerun: the embedded model is converted again (once)"
    return "fetch or save the checkpoint again"


def record_files(path: Path):
    """Write RECORD: the size and sha256 of every file of the folder (after a conversion)."""
    files = {}
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.name != RECORD):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
        files[f.name] = {"size": f.stat().st_size, "sha256": h.hexdigest()}
    (path / RECORD).write_text(json.dumps({"files": files}, indent=1) + "\n")


def check_record(path: Path):
    """The sizes RECORD lists, against the files (a folder without RECORD: nothing to check)."""
    if not (path / RECORD).is_file():
        return
    try:
        files = json.loads((path / RECORD).read_text())["files"]
        sizes = {name: int(f["size"]) for name, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{str(path / RECORD)!r} is unreadable ({e}): {rebuild(path)}") from None
    for name, size in sizes.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            now = f"{f.stat().st_size} bytes" if f.is_file() else "missing"
            raise UsageError(f"{str(f)!r} is {now}, its conversion wrote {size} bytes: the folder "
                             f"is damaged; {rebuild(path)}")


def folder(path=None) -> Path:
    """The checked folder of a checkpoint; None = the embedded default (converted on first use)."""
    if path is None:
        from support.embedded import ensure_default_model
        path = ensure_default_model(default_model_dir())
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"model folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} has no config.json: not a Hugging Face model folder")
    if not sorted(path.glob("*.safetensors")):
        raise UsageError(f"{str(path)!r} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise UsageError(f"{str(path)!r} has no tokenizer.json")
    check_record(path)
    return path


def read_config(path: Path) -> dict:
    try:
        d = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{str(path / 'config.json')!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise UsageError(f"{str(path / 'config.json')!r} is not a JSON object: not a Hugging "
                         "Face config")
    return d


def read_weights(path: Path) -> dict:
    """Every shard's tensors by their Hugging Face names (the index only says which shard
    holds which tensor)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        try:
            sd.update(load_file(str(f)))
        except (OSError, SafetensorError) as e:
            raise UsageError(f"cannot read the weights {str(f)!r} ({e}): the file is damaged "
                             f"or not a safetensors file; {rebuild(path)}") from None
    return sd


def write(path, config: dict, sd: dict, shard_size: Optional[int] = None):
    """config.json + model.safetensors, or `shard_size` tensors per shard + the index."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    if shard_size is None:
        save_file(sd, str(path / "model.safetensors"))
        return
    names, index = sorted(sd), {}
    chunks = [names[i:i + shard_size] for i in range(0, len(names), shard_size)]
    for n, chunk in enumerate(chunks):
        fname = f"model-{n + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: sd[k] for k in chunk}, str(path / fname))
        index.update({k: fname for k in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}, indent=1))


# ----------------------------------------------------------------------------- config.json

def config_fields(d: dict) -> dict:
    """model.Config's fields from a Hugging Face config.json dict (LlamaForCausalLM or
    Qwen3ForCausalLM); anything else is a UsageError."""
    arch = (d.get("architectures") or ["?"])[0]
    if arch not in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        raise UsageError(
            f"unsupported architecture {arch!r}: only LlamaForCausalLM and Qwen3ForCausalLM"
        )
    eos = d.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    scaling = d.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("llama3", "default"):
            raise UsageError(f"unsupported rope_scaling type {kind!r}: only 'llama3'")
        scaling = None if kind == "default" else scaling
    return dict(
        vocab_size=d["vocab_size"], dim=d["hidden_size"], n_layers=d["num_hidden_layers"],
        n_heads=d["num_attention_heads"],
        n_kv_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        hidden_dim=d["intermediate_size"], rope_theta=float(d.get("rope_theta", 10000.0)),
        rope_scaling=scaling, rms_eps=d.get("rms_norm_eps", 1e-6),
        max_seq_len=d.get("max_position_embeddings", 2048),
        tie_embeddings=d.get("tie_word_embeddings", False),
        qk_norm=arch == "Qwen3ForCausalLM", attention_bias=d.get("attention_bias", False),
        bos_id=d.get("bos_token_id"), eos_ids=eos)


def hf_config(c: dict) -> dict:
    """The config.json dict of model.Config's fields c (the inverse of config_fields)."""
    eos = list(c["eos_ids"]) if len(c["eos_ids"]) != 1 else c["eos_ids"][0]
    return {"architectures": ["Qwen3ForCausalLM" if c["qk_norm"] else "LlamaForCausalLM"],
            "vocab_size": c["vocab_size"], "hidden_size": c["dim"],
            "num_hidden_layers": c["n_layers"], "num_attention_heads": c["n_heads"],
            "num_key_value_heads": c["n_kv_heads"], "head_dim": c["head_dim"],
            "intermediate_size": c["hidden_dim"], "rope_theta": c["rope_theta"],
            "rope_scaling": c["rope_scaling"], "rms_norm_eps": c["rms_eps"],
            "max_position_embeddings": c["max_seq_len"], "tie_word_embeddings": c["tie_embeddings"],
            "attention_bias": c["attention_bias"], "bos_token_id": c["bos_id"], "eos_token_id": eos}


# ----------------------------------------------------------------------------- tokenizer

class Tokenizer:
    """A thin wrapper over a Hugging Face `tokenizers` file: encode/decode, the special ids and,
    when the folder's tokenizer_config.json has one, the checkpoint's chat template (the one this
    project applies). `hf_chat_template` is the template transformers reads, which may also sit
    in chat_template.jinja (the embedded folder's does: support/embedded.py)."""

    def __init__(self, path: Path, bos_id: Optional[int] = None, eos_ids=()):
        from tokenizers import Tokenizer as _Tok
        folder = Path(path).parent
        try:
            self.tok = _Tok.from_file(str(path))
        except Exception as e:          # the tokenizers library raises a bare Exception
            raise UsageError(f"cannot read the tokenizer {str(path)!r} ({e}); "
                             f"{rebuild(folder)}") from None
        self.bos_id = bos_id
        self.eos_ids = set(eos_ids)
        self.eos_id = tuple(eos_ids)[0] if eos_ids else None
        cfg = Path(path).with_name("tokenizer_config.json")
        try:
            self.config = json.loads(cfg.read_text()) if cfg.is_file() else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{str(cfg)!r} is not valid JSON ({e}); {rebuild(folder)}") from None
        if not isinstance(self.config, dict):
            raise UsageError(f"{str(cfg)!r} is not a JSON object; {rebuild(folder)}")
        jinja = Path(path).with_name("chat_template.jinja")
        self.template_file = jinja.read_text() if jinja.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        # the tokenizer's own post-processor decides about BOS (Llama-3 adds it, SmolLM2 does not)
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def has_chat_template(self) -> bool:
        return bool(self.config.get("chat_template"))

    @property
    def hf_chat_template(self):
        """The chat template transformers' AutoTokenizer reads for this folder, or None:
        chat_template.jinja when the folder has one (transformers 5.2
        `PreTrainedTokenizerBase._from_pretrained`: "independent chat template file(s) ... take
        priority over template entries in the tokenizer config"), else tokenizer_config.json's."""
        return self.template_file or self.config.get("chat_template") or None

    def chat(self, user: str, template=None, **variables) -> str:
        """`user` as the one user turn of the checkpoint's chat template (or of `template`),
        with the generation prompt: the text transformers' `apply_chat_template(...,
        add_generation_prompt=True, **variables)` renders (jinja2 sandbox, trim_blocks,
        lstrip_blocks, loop controls). The text carries its own special tokens: encode it with
        add_special_tokens=False. Needs jinja2."""
        try:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise UsageError("this checkpoint's chat template needs jinja2 (pip install jinja2)")
        template = template or self.config["chat_template"]
        # [{"name": "default", "template": ...}, ...]
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}["default"]

        def special(k):
            """The special token `k` of the config: its text, or its "content" if a dict."""
            return (
                (self.config.get(k) or {}).get("content")
                if isinstance(self.config.get(k), dict)
                else self.config.get(k)
            )

        def raise_exception(message):
            raise UsageError(f"chat template: {message}")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.globals["raise_exception"] = raise_exception
        return env.from_string(template).render(
            messages=[{"role": "user", "content": user}], add_generation_prompt=True,
            bos_token=special("bos_token") or "", eos_token=special("eos_token") or "",
            **variables)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def __len__(self):
        return self.tok.get_vocab_size()
