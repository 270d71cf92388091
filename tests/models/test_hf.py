"""Hugging Face checkpoints in and out, against transformers' own models: tiny random Llama,
Mistral, Qwen2, GPT-2 and OPT models made by transformers load into ours with the same
logits in fp32, ours written load in transformers with the same logits, and a round trip
is bit-exact."""
import json

import pytest
import torch
import transformers

from shard.models import GPT, GPTConfig
from shard.models.hf import UnsupportedModel, config_from_hf, from_pretrained, save_pretrained

TOLERANCE = 1e-4   # max abs logit difference in fp32 (the target)
COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def hf_config(kind: str):
    rope = dict(rope_theta=500000.0)
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, num_key_value_heads=2, intermediate_size=40,
                                        max_position_embeddings=64, rope_scaling=LLAMA3_SCALING, **rope)
    if kind == "llama_tied":
        return transformers.LlamaConfig(**COMMON, intermediate_size=40, max_position_embeddings=64,
                                        tie_word_embeddings=True, rms_norm_eps=1e-5)
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, num_key_value_heads=1, intermediate_size=40,
                                          max_position_embeddings=64, sliding_window=None)
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON, num_key_value_heads=2, intermediate_size=40,
                                        max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    if kind == "opt":
        return transformers.OPTConfig(**COMMON, ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32)
    raise ValueError(kind)


def random_hf_model(kind: str, **settings):
    """A transformers model with every tensor random (its own init leaves biases at zero,
    which would hide a misplaced bias); `settings` change its config's."""
    torch.manual_seed(0)
    config = hf_config(kind)
    for key, value in settings.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def their_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def our_logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


KINDS = ["llama", "llama_tied", "mistral", "qwen2", "gpt2", "opt"]


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_models_load_with_their_logits(kind, tmp_path):
    theirs = random_hf_model(kind)
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    difference = (our_logits(ours, tokens) - their_logits(theirs, tokens)).abs().max().item()
    assert difference <= TOLERANCE, difference


