"""Schedule generators and the symbolic verifier (single process)."""
from __future__ import annotations

import math

import pytest
import torch

from pccl.algorithms import GENERATORS, schedule
from pccl.analysis.verify import ScheduleError, simulate, verify, verify_schedules
from pccl.ir.schedule import Kind, Schedule, recv, recv_reduce, send

CASES = [(c, a) for c, table in GENERATORS.items() for a in table]
# The default run verifies every algorithm on a sample of world sizes: every p up to 33
# (so every way folding splits up to 32 ranks: p - q extra ranks from 0 to q - 1, every
# residue of small moduli), 40 and 50 (folds of 32 with 8 and 18 extra ranks), the powers
# of two 64 and 128 with their neighbours, and 100. The whole sweeps (every p to 130,
# 255-257) are marked slow: make test-all. The mutation tests below show that a bug made
# only at sizes of one shape (odd, 2^k + 1, a multiple of 3, ...) is caught at the sample's
# sizes of that shape wherever the sweep catches it; a bug at one size alone (p = 97) is
# caught by the sweep only.
SAMPLE = (*range(1, 34), 40, 50, 63, 64, 65, 100, 127, 128, 129, 130)
SWEEP = (*range(1, 131), 255, 256, 257)


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_verifier_accepts_a_sample_of_world_sizes(collective, algorithm):
    for p in SAMPLE:
        verify(collective, algorithm, p)


@pytest.mark.slow
@pytest.mark.parametrize("collective,algorithm", CASES)
def test_verifier_accepts_every_world_size(collective, algorithm):
    for p in SWEEP:
        if p not in SAMPLE:
            verify(collective, algorithm, p)


def q_of(p: int) -> int:
    """The largest power of two <= p (what folding keeps)."""
    return 1 << (p.bit_length() - 1)


# Bugs that show only at some world sizes, as generators have them: (where, which rank, what).
SHAPES = {
    "not a power of two": lambda p: p & (p - 1) != 0,
    "one extra rank (p = 2^k + 1)": lambda p: p > 2 and p - q_of(p) == 1,
    "most extra ranks (p = 2^k - 1)": lambda p: p > 2 and p - q_of(p) == q_of(p) - 1,
    "a power of two of 64 or more": lambda p: p >= 64 and p & (p - 1) == 0,
    "odd": lambda p: p % 2 == 1 and p > 1,
    "a multiple of 3": lambda p: p % 3 == 0,
    "more than 64 ranks, not a power of two": lambda p: p > 64 and p & (p - 1) != 0,
}


def drop_last_step(steps, p):
    return steps[:-1]


def wrong_peer(steps, p):
    """The first transfer with a peer talks to the next rank instead."""
    for i, step in enumerate(steps):
        if step:
            t = step[0]
            return steps[:i] + ((t._replace(peer=(t.peer + 1) % p),) + step[1:],) + steps[i + 1:]
    return steps


def last_receive(steps, change):
    """`steps` with its last receive changed by `change` (none: unchanged)."""
    for i in reversed(range(len(steps))):
        for j, t in enumerate(steps[i]):
            if t.kind != Kind.SEND and change(t) is not None:
                return steps[:i] + (steps[i][:j] + (change(t),) + steps[i][j + 1:],) + steps[i + 1:]
    return steps


def copy_for_reduce(steps, p):
    """A reduction lands as a copy (a contribution lost); all-gathers have none."""
    return last_receive(steps, lambda t: t._replace(kind=Kind.RECV) if t.kind == Kind.RECV_REDUCE else None)


def wrong_block(steps, p):
    """A receive lands in the next blocks (one of fewer than all blocks)."""
    return last_receive(steps, lambda t: t._replace(blocks=tuple(sorted((b + 1) % p for b in t.blocks)))
                        if len(t.blocks) < p else None)


MUTATIONS = {"drop the last step": drop_last_step, "wrong peer": wrong_peer, "copy for reduce": copy_for_reduce,
             "wrong block": wrong_block}


