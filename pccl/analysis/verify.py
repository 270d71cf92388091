"""Symbolic verifier: run every rank's schedule on provenance counts and check the result.

Each rank's buffer is a (blocks x ranks) matrix of counts: entry [b, c] says how many
times rank c's contribution is contained in block b. Messages are matched the way MPI
matches them (first posted send with first posted receive per ordered pair of ranks);
a step completes once all its transfers are matched, and only then are its receives
applied. So the verifier catches wrong data, double-counted or missing contributions,
mismatched block lists, unmatched messages and deadlocks.
"""
from __future__ import annotations

from collections import defaultdict, deque

import numpy as np

from pccl.algorithms import schedule
from pccl.ir.compressed import compress, result_blocks
from pccl.ir.plan import Combine, Concurrent, Fill, Permute, Phase
from pccl.ir.schedule import Kind, Schedule
from pccl.plans import build


class ScheduleError(AssertionError):
    """A schedule is malformed, deadlocks, or computes the wrong result."""


def initial_state(collective: str, p: int) -> list[np.ndarray]:
    state = []
    for r in range(p):
        s = np.zeros((p, p), dtype=np.int64)
        if collective == "all_gather":
            s[r, r] = 1
        else:
            s[:, r] = 1
        state.append(s)
    return state


def check_step(sched: Schedule, index: int) -> None:
    step = sched.steps[index]
    p, where = sched.size, f"{sched.algorithm} {sched.collective} p={sched.size} rank={sched.rank} step={index}"
    seen: dict[tuple[bool, int], int] = {}
    targets: set[int] = set()
    sent: set[int] = set()
    for t in step:
        if not 0 <= t.peer < p or t.peer == sched.rank:
            raise ScheduleError(f"{where}: bad peer {t.peer}")
        if any(not 0 <= b < p for b in t.blocks):
            raise ScheduleError(f"{where}: block out of range in {t.blocks}")
        key = (t.kind == Kind.SEND, t.peer)
        if key in seen:
            raise ScheduleError(f"{where}: two {'sends to' if key[0] else 'receives from'} peer {t.peer}")
        seen[key] = 1
        if t.kind == Kind.SEND:
            sent.update(t.blocks)
        else:
            if targets & set(t.blocks):
                raise ScheduleError(f"{where}: receives overlap on blocks {sorted(targets & set(t.blocks))}")
            targets.update(t.blocks)
    copied = {b for t in step if t.kind == Kind.RECV for b in t.blocks}
    if copied & sent:
        raise ScheduleError(f"{where}: blocks {sorted(copied & sent)} are sent and overwritten in one step")


class Provenance:
    """What the simulation carries: each rank's (blocks x ranks) contribution counts."""

    def __init__(self, schedules: list[Schedule]):
        self.schedules = schedules
        self.state = initial_state(schedules[0].collective, len(schedules))

    def begin(self, r: int, index: int) -> None:
        """Rank r enters step `index`."""

    def payload(self, r: int, index: int, t) -> object:
        """What rank r's send `t` carries."""
        payload = self.state[r][list(t.blocks)].copy()
        sched = self.schedules[r]
        if sched.collective == "all_gather" and not payload.any(axis=1).all():
            raise ScheduleError(f"{sched.algorithm} all_gather p={sched.size}: rank {r} step {index} sends blocks it "
                                f"does not hold")
        return payload

    def land(self, r: int, index: int, received: list) -> None:
        """Rank r's step `index` completes with these (transfer, payload) receives."""
        for t, payload in received:
            idx = list(t.blocks)
            if t.kind == Kind.RECV:
                self.state[r][idx] = payload
            else:
                self.state[r][idx] += payload

    def finish(self) -> list[np.ndarray]:
        return self.state


