"""Units and flat parameter buffers (single process)."""
import pytest
import torch
from torch import nn

from shard.engine.flat import FlatParams
from shard.engine.units import UnitError, is_sharded, split_units


class Tied(nn.Module):
    """Embedding and output head share one weight; a scale lives on the root."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.act = nn.ReLU()
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, idx):
        return self.head(self.act(self.body(self.embed(idx)))) * self.scale


def test_default_units_are_children_with_parameters_and_the_root_takes_the_rest():
    model = Tied()
    units = split_units(model)
    # embed and head hold only the tied weight, which goes to the root: no units of their own
    assert [u.name for u in units] == ["<root>", "body"]
    root = dict(units[0].params)
    assert set(root) == {"embed.weight", "scale"}          # tied weight and root parameter
    assert [n for n, _ in units[1].params] == ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]
    every = [p for u in units for _, p in u.params]
    assert len(every) == len(set(every)) == len(list(model.parameters()))


def test_explicit_units():
    model = Tied()
    units = split_units(model, [model.body[0], model.body[2]])
    assert [u.name for u in units] == ["<root>", "body.0", "body.2"]
    assert {n for n, _ in units[0].params} == {"embed.weight", "scale"}


def test_bad_units_are_refused():
    model = Tied()
    with pytest.raises(UnitError, match="not a submodule"):
        split_units(model, [nn.Linear(2, 2)])
    with pytest.raises(UnitError, match="must not contain each other"):
        split_units(model, [model.body, model.body[0]])
    with pytest.raises(UnitError, match="model itself"):
        split_units(model, [model])


def test_tiny_units_stay_replicated():
    units = split_units(Tied())
    assert is_sharded(units[1], min_shard_numel=100) and not is_sharded(units[1], min_shard_numel=10**6)


def test_module_lists_contribute_each_member():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
            self.named = nn.ModuleDict({"a": nn.Linear(3, 3)})

    assert [u.name for u in split_units(Stack())] == ["blocks.0", "blocks.1", "blocks.2", "named.a"]


@pytest.mark.parametrize("world", [1, 3, 4, 8])
def test_flat_buffer_round_trip_views_and_shards(world):
    torch.manual_seed(0)
    model = Tied()
    unit = split_units(model)[1]
    flat_params = FlatParams(unit.params, world)
    before = [p.detach().clone() for _, p in unit.params]
    x = torch.randint(0, 50, (2, 5))
    expected = model(x)
    flat = flat_params.flatten(torch.float32)
    assert flat_params.padded % world == 0 and flat_params.padded >= flat_params.numel
    assert torch.equal(flat[flat_params.numel:], torch.zeros(flat_params.padded - flat_params.numel))
    flat_params.bind(flat)
    for (_, p), old in zip(unit.params, before):
        assert torch.equal(p, old) and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(model(x), expected)
    flat[0] += 1.0                                       # parameters are views, not copies
    assert unit.params[0][1].reshape(-1)[0] == before[0].reshape(-1)[0] + 1
    shards = [flat_params.shard(flat, i, world) for i in range(world)]
    assert torch.equal(torch.cat(shards), flat)


def test_gradients_land_in_their_slices_and_release_frees_the_views():
    model = Tied()
    unit = split_units(model)[1]
    flat_params = FlatParams(unit.params, 4)
    flat_params.bind(flat_params.flatten(torch.float32))
    model(torch.randint(0, 50, (3, 4))).sum().backward()
    grads = torch.full((flat_params.padded,), 7.0)
    flat_params.gradients(grads)
    expected = torch.cat([p.grad.reshape(-1) for _, p in unit.params])
    assert torch.equal(grads[:flat_params.numel], expected)
    assert torch.equal(grads[flat_params.numel:], torch.zeros(flat_params.padded - flat_params.numel))
    flat_params.release()
    assert all(p.numel() == 0 for _, p in unit.params)


def test_wrong_buffers_are_refused():
    flat_params = FlatParams(split_units(Tied())[1].params, 4)
    with pytest.raises(ValueError, match="flat buffer of"):
        flat_params.bind(torch.zeros(3))
    with pytest.raises(ValueError, match="cannot take shard"):
        flat_params.shard(torch.zeros(flat_params.padded), 0, flat_params.padded + 1)
    with pytest.raises(ValueError, match="world size"):
        FlatParams([], 0)


def test_root_modules_are_the_children_that_neither_are_nor_hold_a_unit():
    """What Engine(compile=...) compiles besides the units: a child holding a unit would be
    compiled around the unit's gather and release hooks. Units two levels down (each
    block's attention and MLP) leave the blocks out; the reference walks every module."""
    from shard.engine.units import default_units, root_modules
    from shard.models.gpt import GPT, GPTConfig

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.attn, self.mlp = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)
            self.blocks = nn.ModuleList(Block() for _ in range(2))

    def holds_a_unit(module, units) -> bool:
        return any(m is u for m in module.modules() for u in units)

    model = Model()
    units = [m for b in model.blocks for m in (b.attn, b.mlp)]
    assert root_modules(model, units) == [model.embed, model.head]
    gpt = GPT(GPTConfig.preset("tiny"))
    for units in (list(gpt.blocks), default_units(gpt)):   # (the defaults make the root's modules units too)
        expected = [m for m in gpt.children() if not isinstance(m, nn.ModuleList) and not holds_a_unit(m, units)]
        assert root_modules(gpt, units) == expected
    assert root_modules(gpt, list(gpt.blocks)) == [gpt.embed, gpt.pos, gpt.norm, gpt.head]