def caught(collective, algorithm, p, mutate) -> bool | None:
    """Whether the verifier rejects the schedules of p ranks with rank p // 2's mutated;
    None where the mutation changes nothing there."""
    scheds = [schedule(collective, algorithm, p, r) for r in range(p)]
    steps = mutate(scheds[p // 2].steps, p)
    if steps == scheds[p // 2].steps:
        return None
    scheds[p // 2] = Schedule(collective, algorithm, p, p // 2, steps)
    try:
        verify_schedules(scheds)
    except ScheduleError:
        return True
    return False


@pytest.mark.parametrize("collective,algorithm", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_sample_catches_bugs_of_every_shape_of_world_size(collective, algorithm, shape):
    """Each mutation, made only at world sizes of one shape, is caught at one of the sample's
    sizes of that shape: the sample holds sizes of every shape the sweep does."""
    applied = 0
    for name, mutate in MUTATIONS.items():
        outcomes = set()
        for p in (p for p in SAMPLE if SHAPES[shape](p)):
            outcomes.add(caught(collective, algorithm, p, mutate))
            if True in outcomes:
                break
        if outcomes != {None}:
            applied += 1
            assert True in outcomes, (name, shape)
    assert applied >= 2


@pytest.mark.slow
@pytest.mark.parametrize("collective,algorithm", CASES)
def test_every_mutation_the_sweep_catches_the_sample_catches(collective, algorithm):
    """Mutations at every size of the sweep: where the sweep catches one at some size, the
    sample catches one of the same shape."""
    for name, mutate in MUTATIONS.items():
        caught_at = [p for p in SWEEP if p > 1 and caught(collective, algorithm, p, mutate)]
        for shape, holds in SHAPES.items():
            if any(holds(p) for p in caught_at):
                assert any(holds(p) for p in caught_at if p in SAMPLE), (name, shape)


def sent_blocks(s: Schedule) -> int:
    return sum(len(t.blocks) for step in s.steps for t in step if t.kind == Kind.SEND)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 13, 64, 100])
def test_step_counts_match_the_textbook_formulas(p):
    log = math.ceil(math.log2(p)) if p > 1 else 0
    pow2 = p & (p - 1) == 0
    fold = 0 if pow2 else 2
    for r in range(p):
        assert schedule("all_gather", "ring", p, r).num_steps == p - 1
        assert schedule("reduce_scatter", "ring", p, r).num_steps == p - 1
        assert schedule("all_reduce", "ring", p, r).num_steps == 2 * (p - 1)
        assert schedule("all_gather", "bruck", p, r).num_steps == log
    # Ranks that stay in the power-of-two phase: log2(q) steps plus the two folding steps.
    q = 1 << (p.bit_length() - 1)
    r = p - 1
    assert schedule("all_gather", "recursive_doubling", p, r).num_steps == int(math.log2(q)) + fold * (r < 2 * (p - q))
    assert schedule("reduce_scatter", "recursive_halving", p, 0 if pow2 else 1).num_steps == int(math.log2(q)) + fold
    assert schedule("all_reduce", "rabenseifner", p, 0 if pow2 else 1).num_steps == 2 * int(math.log2(q)) + fold


@pytest.mark.parametrize("p", [2, 4, 8, 16, 32])
def test_bandwidth_optimal_algorithms_send_p_minus_1_blocks(p):
    # (p-1)/p of the buffer per rank for all-gather and reduce-scatter, twice that for all-reduce.
    for r in range(p):
        for c, a in [("all_gather", "ring"), ("all_gather", "recursive_doubling"), ("all_gather", "bruck"),
                     ("reduce_scatter", "ring"), ("reduce_scatter", "recursive_halving")]:
            assert sent_blocks(schedule(c, a, p, r)) == p - 1, (c, a)
        assert sent_blocks(schedule("all_reduce", "ring", p, r)) == 2 * (p - 1)
        assert sent_blocks(schedule("all_reduce", "rabenseifner", p, r)) == 2 * (p - 1)
        assert sent_blocks(schedule("all_reduce", "recursive_doubling", p, r)) == p * int(math.log2(p))


def test_schedules_are_cached():
    assert schedule("all_gather", "bruck", 7, 3) is schedule("all_gather", "bruck", 7, 3)


def test_bruck_wraps_into_two_messages():
    s = schedule("all_gather", "bruck", 5, 3)
    # distance 2: rank 3 sends blocks 3, 4 and receives blocks 0, 1 from rank 0.
    assert s.steps[1] == (send(1, [3, 4]), recv(0, [0, 1]))
    # p=7, rank 5, distance 4: blocks 5, 6, 0 wrap around the end of the buffer.
    s = schedule("all_gather", "bruck", 7, 5)
    assert s.steps[2][0] == send(1, [5, 6, 0])
    assert s.steps[2][0].runs == ((0, 1), (5, 2))
    assert [row for row in s.ops.tolist() if row[0] == 2 and row[1] == Kind.SEND] == [
        [2, Kind.SEND, 1, 0, 1], [2, Kind.SEND, 1, 5, 2]]


def test_ops_table_posts_receives_first():
    s = schedule("all_reduce", "recursive_doubling", 4, 1)
    for step in range(s.num_steps):
        kinds = [k for st, k, *_ in s.ops.tolist() if st == step]
        assert kinds == [Kind.RECV_REDUCE, Kind.SEND]


def broken(collective, algorithm, p, mutate):
    scheds = [schedule(collective, algorithm, p, r) for r in range(p)]
    scheds[1] = Schedule(collective, algorithm, p, 1, mutate(scheds[1].steps))
    return scheds


def test_verifier_rejects_a_double_counted_contribution():
    # Rank 1 reduces its first receive twice (the message sent twice by rank 0 as well).
    p = 4
    scheds = [schedule("all_reduce", "recursive_doubling", p, r) for r in range(p)]
    scheds[0] = Schedule("all_reduce", "x", p, 0, scheds[0].steps[:1] + scheds[0].steps)
    scheds[1] = Schedule("all_reduce", "x", p, 1, scheds[1].steps[:1] + scheds[1].steps)
    with pytest.raises(ScheduleError, match="contributions"):
        verify_schedules(scheds)


def test_verifier_rejects_a_deadlock():
    p = 3
    with pytest.raises(ScheduleError, match="deadlock|unmatched"):
        simulate(broken("all_gather", "ring", p, lambda steps: steps[:-1]))


def test_verifier_rejects_mismatched_blocks():
    p = 4

    def swap_blocks(steps):
        s, r = steps[0]
        return ((s, recv(r.peer, [(r.blocks[0] + 2) % p])),) + steps[1:]

    with pytest.raises(ScheduleError, match="expects"):
        simulate(broken("all_gather", "ring", p, swap_blocks))


def test_verifier_rejects_overwriting_a_block_being_sent():
    def clobber(steps):
        s, r = steps[0]
        return ((s, recv(r.peer, s.blocks)),) + steps[1:]

    with pytest.raises(ScheduleError, match="are sent and overwritten in one step"):
        simulate(broken("all_gather", "ring", 3, clobber))


def first_step(*transfers):
    """A mutation: rank 1's first step replaced by `transfers`."""
    return lambda steps: (tuple(transfers),) + steps[1:]


@pytest.mark.parametrize("step,message", [
    ((send(1, [0]),), "bad peer 1"),                                    # itself
    ((send(7, [0]),), "bad peer 7"),
    ((send(0, [4]),), r"block out of range in \[4\]"),
    ((send(0, [3]), send(0, [1])), "two sends to peer 0"),             # rows out of a transfer's order
    ((send(0, [3]), send(2, [1]), send(0, [0])), "two sends to peer 0"),
    ((recv(0, [0]), recv_reduce(0, [2])), "two receives from peer 0"),
    ((recv(0, [0, 1]), recv(2, [1])), "receives overlap"),
], ids=range(7))
def test_every_malformed_step_is_named(step, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(broken("all_reduce", "ring", 4, first_step(*step)))


def test_verifier_rejects_a_wrong_result():
    # A ring reduce-scatter that stops one step early leaves a partial sum.
    p = 4
    scheds = [Schedule("reduce_scatter", "ring", p, r, schedule("reduce_scatter", "ring", p, r).steps[:-1])
              for r in range(p)]
    with pytest.raises(ScheduleError, match="contributions"):
        verify_schedules(scheds)


@pytest.mark.parametrize("bad", [("all_gather", "recursive_halving"), ("reduce_scatter", "bruck"),
                                 ("broadcast", "ring"), ("all_reduce", "tree")])
def test_unknown_combinations_are_refused(bad):
    with pytest.raises(ValueError, match="expected|collective must be"):
        schedule(*bad, 4, 0)


def test_bad_world_sizes_are_refused():
    with pytest.raises(ValueError, match="size >= 1"):
        schedule("all_gather", "ring", 0, 0)
    with pytest.raises(ValueError, match="rank < size"):
        schedule("all_gather", "ring", 4, 4)


def test_a_schedule_executor_keeps_each_devices_buffers_on_that_device():
    """One executor carries both devices of a device map ("cpu:gloo,cuda:nccl"): its cached
    scratch and work buffers are per device, so a GPU call after a CPU one of the same dtype
    receives into and reduces in device memory ("meta" stands in for the GPU)."""
    from pccl.executors.base import ScheduleExecutor

    class Recorded(ScheduleExecutor):
        rank, size = 0, 4

        def __init__(self):
            super().__init__()
            self.devices = set()

        def exchange(self, sends, recvs, step):
            self.devices |= {t.device.type for _, t in sends + recvs}

    executor = Recorded()
    executor.all_reduce(schedule("all_reduce", "ring", 4, 0), torch.zeros(4000), "sum")
    executor.reduce_scatter(schedule("reduce_scatter", "ring", 4, 0), torch.zeros(1000), torch.zeros(4000), "sum")
    executor.devices.clear()
    gpu = torch.device("meta")
    executor.all_reduce(schedule("all_reduce", "ring", 4, 0), torch.zeros(400, device=gpu), "sum")
    executor.reduce_scatter(schedule("reduce_scatter", "ring", 4, 0), torch.zeros(100, device=gpu),
                            torch.zeros(400, device=gpu), "sum")
    assert executor.devices == {"meta"}, f"the device calls moved {executor.devices} tensors"
