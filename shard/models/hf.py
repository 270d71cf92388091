"""Hugging Face checkpoints in and out: a directory of `config.json` and `model.safetensors`
(or shards listed by `model.safetensors.index.json`), as `transformers` writes and reads it.

    model = from_pretrained("Llama-3.2-1B")                      # values read now, on the CPU
    model = from_pretrained("Llama-3.2-1B", device="meta")       # read by the engine, unit by unit
    save_pretrained(model, "out")                                # bf16, sharded beyond 2 GB

Architectures (`model_type`) read: llama, mistral and qwen2 (one decoder: RMSNorm, SwiGLU,
rotary positions, grouped-query attention), gpt2 and opt (LayerNorm, GELU or ReLU, learned
positions). Written: llama for models of the first kind, gpt2 for the second.

Our projections are fused where Hugging Face keeps them apart (shard/models/gpt.py): each
of our tensors is the rows of one or more of theirs (q, k and v; SwiGLU's gate and up),
GPT-2's Conv1D stores its weights transposed, and OPT's position table starts two rows in.
`Mapping` says, for one architecture and shape, which of their tensors make each of ours.

Reading is lazy: `weights(name, tensor)` fills one of our parameters from the memory-mapped
files when it is asked for, so a model on the meta device that the engine materializes a
unit at a time never holds more than that unit. Writing streams the same way: the files'
layout (every tensor's shape, dtype and offset) follows from the config alone, so each
tensor is written where it belongs as it arrives and then dropped.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable, Optional, Union

import torch

from runkit.files import fsync_dir
from shard.models.gpt import GPT, GPTConfig, RopeScaling

SHARD_BYTES = 2 << 30   # the largest safetensors file written; an index lists them beyond one
WRITE_BYTES = 32 << 20  # the writer's buffer: rows of a tensor cast to the file's dtype at once
NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}   # safetensors' dtype names
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
FLOATS = ("F64", "F32", "F16", "BF16")   # what a weight may be stored as (read into ours, rounded as a cast)
# tensors some checkpoints carry that are buffers, not weights: recomputed here
BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class UnsupportedModel(ValueError):
    """A checkpoint this decoder cannot hold: another architecture, or an option it lacks."""


@dataclass(frozen=True)
class Part:
    """Rows `rows` of our parameter come from their tensor `key` (transposed: GPT-2's Conv1D;
    `skip`: rows of theirs before ours begin, OPT's position offset; `prefix`: ours may be
    their first rows only, a learned position table of which a shorter context uses the
    first)."""
    key: str
    rows: tuple[int, Optional[int]]
    transposed: bool = False
    skip: int = 0
    prefix: bool = False


class Mapping:
    """Which of their tensors make each of our parameters, for one model."""

    def __init__(self, cfg: GPTConfig, arch: str):
        self.cfg, self.arch = cfg, arch
        self.parts: dict[str, list[Part]] = {}
        self.zeros: dict[str, str] = {}   # their biases a bias-free model lacks (written as zeros): whose
        getattr(self, "_" + arch)(cfg)

    def _add(self, ours: str, *keys: str, sizes: Optional[list[int]] = None, **how) -> None:
        """Our `ours` is their `keys` stacked by rows, `sizes` rows each (one key: all of it)."""
        bounds = [0, *itertools.accumulate(sizes)] if sizes else [0, None]
        self.parts[ours] = [Part(k, (a, b), **how) for k, a, b in zip(keys, bounds, bounds[1:])]

    def _llama(self, c: GPTConfig) -> None:
        q, kv = c.heads * c.head_size, c.kv * c.head_size
        self._add("embed.weight", "model.embed_tokens.weight")
        for i in range(c.layers):
            ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
            self._add(ours + "ln1.weight", theirs + "input_layernorm.weight")
            for kind in ("weight", "bias") if c.qkv_biased else ("weight",):
                self._add(ours + f"attn.qkv.{kind}", *(theirs + f"self_attn.{p}_proj.{kind}" for p in "qkv"),
                          sizes=[q, kv, kv])
            self._add(ours + "attn.proj.weight", theirs + "self_attn.o_proj.weight")
            self._add(ours + "ln2.weight", theirs + "post_attention_layernorm.weight")
            self._add(ours + "mlp.up.weight", theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight",
                      sizes=[c.ffn, c.ffn])
            self._add(ours + "mlp.down.weight", theirs + "mlp.down_proj.weight")
        self._add("norm.weight", "model.norm.weight")
        if not c.tied:
            self._add("head.weight", "lm_head.weight")

    def _gpt2(self, c: GPTConfig) -> None:
        self._add("embed.weight", "transformer.wte.weight")
        self._add("pos.weight", "transformer.wpe.weight", prefix=True)
        for i in range(c.layers):
            ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
            for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
                self._affine(ours + a, theirs + b)
            for a, b in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"), ("mlp.up", "mlp.c_fc"),
                         ("mlp.down", "mlp.c_proj")):
                self._affine(ours + a, theirs + b, transposed=True)   # GPT-2's Conv1D: [in, out]
        self._affine("norm", "transformer.ln_f")
        if not c.tied:
            self._add("head.weight", "lm_head.weight")

    def _affine(self, ours: str, theirs: str, transposed: bool = False) -> None:
        """A weight and its bias; GPT-2 has biases everywhere, so a model without them
        writes zeros."""
        self._add(ours + ".weight", theirs + ".weight", transposed=transposed)
        if self.cfg.bias:
            self._add(ours + ".bias", theirs + ".bias")
        else:
            self.zeros[theirs + ".bias"] = ours + ".weight"

    def _opt(self, c: GPTConfig) -> None:
        base = "model.decoder."
        self._add("embed.weight", base + "embed_tokens.weight")
        self._add("pos.weight", base + "embed_positions.weight", skip=2, prefix=True)
        for i in range(c.layers):
            ours, theirs = f"blocks.{i}.", f"{base}layers.{i}."
            for a, b in (("ln1", "self_attn_layer_norm"), ("ln2", "final_layer_norm")):
                for kind in ("weight", "bias"):
                    self._add(f"{ours}{a}.{kind}", f"{theirs}{b}.{kind}")
            for kind in ("weight", "bias"):
                self._add(ours + f"attn.qkv.{kind}", *(theirs + f"self_attn.{p}_proj.{kind}" for p in "qkv"),
                          sizes=[c.width] * 3)
                for a, b in (("attn.proj", "self_attn.out_proj"), ("mlp.up", "fc1"), ("mlp.down", "fc2")):
                    self._add(f"{ours}{a}.{kind}", f"{theirs}{b}.{kind}")
        for kind in ("weight", "bias"):
            self._add(f"norm.{kind}", f"{base}final_layer_norm.{kind}")
        if not c.tied:
            self._add("head.weight", "lm_head.weight")


# --- configs -----------------------------------------------------------------------------

def _rope(hf: dict) -> tuple[float, Optional[RopeScaling]]:
    """rope theta and scaling from a config of either transformers generation (rope_theta and
    rope_scaling, or rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":   # transformers' name for no scaling
        return theta, None
    if kind != "llama3":
        raise UnsupportedModel(f"rope scaling {kind!r} is not supported; expected none or 'llama3'")
    return theta, RopeScaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                              float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))


