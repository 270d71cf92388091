"""The engine and its optimizer on one rank, in this process (a singleton MPI world, no
mpiexec): their state round-trips through state_dict() and load_state_dict() into a fresh
pair, which then steps exactly as the original does; a config and keywords build the same
engine and optimizer; and checkpoint.py reaches both through that protocol only. Several
ranks: the round trip of every strategy in tests/shard/workers/run_engine.py."""
import ast
from pathlib import Path

import pytest
import torch

import shard.engine.checkpoint
from shard import Engine, ShardedAdamW
from shard.engine.config import EngineConfig, OptimizerConfig
from tests.shard.engine_models import MLP, TinyTransformer, mlp_batch, mlp_loss, token_batch, token_loss

MODELS = {"mlp": (MLP, mlp_batch, mlp_loss), "transformer": (TinyTransformer, token_batch, token_loss)}
COUNTERS = ("steps", "skipped_steps", "optimizer_steps", "loss_scale", "loss_scale_clean")



def build(engines: list, comm, kind: str, config: EngineConfig, seed: int, optimizer=OptimizerConfig(),
          **model_options) -> ShardedAdamW:
    """An engine over a fresh `kind` model, and its optimizer (which holds it: .engine)."""
    torch.manual_seed(seed)
    model = MODELS[kind][0](**model_options)
    engines.append(Engine(model, comm, config=config, units=model.units()))
    return ShardedAdamW(engines[-1], optimizer)


def train_step(optimizer: ShardedAdamW, kind: str, step: int):
    """Two micro-batches of the step's batch, then the update."""
    _, batch, loss = MODELS[kind]
    x, y = batch(step, 8)
    engine = optimizer.engine
    for j in (0, 1):
        engine.backward(loss(engine(x[4 * j:4 * j + 4]), y[4 * j:4 * j + 4]))
    return optimizer.step()