def simulate(schedules: list[Schedule], model=None) -> list[np.ndarray]:
    """Execute all ranks' schedules symbolically, messages matched as MPI matches them;
    return each rank's final provenance. `model`: what the messages carry and how they
    land (default: Provenance; verify_compressed's carries encodings)."""
    p = len(schedules)
    collective = schedules[0].collective
    model = model or Provenance(schedules)
    pos = [0] * p
    unmatched = [0] * p
    received: list[list] = [[] for _ in range(p)]
    sends: dict[tuple[int, int], deque] = defaultdict(deque)
    recvs: dict[tuple[int, int], deque] = defaultdict(deque)
    ready: deque[int] = deque()

    def match(src: int, dst: int) -> None:
        sq, rq = sends[(src, dst)], recvs[(src, dst)]
        while sq and rq:
            blocks, payload = sq.popleft()
            t = rq.popleft()
            if t.blocks != blocks:
                raise ScheduleError(
                    f"{schedules[0].algorithm} {collective} p={p}: rank {src} sends blocks {blocks} "
                    f"but rank {dst} expects {t.blocks}")
            received[dst].append((t, payload))
            for r in (src, dst):
                unmatched[r] -= 1
                if unmatched[r] == 0:
                    ready.append(r)

    def enter(r: int) -> None:
        sched = schedules[r]
        if pos[r] == len(sched.steps):
            return
        check_step(sched, pos[r])
        step = sched.steps[pos[r]]
        unmatched[r] = len(step)
        if not step:
            ready.append(r)
        model.begin(r, pos[r])
        for t in step:
            if t.kind == Kind.SEND:
                sends[(r, t.peer)].append((t.blocks, model.payload(r, pos[r], t)))
            else:
                recvs[(t.peer, r)].append(t)
        for t in step:
            if t.kind == Kind.SEND:
                match(r, t.peer)
            else:
                match(t.peer, r)

    for r in range(p):
        enter(r)
    while ready:
        r = ready.popleft()
        model.land(r, pos[r], received[r])
        received[r].clear()
        pos[r] += 1
        enter(r)

    stuck = [r for r in range(p) if pos[r] < len(schedules[r].steps)]
    if stuck:
        raise ScheduleError(
            f"{schedules[0].algorithm} {collective} p={p}: deadlock, ranks {stuck[:8]} stuck at steps "
            f"{[pos[r] for r in stuck[:8]]}")
    leftover = [k for k, q in list(sends.items()) + list(recvs.items()) if q]
    if leftover:
        raise ScheduleError(f"{schedules[0].algorithm} {collective} p={p}: unmatched messages on {leftover[:8]}")
    return model.finish()


def verify(collective: str, algorithm: str, p: int) -> None:
    """Raise ScheduleError unless `algorithm` computes `collective` correctly on p ranks."""
    verify_schedules([schedule(collective, algorithm, p, r) for r in range(p)])


def verify_schedules(schedules: list[Schedule], final: list[np.ndarray] | None = None) -> None:
    """Raise ScheduleError unless these per-rank schedules compute their collective (from
    `final`, the simulation's result, when given)."""
    final = simulate(schedules) if final is None else final
    collective, algorithm, p = schedules[0].collective, schedules[0].algorithm, len(schedules)
    eye = np.eye(p, dtype=np.int64)
    everyone = np.ones(p, dtype=np.int64)
    for r, s in enumerate(final):
        if collective == "all_gather":
            bad = [b for b in range(p) if not np.array_equal(s[b], eye[b])]
        elif collective == "reduce_scatter":
            bad = [] if np.array_equal(s[r], everyone) else [r]
        else:
            bad = [b for b in range(p) if not np.array_equal(s[b], everyone)]
        if bad:
            b = bad[0]
            raise ScheduleError(
                f"{algorithm} {collective} p={p}: rank {r} block {b} ends with contributions "
                f"{dict((c, int(n)) for c, n in enumerate(s[b]) if n)}")