def _refuse(hf: dict, **expected) -> None:
    for key, value in expected.items():
        if key in hf and hf[key] != value and not (value is None and not hf[key]):
            raise UnsupportedModel(f"config.json sets {key}={hf[key]!r}; this decoder supports {value!r} only")


def _llama_config(hf: dict) -> GPTConfig:
    _refuse(hf, hidden_act="silu", attention_bias=False, mlp_bias=False, use_sliding_window=False)
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, width // heads):
        raise UnsupportedModel(f"head_dim {hf['head_dim']} differs from hidden_size / num_attention_heads "
                               f"= {width // heads}; this decoder derives it")
    theta, scaling = _rope(hf)
    context = hf["max_position_embeddings"]
    if hf["model_type"] == "mistral" and hf.get("sliding_window"):
        context = min(context, hf["sliding_window"])   # within the window, sliding attention is full attention
    kv = hf.get("num_key_value_heads") or heads
    return GPTConfig(vocab=hf["vocab_size"], context=context, width=width, layers=hf["num_hidden_layers"],
                     heads=heads, kv_heads=None if kv == heads else kv, hidden=hf["intermediate_size"],
                     mlp="swiglu", norm="rms", norm_eps=float(hf.get("rms_norm_eps", 1e-6)), positions="rotary",
                     rope_theta=theta, rope_scaling=scaling, bias=False, qkv_bias=hf["model_type"] == "qwen2" or None,
                     tied=bool(hf.get("tie_word_embeddings", False)))


ACTIVATIONS_IN = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


