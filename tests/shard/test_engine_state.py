"""The engine on one rank, in this process (a singleton MPI world, no mpiexec): its state
round-trips through state_dict() and load_state_dict() into a fresh engine, which then
steps exactly as the original does; a config and keywords build the same engine; and
checkpoint.py reaches the engine through that protocol only. Several ranks: the
round trip of every strategy in tests/shard/workers/run_engine.py."""
import ast
from pathlib import Path

import pytest
import torch

import shard.engine.checkpoint
from shard import Engine
from shard.engine.config import EngineConfig, OptimizerConfig
from tests.shard.engine_models import MLP, TinyTransformer, mlp_batch, mlp_loss, token_batch, token_loss

MODELS = {"mlp": (MLP, mlp_batch, mlp_loss), "transformer": (TinyTransformer, token_batch, token_loss)}
COUNTERS = ("steps", "skipped_steps", "optimizer_steps", "loss_scale", "loss_scale_clean")



def build(engines: list, comm, kind: str, config: EngineConfig, seed: int, **model_options) -> Engine:
    torch.manual_seed(seed)
    model = MODELS[kind][0](**model_options)
    engines.append(Engine(model, comm, config=config, units=model.units()))
    return engines[-1]


def train_step(engine: Engine, kind: str, step: int):
    """Two micro-batches of the step's batch, then the update."""
    _, batch, loss = MODELS[kind]
    x, y = batch(step, 8)
    for j in (0, 1):
        engine.backward(loss(engine(x[4 * j:4 * j + 4]), y[4 * j:4 * j + 4]))
    return engine.step()


def same_values(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind,precision", [("transformer", "fp32"), ("mlp", "fp16")])
def test_state_round_trips_and_the_next_step_is_identical(comm, engines, kind, precision):
    config = EngineConfig(strategy="zero3", precision=precision, min_shard_numel=0,
                          optimizer=OptimizerConfig(lr=3e-3, grad_clip=0.5))
    original = build(engines, comm, kind, config, seed=0)
    for step in range(6):
        train_step(original, kind, step)
    state = original.state_dict()
    if precision == "fp16":   # the loss scale has moved: overflowing steps were skipped, others taken
        assert state["skipped_steps"] > 0 and state["steps"] > 0 and state["loss_scale"] < 2.0 ** 16, state
    fresh = build(engines, comm, kind, config, seed=1)   # other initial values: all must come from the state
    assert not same_values(fresh.full_state_dict(), original.full_state_dict())
    fresh.load_state_dict(state)   # state's tensors are views of the original's: load before it steps on

    assert same_values(fresh.full_state_dict(), original.full_state_dict())
    assert {k: fresh.state_dict()[k] for k in COUNTERS} == {k: state[k] for k in COUNTERS}
    assert train_step(fresh, kind, 6) == train_step(original, kind, 6)   # grad norm, skipped, loss scale
    assert same_values(fresh.full_state_dict(), original.full_state_dict())


def test_state_dict_describes_where_each_piece_lies(comm, engines):
    engine = build(engines, comm, "transformer", EngineConfig(strategy="zero3", min_shard_numel=0), seed=0)
    state = engine.state_dict()
    assert (state["world"], state["group"], state["strategy"]) == (1, 1, "GGG")
    assert [u["name"] for u in state["units"]] == ["<root>", "blocks.0", "blocks.1", "norm"]
    root = state["units"][0]
    assert root["params"] == ["pos", "embed.weight"] and root["shapes"] == [[16, 24], [61, 24]]
    assert root["offsets"] == [0, 16 * 24, 77 * 24] and (root["start"], root["end"]) == (0, root["padded"])
    assert root["first_replica"] and all(root[k].numel() == root["padded"] for k in shard.engine.checkpoint.STATE)


def test_state_of_other_pieces_is_refused(comm, engines):
    config = EngineConfig(strategy="zero3", min_shard_numel=0)
    state = build(engines, comm, "mlp", config, seed=0).state_dict()
    wider = build(engines, comm, "mlp", config, seed=0, width=31)
    with pytest.raises(ValueError, match=r"units or pieces differ .* go through a checkpoint \(Engine.save"):
        wider.load_state_dict(state)


def test_keywords_and_config_build_the_same_engine(comm, engines):
    keywords = dict(strategy="zero3", lr=1e-3, grad_clip=1.0, prefetch=2, min_shard_numel=0)
    by_keywords = Engine(MLP(), comm, **keywords)
    engines.append(by_keywords)
    assert by_keywords.config == EngineConfig.from_keywords(**keywords)
    with pytest.raises(TypeError, match=r"either as config= or as keywords, not both; got config= and \['lr'\]"):
        Engine(MLP(), comm, config=EngineConfig(), lr=1e-3)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got str"):
        Engine(MLP(), comm, "zero3")


def test_checkpoint_reaches_the_engine_through_its_public_protocol_only():
    tree = ast.parse(Path(shard.engine.checkpoint.__file__).read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "engine"}
    reflective = [ast.unparse(node) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "vars") and node.args
                  and isinstance(node.args[0], ast.Name) and node.args[0].id == "engine"]
    assert not [a for a in used if a.startswith("_")] and not reflective, (used, reflective)
    assert used <= {"state_dict", "load_state_dict", "layout", "agree", "total", "barrier"}, used