class Encoded(Provenance):
    """The simulation of compressed schedules (pccl.ir.compressed): each rank follows its
    plan; an encoding is a token standing for the contributions it was made from. Checks
    that a rank forwards only valid encodings, encodes only values it holds, and never
    decodes one token twice; counts the encodings made per block."""

    def __init__(self, schedules: list[Schedule], per_message: bool = False):
        super().__init__(schedules)
        p = len(schedules)
        self.plans = [compress(sched, per_message) for sched in schedules]
        self.per_message = per_message
        self.tokens: list[np.ndarray] = []                    # token -> contributions
        self.maker: list[int] = []                            # token -> the block it encodes
        self.enc: list[dict[int, int]] = [{} for _ in range(p)]
        self.frozen: list[set[int]] = [set() for _ in range(p)]
        self.decoded: list[set[int]] = [set() for _ in range(p)]
        self.final: list[dict[int, int]] = [{} for _ in range(p)]   # block -> the token it ended as

    def _fail(self, r: int, message: str) -> None:
        sched = self.schedules[r]
        raise ScheduleError(f"compressed {sched.algorithm} {sched.collective} p={sched.size} rank {r}: {message}")

    def _decode(self, r: int, token: int) -> np.ndarray:
        if token in self.decoded[r]:
            self._fail(r, f"decodes token {token} twice")
        self.decoded[r].add(token)
        return self.tokens[token]

    def _encode(self, r: int, b: int) -> None:
        """Rank r encodes its value of block b: a new token."""
        self.tokens.append(self.state[r][b].copy())
        self.maker.append(b)
        self.enc[r][b] = len(self.tokens) - 1

    def begin(self, r: int, index: int) -> None:
        for b in self.plans[r].steps[index].encode:
            if b in self.frozen[r]:
                self._fail(r, f"step {index} encodes block {b}, which it holds only encoded")
            if self.schedules[r].collective == "all_gather" and not self.state[r][b].any():
                self._fail(r, f"step {index} encodes block {b}, which it does not hold")
            self._encode(r, b)

    def payload(self, r: int, index: int, t) -> object:
        missing = [b for b in t.blocks if b not in self.enc[r]]
        if missing:
            self._fail(r, f"step {index} sends blocks {missing} with no valid encoding")
        return tuple(self.enc[r][b] for b in t.blocks)

    def land(self, r: int, index: int, received: list) -> None:
        step = self.plans[r].steps[index]
        for b in step.thaw:
            self.state[r][b] = self._decode(r, self.enc[r].pop(b))
            self.frozen[r].discard(b)
        for t, tokens in received:
            for b, token in zip(t.blocks, tokens):
                if t.kind == Kind.RECV and step.unpack:
                    self.state[r][b] = self._decode(r, token)
                    self.enc[r].pop(b, None)
                elif t.kind == Kind.RECV:
                    self.enc[r][b] = token
                    self.frozen[r].add(b)
                else:
                    if b in self.frozen[r]:
                        self._fail(r, f"step {index} reduces into block {b}, held only encoded and not thawed")
                    self.state[r][b] = self.state[r][b] + self._decode(r, token)
                    self.enc[r].pop(b, None)

    def finish(self) -> list[np.ndarray]:
        for r, plan in enumerate(self.plans):
            for b in plan.seal:
                self._encode(r, b)
            for b in (*plan.decode, *plan.settle, *plan.seal):
                token = self.enc[r][b]
                self.state[r][b] = self._decode(r, token)
                self.final[r][b] = token
                self.frozen[r].discard(b)
            ends = set(result_blocks(plan.schedule))
            if self.frozen[r] & ends:
                self._fail(r, "ends holding result blocks only encoded")
            if plan.schedule.collective == "all_reduce" and plan.schedule.steps and not self.per_message and \
                    set(self.final[r]) != ends:
                self._fail(r, f"ends with all-reduce blocks {sorted(ends - set(self.final[r]))} that are not "
                              f"decodings: ranks could hold different values")
        return self.state


def verify_compressed(collective: str, algorithm: str, p: int, per_message: bool = False) -> dict:
    """Raise ScheduleError unless `algorithm` with compression computes `collective` on p
    ranks (the same contributions, every encoding valid, none decoded twice); for an
    all-gather, also unless every block is encoded exactly once (by its owner) and every
    rank ends with the same decoding of it. Returns {"encodes": encodings per block}.
    per_message: the point-to-point baseline (pccl.ir.compressed), counted only."""
    schedules = [schedule(collective, algorithm, p, r) for r in range(p)]
    model = Encoded(schedules, per_message)
    verify_schedules(schedules, simulate(schedules, model))
    encodes = np.bincount(np.asarray(model.maker, dtype=np.int64), minlength=p)
    if collective == "all_gather" and p > 1 and not per_message:   # (one rank sends nothing, encodes nothing)
        if (encodes != 1).any():
            raise ScheduleError(f"compressed {algorithm} all_gather p={p}: blocks encoded {encodes.tolist()} times, "
                                f"expected once each")
        for b in range(p):
            if len({model.final[r][b] for r in range(p)}) != 1:
                raise ScheduleError(f"compressed {algorithm} all_gather p={p}: block {b} ends as different "
                                    f"decodings on different ranks")
    return {"encodes": encodes.tolist()}