def _activation(name: str) -> str:
    if name not in ACTIVATIONS_IN:
        raise UnsupportedModel(f"activation_function {name!r} is not supported; expected one of "
                               f"{sorted(ACTIVATIONS_IN)}")
    return ACTIVATIONS_IN[name]


def _gpt2_config(hf: dict) -> GPTConfig:
    _refuse(hf, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, add_cross_attention=False)
    width = hf["n_embd"]
    return GPTConfig(vocab=hf["vocab_size"], context=hf["n_positions"], width=width, layers=hf["n_layer"],
                     heads=hf["n_head"], hidden=hf.get("n_inner") or 4 * width,
                     mlp=_activation(hf.get("activation_function", "gelu_new")),
                     norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), bias=True, positions="learned",
                     tied=bool(hf.get("tie_word_embeddings", True)))


def _opt_config(hf: dict) -> GPTConfig:
    _refuse(hf, do_layer_norm_before=True, enable_bias=True, layer_norm_elementwise_affine=True,
            _remove_final_layer_norm=False, word_embed_proj_dim=hf["hidden_size"])
    return GPTConfig(vocab=hf["vocab_size"], context=hf["max_position_embeddings"], width=hf["hidden_size"],
                     layers=hf["num_hidden_layers"], heads=hf["num_attention_heads"], hidden=hf["ffn_dim"],
                     mlp=_activation(hf.get("activation_function", "relu")), bias=True, positions="learned",
                     tied=bool(hf.get("tie_word_embeddings", True)))


READERS = {"llama": (_llama_config, "llama"), "mistral": (_llama_config, "llama"),
           "qwen2": (_llama_config, "llama"), "gpt2": (_gpt2_config, "gpt2"), "opt": (_opt_config, "opt")}


def config_from_hf(hf: dict) -> tuple[GPTConfig, str]:
    """Our config, and the tensor layout's name, from a config.json's contents."""
    kind = hf.get("model_type")
    if kind not in READERS:
        raise UnsupportedModel(f"model_type {kind!r} is not supported; expected one of {sorted(READERS)}")
    read, arch = READERS[kind]
    try:
        return read(hf), arch
    except KeyError as e:
        raise UnsupportedModel(f"config.json of a {kind} model lacks {e.args[0]!r}") from None


def export_arch(cfg: GPTConfig) -> str:
    """The architecture a model is written as: llama (RMSNorm, SwiGLU, rotary), gpt2 (LayerNorm,
    learned positions, one head per k and v)."""
    if cfg.norm == "rms" and cfg.mlp == "swiglu" and cfg.positions == "rotary" and not cfg.bias:
        return "llama"
    if cfg.norm == "layer" and cfg.mlp != "swiglu" and cfg.positions == "learned" and cfg.kv == cfg.heads:
        return "gpt2"
    raise UnsupportedModel(f"no Hugging Face architecture holds this model ({cfg.norm} norm, {cfg.mlp} MLP, "
                           f"{cfg.positions} positions, bias={cfg.bias}): llama takes RMSNorm, SwiGLU and "
                           "rotary positions without biases; gpt2 LayerNorm, GELU or ReLU and learned positions")