def same_values(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind,precision", [("transformer", "fp32"), ("mlp", "fp16")])
def test_state_round_trips_and_the_next_step_is_identical(comm, engines, kind, precision):
    config = EngineConfig(strategy="zero3", precision=precision, min_shard_numel=0)
    hyper = OptimizerConfig(lr=3e-3, grad_clip=0.5)
    original = build(engines, comm, kind, config, seed=0, optimizer=hyper)
    for step in range(6):
        train_step(original, kind, step)
    state = original.state_dict()
    if precision == "fp16":   # the loss scale has moved: overflowing steps were skipped, others taken
        assert state["skipped_steps"] > 0 and state["steps"] > 0 and state["loss_scale"] < 2.0 ** 16, state
    fresh = build(engines, comm, kind, config, seed=1, optimizer=hyper)   # other initial values: all from the state
    assert not same_values(fresh.engine.full_state_dict(), original.engine.full_state_dict())
    # the states' tensors are views of the original's: load before it steps on
    fresh.engine.load_state_dict(original.engine.state_dict())
    fresh.load_state_dict(state)

    assert same_values(fresh.engine.full_state_dict(), original.engine.full_state_dict())
    assert {k: fresh.state_dict()[k] for k in COUNTERS} == {k: state[k] for k in COUNTERS}
    assert train_step(fresh, kind, 6) == train_step(original, kind, 6)   # grad norm, skipped, loss scale
    assert same_values(fresh.engine.full_state_dict(), original.engine.full_state_dict())


def test_the_update_count_is_exact_past_fp32s_integers(comm, engines):
    """The fused kernel's step count is fp32, as torch's fused AdamW keeps it: it stops at
    2**24. The count the state reports and restores is exact."""
    optimizer = build(engines, comm, "mlp", EngineConfig(strategy="zero3", min_shard_numel=0), seed=0)
    optimizer.load_state_dict({**optimizer.state_dict(), "optimizer_steps": 2 ** 24 - 1})
    for step in range(3):
        train_step(optimizer, "mlp", step)
    assert optimizer.state_dict()["optimizer_steps"] == 2 ** 24 + 2


def test_state_dict_describes_where_each_piece_lies(comm, engines):
    optimizer = build(engines, comm, "transformer", EngineConfig(strategy="zero3", min_shard_numel=0), seed=0)
    state, moments = optimizer.engine.state_dict(), optimizer.state_dict()["units"]
    assert (state["world"], state["group"], state["strategy"]) == (1, 1, "GGG")
    assert [u["name"] for u in state["units"]] == ["<root>", "blocks.0", "blocks.1", "norm"]
    root = state["units"][0]
    assert root["params"] == ["pos", "embed.weight"] and root["shapes"] == [[16, 24], [61, 24]]
    assert root["offsets"] == [0, 16 * 24, 77 * 24] and (root["start"], root["end"]) == (0, root["padded"])
    assert root["first_replica"] and root["master"].numel() == root["padded"]
    assert [sorted(m) for m in moments] == [["exp_avg", "exp_avg_sq"]] * 4
    assert all(m[k].numel() == u["master"].numel() for m, u in zip(moments, state["units"]) for k in m)


def test_state_of_other_pieces_is_refused(comm, engines):
    config = EngineConfig(strategy="zero3", min_shard_numel=0)
    narrow = build(engines, comm, "mlp", config, seed=0)
    wider = build(engines, comm, "mlp", config, seed=0, width=31)
    with pytest.raises(ValueError, match=r"units or pieces differ from this engine's: unit 0 \(inp\) has shapes "
                                         r".* through a checkpoint \(shard.engine.checkpoint"):
        wider.engine.load_state_dict(narrow.engine.state_dict())
    # the message names what differs: the strategy, or the units the model was split into
    torch.manual_seed(0)
    coarser = MODELS["mlp"][0]()
    engines.append(Engine(coarser, comm, config=config, units=coarser.units()[1:]))
    with pytest.raises(ValueError, match=r"its unit 0 is inp, this engine's is <root>"):
        engines[-1].load_state_dict(narrow.engine.state_dict())
    fewer = MODELS["mlp"][0]()
    engines.append(Engine(fewer, comm, config=config, units=fewer.units()[:1]))
    with pytest.raises(ValueError, match=r"it holds \d+ units \(inp, .*\), this engine 2 \(<root>, inp\)"):
        engines[-1].load_state_dict(narrow.engine.state_dict())
    other = build(engines, comm, "mlp", EngineConfig(strategy="zero2", min_shard_numel=0), seed=0)
    with pytest.raises(ValueError, match=r"taken at strategy GGG \(this engine: NGG\)"):
        other.engine.load_state_dict(narrow.engine.state_dict())
    with pytest.raises(ValueError, match=r"moments do not match this optimizer's pieces .* go through a checkpoint"):
        wider.load_state_dict(narrow.state_dict())


def test_keywords_and_config_build_the_same_engine(comm, engines):
    keywords = dict(strategy="zero3", prefetch=2, min_shard_numel=0)
    by_keywords = Engine(MLP(), comm, **keywords)
    engines.append(by_keywords)
    assert by_keywords.config == EngineConfig(**keywords)
    hyper = dict(lr=1e-3, grad_clip=1.0)
    assert ShardedAdamW(by_keywords, **hyper).config == OptimizerConfig(**hyper)
    with pytest.raises(TypeError, match=r"either as config= or as keywords, not both; got config= and \['prefetch'\]"):
        Engine(MLP(), comm, config=EngineConfig(), prefetch=1)
    with pytest.raises(TypeError, match=r"either as config= or as keywords, not both; got config= and \['lr'\]"):
        ShardedAdamW(by_keywords, OptimizerConfig(), lr=1e-3)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got str"):
        Engine(MLP(), comm, "zero3")
    with pytest.raises(TypeError, match=r"unknown ShardedAdamW settings \['prefetch'\]; expected fields of "
                                        r"OptimizerConfig \(\['prefetch'\] are settings of EngineConfig, for Engine\)"):
        ShardedAdamW(by_keywords, prefetch=1)


@pytest.mark.parametrize("name,protocol", [
    ("engine", {"state_dict", "load_state_dict", "layout", "agree", "total", "barrier"}),
    ("optimizer", {"state_dict", "load_state_dict"}),
])
def test_checkpoint_reaches_the_engine_and_optimizer_through_their_public_protocol_only(name, protocol):
    tree = ast.parse(Path(shard.engine.checkpoint.__file__).read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name}
    reflective = [ast.unparse(node) for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "vars") and node.args
                  and isinstance(node.args[0], ast.Name) and node.args[0].id == name]
    assert not [a for a in used if a.startswith("_")] and not reflective, (used, reflective)
    assert used <= protocol, used


@pytest.mark.parametrize("loss_scale", [1.0, 8.0])
def test_an_sgd_step_on_the_engines_gradients_is_the_single_process_one(comm, engines, loss_scale):
    """Engine.gradients() is what an optimizer beside the engine steps on: `scale` times its
    pieces is the mean gradient over the step's micro-batches, with the loss scale the
    engine's backward applied divided out again, and `norm` its norm. An SGD step is
    linear in the gradient, so a sum for a mean or a scale left in shows, where AdamW
    would hide it. Written on engine.master, pieces and refresh() alone, as another
    optimizer would be."""
    torch.manual_seed(0)
    model = MLP()
    reference = MLP()
    reference.load_state_dict(model.state_dict())
    engine = Engine(model, comm, strategy="zero3", min_shard_numel=0, units=model.units())
    engines.append(engine)
    engine.loss_scale = loss_scale   # what fp16's optimizer sets; a power of two: exact in fp32
    x, y = mlp_batch(0, 8)
    for j in (0, 1):
        engine.backward(mlp_loss(engine(x[4 * j:4 * j + 4]), y[4 * j:4 * j + 4]))
    g = engine.gradients()
    lr = 0.5
    masters = list(engine.master.tensor_split(engine.pieces[1:]))
    torch._foreach_add_(masters, g.pieces, alpha=-lr * g.scale)
    engine.refresh()

    ((mlp_loss(reference(x[:4]), y[:4]) + mlp_loss(reference(x[4:]), y[4:])) / 2).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    assert g.norm.item() == pytest.approx(norm.item(), rel=1e-6)
    with torch.no_grad():
        for p in reference.parameters():
            p -= lr * p.grad
    ours = engine.full_state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(ours[k], v, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match=r"step\(\) needs at least one backward\(\) since the last step"):
        engine.gradients()