def simulate_plans(plans: list, topology, weights: np.ndarray, rng: np.random.Generator) -> list[dict]:
    """Execute every rank's plan on fingerprints: input block k of rank r holds the random
    64-bit weight weights[r, k], reductions add modulo 2**64, and workspaces and outputs
    start with random garbage. A block's final value then tells (with overwhelming
    probability) exactly which contributions it holds, from which ranks and input blocks,
    each counted how often, and whether anything read a workspace before writing it.
    Phases act as ideal collectives on their level's ranks; ranks may differ in local steps.
    Return each rank's final buffers."""
    p, collective = topology.size, plans[0].collective

    def garbage(n):
        return rng.integers(0, 2**63, size=n, dtype=np.uint64)

    bufs = []
    for r, plan in enumerate(plans):
        b = {name: garbage(blocks) for name, blocks in plan.workspaces}
        if collective == "all_gather":
            b.update(input=weights[r, :1].copy(), output=garbage(p))
        elif collective == "reduce_scatter":
            b.update(input=weights[r].copy(), output=garbage(1))
        else:
            b["io"] = weights[r].copy()
        bufs.append(b)

    def view(r, ref):
        return bufs[r][ref.buffer][ref.start:ref.start + ref.count]

    def run_local(r, step):
        if isinstance(step, Permute):
            src, dst = view(r, step.src).copy(), view(r, step.dst)
            for i, j in enumerate(step.perm):
                if j >= 0:
                    dst[j] = src[i]
        elif isinstance(step, Fill):
            view(r, step.dst)[:] = 0
        elif isinstance(step, Combine):
            view(r, step.dst)[:] += view(r, step.src)

    def run_phases(index, phase_of):
        updates = []
        for r in range(p):
            phase = phase_of(r)
            group = topology.level_ranks(phase.level, r)
            others = [phase_of(q) for q in group]
            if any((o.collective, o.level) != (phase.collective, phase.level) for o in others):
                raise ScheduleError(f"collective {index}: the ranks of {phase.level} group {group} disagree")
            inputs = [view(q, o.input) for q, o in zip(group, others)]
            if phase.collective == "all_gather":
                result = np.concatenate(inputs)
            else:
                n, me = phase.output.count, group.index(r)
                result = np.sum([x[me * n:(me + 1) * n] for x in inputs], axis=0, dtype=np.uint64)
            if result.shape != view(r, phase.output).shape:
                raise ScheduleError(f"collective {index}: rank {r} {phase.collective} output has "
                                    f"{view(r, phase.output).shape[0]} blocks, the result {result.shape[0]}")
            updates.append((r, phase.output, result))
        for r, ref, result in updates:  # all inputs are read before any output is written
            view(r, ref)[:] = result

    # Split each plan at its collective steps; every rank must have the same number of them.
    segments = []
    for plan in plans:
        local, cut = [[]], []
        for step in plan.steps:
            if isinstance(step, (Phase, Concurrent)):
                cut.append(step)
                local.append([])
            else:
                local[-1].append(step)
        segments.append((local, cut))
    counts = {len(cut) for _, cut in segments}
    if len(counts) != 1:
        raise ScheduleError(f"ranks' plans have different numbers of collective steps: {sorted(counts)}")
    for index in range(counts.pop() + 1):
        for r in range(p):
            for step in segments[r][0][index]:
                run_local(r, step)
        if index == len(segments[0][1]):
            break
        first = segments[0][1][index]
        if isinstance(first, Phase):
            run_phases(index, lambda r: segments[r][1][index])
        else:
            for k in range(len(first.phases)):
                run_phases(index, lambda r: segments[r][1][index].phases[k])
    return bufs


def verify_plans(plans: list, topology, seed: int = 0) -> None:
    """Raise ScheduleError unless these per-rank plans compute their collective."""
    p, collective = topology.size, plans[0].collective
    rng = np.random.default_rng(seed)
    weights = rng.integers(0, 2**63, size=(p, p), dtype=np.uint64)
    final = simulate_plans(plans, topology, weights, rng)
    column_sums = weights.sum(axis=0, dtype=np.uint64)   # block k reduced over all ranks
    for r, b in enumerate(final):
        if collective == "all_gather":
            got, expected = b["output"], weights[:, 0]
        elif collective == "reduce_scatter":
            got, expected = b["output"], column_sums[r:r + 1]
        else:
            got, expected = b["io"], column_sums
        bad = np.flatnonzero(got != expected)
        if bad.size:
            raise ScheduleError(f"{plans[0].name} {collective} on {topology.describe()}: rank {r} ends with "
                                f"wrong data in block(s) {bad[:8].tolist()}")


def verify_plan(spec, collective: str, topology) -> None:
    """Raise ScheduleError unless the plan of `spec` computes `collective` on `topology`."""
    verify_plans([build(spec, collective, topology, r) for r in range(topology.size)], topology)