ACTIVATIONS_OUT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def config_to_hf(cfg: GPTConfig, dtype: torch.dtype) -> dict:
    """config.json for a model of ours, in the keys transformers has read since 4.x."""
    common = {"vocab_size": cfg.vocab, "tie_word_embeddings": cfg.tied, "torch_dtype": str(dtype).split(".")[1]}
    if export_arch(cfg) == "llama":
        r = cfg.rope_scaling
        scaling = None if r is None else {
            "rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor, "original_max_position_embeddings": r.original_context}
        arch = "Qwen2ForCausalLM" if cfg.qkv_biased else "LlamaForCausalLM"
        return {"architectures": [arch], "model_type": "qwen2" if cfg.qkv_biased else "llama",
                "hidden_size": cfg.width, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.layers,
                "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv, "head_dim": cfg.head_size,
                "max_position_embeddings": cfg.context, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
                "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "attention_bias": False,
                "mlp_bias": False, **common}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": cfg.width, "n_layer": cfg.layers,
            "n_head": cfg.heads, "n_inner": cfg.ffn, "n_positions": cfg.context,
            "activation_function": ACTIVATIONS_OUT[cfg.mlp], "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **common}


# --- reading -----------------------------------------------------------------------------

class Checkpoint:
    """A Hugging Face model directory: its config and its tensors, memory-mapped, read one at a time."""

    def __init__(self, path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path} is not a Hugging Face model directory: it has no config.json")
        self.hf = json.loads((self.path / "config.json").read_text())
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            files = None
        else:
            raise FileNotFoundError(f"{self.path} has neither model.safetensors nor model.safetensors.index.json "
                                    "(PyTorch .bin checkpoints are not read: convert them to safetensors)")
        from safetensors import safe_open

        names = sorted(set(files.values())) if files else ["model.safetensors"]
        self._files = {name: safe_open(self.path / name, framework="pt", device="cpu") for name in names}
        self.where = {key: self._files[name] for name in names for key in self._files[name].keys()}

    def key(self, key: str) -> Optional[str]:
        """Their key as this checkpoint spells it: with the base model's prefix or without
        (GPT-2's `h.0...` beside `transformer.h.0...`, OPT's `decoder.` beside `model.decoder.`)."""
        for spelled in (key, key.split(".", 1)[1]):
            if spelled in self.where:
                return spelled
        return None

    def shape(self, key: str) -> list[int]:
        return list(self.where[key].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """Its safetensors dtype name: F32, BF16, I64, ..."""
        return self.where[key].get_slice(key).get_dtype()

    def tensor(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)


class Weights:
    """Fills our parameters from a checkpoint, each when asked (GPT's `weights`)."""

    def __init__(self, checkpoint: Checkpoint, mapping: Mapping):
        self.checkpoint, self.mapping = checkpoint, mapping

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.mapping.parts:
            raise KeyError(f"{name} has no tensor in {self.checkpoint.path}")
        for part in self.mapping.parts[name]:
            value = self.checkpoint.tensor(self.checkpoint.key(part.key))[part.skip:]
            value = value.t() if part.transposed else value
            value = value[:len(tensor)] if part.prefix else value
            a, b = part.rows
            tensor[a:b].copy_(value)


def check(checkpoint: Checkpoint, mapping: Mapping, model: GPT) -> None:
    """Every parameter of `model` has its tensors in the checkpoint with the shapes it needs,
    and the checkpoint has no weight the model lacks: else UnsupportedModel naming the keys
    and both shapes. Reads the files' headers only, and a tied model's stored head with the
    embedding it must equal."""
    problems = []
    used = set()
    for name, p in model.named_parameters():
        for part in mapping.parts[name]:
            key = checkpoint.key(part.key)
            if key is None:
                problems.append(f"{part.key} is missing (for our {name})")
                continue
            used.add(key)
            if checkpoint.dtype(key) not in FLOATS:
                problems.append(f"{key} is stored as {checkpoint.dtype(key)}, expected one of {FLOATS}")
            shape = checkpoint.shape(key)
            shape = shape[::-1] if part.transposed else [shape[0] - part.skip, *shape[1:]]
            a, b = part.rows
            want = [p.shape[0] if b is None else b - a, *p.shape[1:]]
            if part.prefix and shape[0] >= want[0]:
                shape[0] = want[0]
            if shape != want:
                problems.append(f"{key} has shape {checkpoint.shape(key)}, expected {want} (rows {a}..{b} of "
                                f"our {name} {list(p.shape)}{', transposed' if part.transposed else ''})")
    head = checkpoint.key("lm_head.weight") if model.cfg.tied else None
    if head is not None:   # a tied checkpoint that stores its head too: only a copy of the embedding is
        embedding = checkpoint.key(mapping.parts["embed.weight"][0].key)
        if embedding is not None and checkpoint.shape(head) == checkpoint.shape(embedding) and \
                not torch.equal(checkpoint.tensor(head), checkpoint.tensor(embedding)):
            problems.append(f"{head} differs from {embedding}, but config.json ties them (tie_word_embeddings): "
                            "transformers computes with the stored head and this model would compute with the "
                            "embedding; set tie_word_embeddings to false, or drop the stored head")
    unused = sorted(k for k in set(checkpoint.where) - used - {head} if not k.endswith(BUFFERS))
    if unused:
        problems.append(f"tensors this model has no place for: {unused[:6]}{' ...' if len(unused) > 6 else ''}")
    if problems:
        raise UnsupportedModel(f"{checkpoint.path} does not fit the model its config.json describes: "
                               + "; ".join(problems))


def fit(theirs: GPTConfig, cfg: GPTConfig) -> None:
    """`cfg` may differ from a checkpoint's config `theirs` only where its weights still
    compute the model they were trained as: a shorter context. Any other change (a norm, a
    tie, a context past a sliding window) would load the tensors into another function of
    them, silently: UnsupportedModel naming each field."""
    meant = {"kv_heads": "kv", "hidden": "ffn", "qkv_bias": "qkv_biased"}   # None: a default these resolve
    changed = [f.name for f in fields(GPTConfig)
               if getattr(cfg, meant.get(f.name, f.name)) != getattr(theirs, meant.get(f.name, f.name))]
    if cfg.context < theirs.context:
        changed.remove("context")
    if changed:
        raise UnsupportedModel(
            "the checkpoint's weights are a model with "
            + ", ".join(f"{n}={getattr(theirs, n)!r}" for n in changed)
            + "; got " + ", ".join(f"{n}={getattr(cfg, n)!r}" for n in changed)
            + ". Only a shorter context may be asked of it (a Mistral model's context is at most its "
              "sliding_window, within which its attention is full attention)")


def from_pretrained(path, device="cpu", cfg: Optional[GPTConfig] = None) -> GPT:
    """Our model from a Hugging Face directory. On the meta device it holds no values:
    the engine materializes it a unit at a time, each parameter read from the files then
    (GPT.init_parameter calls the model's `weights`). `cfg`: the config.json's, changed
    where the weights allow (`fit`: a shorter context). Checked against the files' headers
    before anything is allocated."""
    checkpoint = Checkpoint(path)
    theirs, arch = config_from_hf(checkpoint.hf)
    if cfg is None:
        cfg = theirs
    fit(theirs, cfg)
    mapping = Mapping(cfg, arch)
    with torch.device("meta"):
        check(checkpoint, mapping, GPT(cfg))
    with torch.device(device):
        return GPT(cfg, weights=Weights(checkpoint, mapping))


# --- writing -----------------------------------------------------------------------------

@dataclass
class _Entry:
    key: str
    shape: list[int]
    file: str = ""
    start: int = 0
    written: bool = False


class Writer:
    """Writes a model's tensors into safetensors files whose layout is fixed up front from its
    config, each tensor as it arrives (`write(name, tensor)` with our names, any order); then
    `close()` checks that all came and moves the directory into place."""

    def __init__(self, cfg: GPTConfig, path, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = SHARD_BYTES,
                 beside: Optional[dict] = None, tokens: Optional[dict] = None):
        if dtype not in NAMES:
            raise ValueError(f"dtype must be one of {list(NAMES)}, got {dtype}")
        self.cfg, self.dtype, self.path = cfg, dtype, Path(path)
        self.beside = dict(beside or {})   # name -> file, copied in beside the weights
        self.tokens = special_tokens(tokens, cfg.vocab)
        if self.path.exists() and any(self.path.iterdir()):
            raise FileExistsError(f"{self.path} exists and is not empty: name a new directory")
        self.arch = export_arch(cfg)
        self.mapping = Mapping(cfg, self.arch)
        with torch.device("meta"):
            shapes = {n: list(p.shape) for n, p in GPT(cfg).named_parameters()}
        self.entries: dict[str, _Entry] = {}
        for name, parts in self.mapping.parts.items():
            for part in parts:
                a, b = part.rows
                shape = [shapes[name][0] if b is None else b - a, *shapes[name][1:]]
                self.entries[part.key] = _Entry(part.key, shape[::-1] if part.transposed else shape)
        for key, weight in self.mapping.zeros.items():   # a bias has the weight's output rows
            self.entries[key] = _Entry(key, shapes[weight][:1])
        self._layout(shard_bytes)
        self.tmp = self.path.parent / f".{self.path.name}.partial-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self._open, self._data_start = {}, {}
        for name, header in self._headers().items():
            self._open[name] = open(self.tmp / name, "wb")
            self._open[name].write(header)
            self._data_start[name] = len(header)
        for key in self.mapping.zeros:
            self._put(key, torch.zeros(self.entries[key].shape))

    def _layout(self, shard_bytes: int) -> None:
        size = torch.empty((), dtype=self.dtype).element_size()
        files, used = [[]], 0
        for e in self.entries.values():
            n = math.prod(e.shape) * size
            if used and used + n > shard_bytes:
                files.append([])
                used = 0
            files[-1].append(e)
            used += n
        for i, group in enumerate(files):
            name = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            start = 0
            for e in group:
                e.file, e.start = name, start
                start += math.prod(e.shape) * size
        self.files = [group[0].file for group in files]
        self.total = sum(math.prod(e.shape) * size for e in self.entries.values())

    def _headers(self) -> dict[str, bytes]:
        size = torch.empty((), dtype=self.dtype).element_size()
        headers = {}
        for name in self.files:
            header = {"__metadata__": {"format": "pt"}}
            for e in self.entries.values():
                if e.file == name:
                    header[e.key] = {"dtype": NAMES[self.dtype], "shape": e.shape,
                                     "data_offsets": [e.start, e.start + math.prod(e.shape) * size]}
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)   # the data 8-byte aligned, as safetensors writes it
            headers[name] = len(text).to_bytes(8, "little") + text
        return headers

    def _put(self, key: str, value: torch.Tensor) -> None:
        e = self.entries[key]
        if list(value.shape) != e.shape:
            raise ValueError(f"{key}: got shape {list(value.shape)}, expected {e.shape}")
        f = self._open[e.file]
        f.seek(self._data_start[e.file] + e.start)
        # cast and written a block of rows at a time: beside the tensor, one block in the file's dtype
        rows = max(1, WRITE_BYTES // max(1, value[0].numel() * value.element_size()))
        for start in range(0, value.shape[0], rows):
            block = value[start:start + rows].to(self.dtype).contiguous()
            f.write(block.reshape(-1).view(torch.uint8).numpy())   # its buffer: no copy
        e.written = True

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """One of our parameters, by its name in the model, in any dtype and on any device."""
        if name not in self.mapping.parts:
            raise KeyError(f"{name} is not a parameter of this model; expected one of "
                           f"{list(self.mapping.parts)[:4]} ...")
        tensor = tensor.detach().cpu()
        for part in self.mapping.parts[name]:
            a, b = part.rows
            value = tensor[a:b]
            self._put(part.key, value.t() if part.transposed else value)

    def close(self) -> Path:
        missing = [e.key for e in self.entries.values() if not e.written]
        for f in self._open.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if missing:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise ValueError(f"export incomplete: {len(missing)} tensors never came, such as {missing[:4]}")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {e.key: e.file for e in self.entries.values()}}
            (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        config = {**config_to_hf(self.cfg, self.dtype), **self.tokens}
        (self.tmp / "config.json").write_text(json.dumps(config, indent=1))
        if self.tokens:   # what transformers' generate() reads first: without eos_token_id it never stops
            (self.tmp / "generation_config.json").write_text(json.dumps(self.tokens, indent=1))
        for name, source in self.beside.items():
            shutil.copyfile(source, self.tmp / name)
        fsync_dir(self.tmp)
        if self.path.exists():
            self.path.rmdir()   # empty (checked before writing)
        self.tmp.rename(self.path)
        fsync_dir(self.path.parent)
        return self.path


def special_tokens(tokens: Optional[dict], vocab: int) -> dict:
    """The special-token ids config.json carries (bos_token_id, eos_token_id, pad_token_id),
    checked: each a token of the model's vocabulary."""
    tokens = {k: v for k, v in (tokens or {}).items() if v is not None}
    for key, value in tokens.items():
        if key not in SPECIAL_TOKENS:
            raise ValueError(f"unknown special token {key!r}; expected one of {SPECIAL_TOKENS}")
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
            raise ValueError(f"{key}={value!r} is not a token of this model's vocabulary of {vocab}")
    return tokens


def save_pretrained(model: Union[GPT, tuple[GPTConfig, Iterable[tuple[str, torch.Tensor]]]], path,
                    dtype: torch.dtype = torch.bfloat16, shard_bytes: int = SHARD_BYTES,
                    beside: Optional[dict] = None, tokens: Optional[dict] = None) -> Path:
    """Write `model` (a GPT, or a config and its parameters' (name, tensor) pairs, which may
    come one at a time from a generator) as a Hugging Face directory at `path`: config.json
    and safetensors files of at most `shard_bytes` each, with an index beyond one, and the
    files `beside` maps names to (a tokenizer's). `tokens`: the tokenizer's special ids
    (bos_token_id, eos_token_id, pad_token_id), written into config.json and
    generation_config.json, without which transformers' generate() never stops at the end
    of a text. The directory appears whole or not at all."""
    cfg, tensors = (model.cfg, model.named_parameters()) if isinstance(model, GPT) else model
    writer = Writer(cfg, path, dtype, shard_bytes, beside, tokens)
    try:
        for name, tensor in tensors:
            writer.write(name, tensor)
    except BaseException:
        for f in writer._open.values():
            f.close()
        shutil.rmtree(writer.tmp, ignore_errors=True)
        raise
    return writer.close()