def test_a_model_wraps_once_and_which_parameters_train_is_fixed_when_it_does(comm, engines):
    """A second Engine over a wrapped model built itself from the released (empty)
    parameters, with the first one's hooks still on the modules: a zero gradient norm, then
    a crash. A requires_grad changed after the build crashed in the backward (zero3: the
    unit released before the new gradient came) or updated wrongly (paro-nig): both
    refused, naming what was wrong."""
    torch.manual_seed(0)
    model = MLP()
    engines.append(Engine(model, comm, strategy="zero3", min_shard_numel=0, units=model.units()))
    with pytest.raises(ValueError, match="this model was wrapped by an earlier Engine"):
        Engine(model, comm, strategy="zero3", units=model.units())
    x, y = mlp_batch(0, 8)
    engine = engines[0]
    name, first = next(iter(model.named_parameters()))
    first.requires_grad_(False)
    with pytest.raises(ValueError, match=rf"requires_grad changed after the engine was built: {name} \(trainable "
                                         r"when the engine was built\)"):
        engine.backward(mlp_loss(engine(x), y))
    first.requires_grad_(True)   # as built: the step goes on
    engine.backward(mlp_loss(engine(x), y))
    assert torch.isfinite(engine.gradients().norm)


def test_a_forward_without_gradients_between_a_forward_and_its_backward(comm, engines):
    """A validation forward taken mid-step (under no_grad) released the root unit, and the
    backward that followed found its parameters gone ("a bug in the engine"). The step now
    ends as one without the extra forward, bit for bit (bf16: the root is gathered at world
    1 too, as a cast of the master weights)."""
    x, y = token_batch(0, 4)
    states = []
    for extra in (False, True):
        torch.manual_seed(0)
        model = TinyTransformer()
        engines.append(Engine(model, comm, strategy="zero3", precision="bf16", units=model.units()[1:-2]))
        engine, optimizer = engines[-1], ShardedAdamW(engines[-1])
        loss = token_loss(engine(x), y)
        if extra:
            with torch.no_grad():
                engine(x)
        engine.backward(loss)
        optimizer.step()
        states.append(engine.full_state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_misuses_a_library_user_makes_are_named(comm, engines):
    """loss.backward() instead of engine.backward(loss) marked units reduced and left stray
    gradients, so the next steps were silently off (4-10%); parameters of two dtypes were
    cast to one and the forward crashed; a unit returning a type the engine sees no tensor in
    was never gathered for its backward ("a bug in the engine"). Each is refused by name,
    and after the first the engine trains as a fresh one."""
    x, y = mlp_batch(0, 8)
    trained = []
    for stray in (True, False):
        torch.manual_seed(0)
        model = MLP()
        engines.append(Engine(model, comm, strategy="zero3", precision="bf16", units=model.units()))
        engine, optimizer = engines[-1], ShardedAdamW(engines[-1])
        if stray:
            with pytest.raises(RuntimeError, match=r"flow through engine.backward\(loss\), not loss.backward\(\)"):
                mlp_loss(engine(x), y).backward()
        engine.backward(mlp_loss(engine(x), y))
        optimizer.step()
        trained.append(engine.full_state_dict())
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])

    mixed = MLP()
    mixed.out.double()
    with pytest.raises(ValueError, match=r"one dtype .* found torch.float32 \(inp.weight, ...\), torch.float64 "
                                         r"\(out.weight, ...\)"):
        Engine(mixed, comm, strategy="zero3")

    class Opaque:   # a container torch's pytree does not know
        def __init__(self, h):
            self.h = h

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Linear(7, 5)
            self.out = torch.nn.Linear(5, 1)

        def forward(self, x):
            return self.out(self.inner(x).h)

    class Inner(torch.nn.Linear):
        def forward(self, x):
            return Opaque(super().forward(x))

    model = Wrapped()
    model.inner.__class__ = Inner
    engines.append(Engine(model, comm, strategy="zero3", precision="bf16", units=[model.inner, model.out]))
    with pytest.raises(TypeError, match="unit inner returned a Opaque, in which the engine finds no tensor"):
        engines[-1](x)
