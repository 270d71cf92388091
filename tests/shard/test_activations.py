"""The activation memory model against what autograd keeps: every tensor saved for the
backward during the forward pass, counted once per storage, parameters left out."""
import pytest
import torch

from shard.engine.engine import Engine
from shard.models.gpt import GPT, GPTConfig
from shard.planning.activations import activation_bytes


def saved_bytes(cfg: GPTConfig, micro_batch: int, seq_len: int, dtype: torch.dtype, checkpointing: bool) -> int:
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    if checkpointing:
        for block in model.blocks:
            Engine._checkpoint_activations(block)   # as the engine wraps its blocks
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t
    # the targets a storage apart from the inputs: autograd keeps the inputs (the embedding's
    # indices), not the targets
    x, y = (torch.randint(0, cfg.vocab, (micro_batch, seq_len)) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, targets=y)   # as shard-train computes it
    loss.backward()   # the graph is whole: what was kept is what the backward uses
    return sum(kept.values())


LLAMA = dict(positions="rotary", norm="rms", mlp="swiglu", kv_heads=2, hidden=176, tied=False)


@pytest.mark.parametrize("cfg", [GPTConfig(vocab=512, context=64, width=64, layers=2, heads=4),
                                 GPTConfig(vocab=1024, context=128, width=128, layers=3, heads=8)])
@pytest.mark.parametrize("family", [dict(positions="learned"), dict(positions="rotary"),
                                    dict(mlp="relu", bias=True, hidden=200), dict(mlp="gelu_tanh", tied=False),
                                    LLAMA, dict(LLAMA, kv_heads=None, qkv_bias=True)],
                         ids=["learned", "rotary", "opt", "gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_model_equals_what_autograd_keeps(cfg, family, dtype, checkpointing):
    cfg = GPTConfig(**{**cfg.__dict__, **family})
    micro_batch, seq_len = 2, cfg.context // 2
    element = torch.empty((), dtype=dtype).element_size()
    assert activation_bytes(cfg, micro_batch, seq_len, element, checkpointing) == \
        saved_bytes(cfg, micro_batch, seq_len, dtype, checkpointing)


def test_bad_shapes_are_named():
    cfg = GPTConfig()
    with pytest.raises(ValueError, match="seq_len 256 exceeds the model's context 128"):
        activation_bytes(cfg, 1, 256, 4)
    with pytest.raises(ValueError, match="micro_batch must be a positive integer"):
        activation_bytes(cfg, 0, 16, 4)