@pytest.mark.parametrize("kind", KINDS)
def test_ours_written_load_in_transformers_with_our_logits(kind, tmp_path):
    """Through our export: Llama-shaped models as llama (or qwen2, with q, k, v biases), the
    others as gpt2 (OPT's offset positions and separate q, k, v become GPT-2's)."""
    random_hf_model(kind).save_pretrained(tmp_path / "in")
    ours = from_pretrained(tmp_path / "in")
    save_pretrained(ours, tmp_path / "out", dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    difference = (our_logits(ours, tokens) - their_logits(theirs, tokens)).abs().max().item()
    assert difference <= TOLERANCE, difference


@pytest.mark.parametrize("preset", ["tiny", "llama_tiny"])
def test_our_presets_export_and_come_back_bit_for_bit(preset, tmp_path):
    model = GPT(GPTConfig.preset(preset, vocab=96, context=32), seed=3)
    save_pretrained(model, tmp_path / "fp32", dtype=torch.float32, shard_bytes=64 << 10)
    assert (tmp_path / "fp32" / "model.safetensors.index.json").is_file()   # sharded beyond 64 KB
    back = from_pretrained(tmp_path / "fp32")
    ours = dict(model.named_parameters())
    for name, p in back.named_parameters():   # GPT-2 has biases: a bias-free model's come back zero
        assert torch.equal(p, ours[name]) if name in ours else not p.any(), name
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(2))
    assert (our_logits(model, tokens) - their_logits(theirs, tokens)).abs().max().item() <= TOLERANCE
    # the default export: bf16, what the values round to
    save_pretrained(model, tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    for name, p in from_pretrained(tmp_path / "bf16").named_parameters():
        assert torch.equal(p, ours[name].to(torch.bfloat16).float()) if name in ours else not p.any(), name


def test_a_model_on_the_meta_device_reads_each_parameter_when_asked(tmp_path):
    random_hf_model("llama").save_pretrained(tmp_path)
    eager = from_pretrained(tmp_path)
    lazy = from_pretrained(tmp_path, device="meta")
    assert all(p.device.type == "meta" for p in lazy.parameters())
    for name, p in eager.named_parameters():
        value = torch.empty_like(p)
        lazy.init_parameter(name, value)   # what the engine calls as it materializes a unit
        assert torch.equal(value, p), name


def test_bad_checkpoints_are_named_before_anything_is_allocated(tmp_path):
    with pytest.raises(UnsupportedModel, match="model_type 'bert' is not supported"):
        config_from_hf({"model_type": "bert"})
    with pytest.raises(UnsupportedModel, match="hidden_act='gelu'; this decoder supports 'silu'"):
        config_from_hf({**hf_config("llama").to_dict(), "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModel, match="rope scaling 'yarn' is not supported"):
        config_from_hf({**hf_config("llama").to_dict(), "rope_parameters": None,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    random_hf_model("llama").save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 44}))
    with pytest.raises(UnsupportedModel, match=r"model.layers.0.mlp.down_proj.weight has shape \[32, 40\], "
                                               r"expected \[32, 44\]"):
        from_pretrained(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        save_pretrained(GPT(GPTConfig.preset("tiny")), tmp_path / "out")
    with pytest.raises(UnsupportedModel, match="no Hugging Face architecture holds this model"):
        save_pretrained(GPT(GPTConfig.preset("tiny", positions="rotary")), tmp_path / "rotary")
    assert not (tmp_path / "rotary").exists() and not list(tmp_path.glob(".rotary*"))


def test_a_config_asked_of_a_checkpoint_may_only_shorten_its_context(tmp_path):
    """Another norm, tie or context past a sliding window would load the same tensors into
    another function of them, silently: refused, naming the field. A shorter context computes
    what transformers does on the positions it has."""
    from dataclasses import replace

    theirs_model = random_hf_model("llama")   # untied
    theirs_model.save_pretrained(tmp_path / "llama")
    cfg = config_from_hf(theirs_model.config.to_dict())[0]
    for change, named in ((dict(tied=True), "tied=False; got tied=True"), (dict(norm="layer"), "norm='rms'"),
                          (dict(context=128), "context=64; got context=128")):
        with pytest.raises(UnsupportedModel, match=named):
            from_pretrained(tmp_path / "llama", cfg=replace(cfg, **change))
    short = from_pretrained(tmp_path / "llama", cfg=replace(cfg, context=32, qkv_bias=False))   # None: as bias
    tokens = torch.randint(0, 96, (1, 32), generator=torch.Generator().manual_seed(3))
    assert (our_logits(short, tokens) - their_logits(theirs_model, tokens)).abs().max().item() <= TOLERANCE
    for kind in ("gpt2", "opt"):   # learned positions: the table's first rows (it was refused as a misfit)
        theirs_model = random_hf_model(kind)
        theirs_model.save_pretrained(tmp_path / kind)
        cfg = config_from_hf(theirs_model.config.to_dict())[0]
        short = from_pretrained(tmp_path / kind, cfg=replace(cfg, context=32))
        assert short.pos.weight.shape[0] == 32
        assert (our_logits(short, tokens) - their_logits(theirs_model, tokens)).abs().max().item() <= TOLERANCE
    # Mistral's sliding window of 8: its context is 8, and a longer one is refused
    random_hf_model("mistral", sliding_window=8).save_pretrained(tmp_path / "mistral")
    window = config_from_hf(json.loads((tmp_path / "mistral" / "config.json").read_text()))[0]
    assert window.context == 8
    with pytest.raises(UnsupportedModel, match="context=8; got context=32.*sliding_window"):
        from_pretrained(tmp_path / "mistral", cfg=replace(window, context=32))


def test_rope_scaling_named_default_is_no_scaling():
    """transformers writes {"rope_type": "default"} for unscaled rotary positions."""
    for key in ("rope_scaling", "rope_parameters"):
        cfg = config_from_hf({**hf_config("llama").to_dict(), "rope_parameters": None, "rope_scaling": None,
                              key: {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta": 500000.0})[0]
        assert cfg.rope_scaling is None and cfg.rope_theta == 500000.0


def test_a_weight_stored_as_integers_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    random_hf_model("llama").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="model.norm.weight is stored as I32"):
        from_pretrained(tmp_path)


def test_a_tied_checkpoint_may_store_its_head_only_as_a_copy_of_the_embedding(tmp_path):
    """config.json ties the head to the embedding, and the file stores a head too: a copy
    loads; another tensor is refused (transformers computes with the stored head, and the
    tied model would have computed with the embedding: logits 5 apart, silently)."""
    from safetensors.torch import load_file, save_file

    random_hf_model("llama_tied").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tokens = torch.randint(0, COMMON["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    before = from_pretrained(tmp_path)(tokens)
    embedding = tensors["model.embed_tokens.weight"]
    for head, loads in ((embedding.clone(), True), (embedding + 0.5, False)):
        save_file({**tensors, "lm_head.weight": head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
        if loads:
            assert torch.equal(from_pretrained(tmp_path)(tokens), before)
        else:
            with pytest.raises(UnsupportedModel, match="lm_head.weight differs from model.embed_tokens.weight, but "
                                                       "config.json ties them"):
                from_pretrained(tmp_path)


def test_export_writes_the_special_token_ids_it_is_given(tmp_path):
    model = GPT(GPTConfig.preset("llama_tiny", vocab=96, context=32), seed=1)
    save_pretrained(model, tmp_path / "m", tokens={"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": None})
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (2, 3) and "pad_token_id" not in config
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "m").eos_token_id == 3
    with pytest.raises(ValueError, match="eos_token_id=96 is not a token of this model's vocabulary of 96"):
        save_pretrained(model, tmp_path / "bad", tokens={"eos_token_id": 96})
    assert not (tmp_path / "bad").exists()


def test_tensors_are_written_a_block_of_rows_at_a_time(tmp_path, monkeypatch):
    """The writer casts and writes at most WRITE_BYTES of a tensor at once: at a few rows per
    block (and one element of a 1-D tensor), the file holds the same values."""
    from shard.models import hf

    monkeypatch.setattr(hf, "WRITE_BYTES", 100)
    model = GPT(GPTConfig.preset("llama_tiny", vocab=96, context=32), seed=5)
    save_pretrained(model, tmp_path / "m", dtype=torch.float32)
    ours = dict(model.named_parameters())
    for name, p in from_pretrained(tmp_path / "m").named_parameters():
        assert torch.equal(p, ours[name]), name


# (not llama_tied: a tied Llama stores no head, and without the key transformers reads it untied)
@pytest.mark.parametrize("kind", [k for k in KINDS if k != "llama_tied"])
def test_a_config_without_tie_word_embeddings_is_read_as_transformers_reads_it(kind, tmp_path):
    """save_pretrained always writes the key, but configs written by hand or by other tools
    may leave it out: its default is then each model type's, as transformers has it."""
    import json

    random_hf_model(kind).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config.pop("tie_word_embeddings", None)
    path.write_text(json.dumps(config))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert config_from_hf(config)[0].tied == theirs.config.tie_word_embeddings
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    difference = (our_logits(from_pretrained(tmp_path), tokens) - their_logits(theirs, tokens)).abs().max().item()
    assert difference <= TOLERANCE, difference
