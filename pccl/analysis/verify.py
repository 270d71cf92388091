"""Symbolic verifier: run every rank's schedule on provenance counts and check the result.

Each rank's buffer is a (blocks x ranks) matrix of counts: entry [b, c] says how many
times rank c's contribution is contained in block b. Messages are what the executors send
(one per run of blocks, Schedule.ops) and are matched the way MPI matches them: the i-th
send from rank a to rank b with the i-th receive that b posts from a. A step completes
once all its messages are matched (its peers have posted theirs), and only then are its
receives applied; a send carries the buffer as it was when its step began. So the verifier
catches wrong data, double-counted or missing contributions, mismatched blocks, unmatched
messages and deadlocks.

The simulation runs in rounds, all ranks at once on numpy arrays: in each round, every
rank whose current step is complete lands it and enters its next. The result does not
depend on the order in which ranks complete (each rank's buffer changes only by its own
steps, and a send's payload is fixed when its step begins), so rounds compute what any
interleaving would, and no progress in a round is a deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pccl.algorithms import schedule
from pccl.ir.compressed import compress, result_blocks
from pccl.ir.plan import Combine, Concurrent, Fill, Permute, Phase
from pccl.ir.schedule import Kind, Schedule
from pccl.plans import build


class ScheduleError(AssertionError):
    """A schedule is malformed, deadlocks, or computes the wrong result."""


def spans(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, index): the runs [first, first + count) expanded, each index with the
    position of its run."""
    owner = np.repeat(np.arange(first.size), count)
    starts = np.cumsum(count) - count
    return owner, first[owner] + np.arange(owner.size) - starts[owner]


@dataclass
class Messages:
    """Every rank's messages, one row each in rank, step and posting order, matched."""
    schedules: list
    rank: np.ndarray
    step: np.ndarray
    kind: np.ndarray
    peer: np.ndarray
    first: np.ndarray
    count: np.ndarray
    partner: np.ndarray      # the matched message's row, -1 for none
    nsteps: np.ndarray       # steps of each rank
    base: np.ndarray         # rank r's step k is global step base[r] + k
    start: np.ndarray        # global step g's messages are rows start[g]:start[g + 1]

    @property
    def size(self) -> int:
        return len(self.schedules)

    def where(self, r: int, k: int) -> str:
        sched = self.schedules[r]
        return f"{sched.algorithm} {sched.collective} p={sched.size} rank={r} step={k}"

    def of(self, ranks: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(i, row) of every message of step steps[i] of rank ranks[i], for every i."""
        g = self.base[ranks] + steps
        return spans(self.start[g], self.start[g + 1] - self.start[g])

    def blocks(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rank, block) of every block these messages carry, message by message."""
        owner, block = spans(self.first[rows], self.count[rows])
        return self.rank[rows][owner], block


def messages(schedules: list[Schedule]) -> Messages:
    """The message table of every rank's schedule, checked (check_steps) and matched."""
    p = len(schedules)
    tables = [s.ops for s in schedules]
    rank = np.repeat(np.arange(p), [len(t) for t in tables])
    step, kind, peer, first, count = np.concatenate(tables).T
    nsteps = np.array([s.num_steps for s in schedules], dtype=np.int64)
    base = np.cumsum(nsteps) - nsteps
    g = base[rank] + step
    start = np.r_[0, np.cumsum(np.bincount(g, minlength=int(nsteps.sum())))]
    msgs = Messages(schedules, rank, step, kind, peer, first, count, np.full(rank.size, -1), nsteps, base, start)
    check_steps(msgs, g)
    # The i-th send from a to b meets the i-th receive that b posts from a.
    sending = kind == Kind.SEND
    pair = np.where(sending, rank * p + peer, peer * p + rank)
    key = pair * (rank.size + 1) + occurrence(pair * 2 + sending)
    sends, recvs = np.flatnonzero(sending), np.flatnonzero(~sending)
    order = sends[np.argsort(key[sends])]
    at = np.minimum(np.searchsorted(key[order], key[recvs]), max(order.size - 1, 0))
    hit = (key[order[at]] == key[recvs]) if order.size else np.zeros(recvs.size, bool)
    received, sent = recvs[hit], order[at[hit]]
    msgs.partner[received], msgs.partner[sent] = sent, received
    wrong = np.flatnonzero((first[received] != first[sent]) | (count[received] != count[sent]))
    if wrong.size:
        rcv, snd = received[wrong[0]], sent[wrong[0]]
        raise ScheduleError(
            f"{schedules[0].algorithm} {schedules[0].collective} p={p}: rank {rank[snd]} sends blocks "
            f"{list(range(first[snd], first[snd] + count[snd]))} but rank {rank[rcv]} expects "
            f"{list(range(first[rcv], first[rcv] + count[rcv]))}")
    return msgs


def occurrence(values: np.ndarray) -> np.ndarray:
    """How many times each value occurred before, in order."""
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    heads = np.r_[True, ranked[1:] != ranked[:-1]]
    out = np.empty(values.size, np.int64)
    out[order] = np.arange(values.size) - np.maximum.accumulate(np.where(heads, np.arange(values.size), 0))
    return out


def check_steps(msgs: Messages, g: np.ndarray) -> None:
    """Raise ScheduleError at the first malformed message of any rank's steps (g: each
    message's global step)."""
    p, kind, peer, first, count = msgs.size, msgs.kind, msgs.peer, msgs.first, msgs.count

    def fail(bad: np.ndarray, what) -> None:
        rows = np.flatnonzero(bad)
        if rows.size:
            row = rows[0]
            raise ScheduleError(f"{msgs.where(msgs.rank[row], msgs.step[row])}: {what(row)}")

    def blocks(row: int) -> list[int]:
        return list(range(first[row], first[row] + count[row]))

    fail((peer < 0) | (peer >= p) | (peer == msgs.rank), lambda row: f"bad peer {peer[row]}")
    fail((first < 0) | (count < 1) | (first + count > p), lambda row: f"block out of range in {blocks(row)}")
    # One transfer per peer and direction in a step: its runs are consecutive rows of one
    # kind, ascending, apart (what Schedule.ops makes of one transfer). Two transfers whose
    # rows read as one transfer's (recv(3, [0]), recv(3, [5])) are the same messages on the
    # wire, and pass.
    sending = kind == Kind.SEND
    key = (g * 2 + sending) * p + peer
    same, later, again = (np.zeros(key.size, bool) for _ in range(3))
    same[1:] = (key[1:] == key[:-1]) & (kind[1:] == kind[:-1])
    later[1:] = first[1:] > first[:-1] + count[:-1]
    again[np.flatnonzero(~same)] = occurrence(key[~same]) > 0
    fail(again | (same & ~later),
         lambda row: f"two {'sends to' if sending[row] else 'receives from'} peer {peer[row]}")
    owner, block = spans(first, count)
    slot = g[owner] * p + block           # a block of a step
    receiving = ~sending[owner]
    fail(np.isin(np.arange(key.size), owner[receiving][occurrence(slot[receiving]) > 0]),
         lambda row: f"receives overlap on blocks {blocks(row)}")
    copied = (kind[owner] == Kind.RECV) & np.isin(slot, slot[~receiving])
    fail(np.isin(np.arange(key.size), owner[copied]),
         lambda row: f"blocks {blocks(row)} are sent and overwritten in one step")


class Provenance:
    """What the simulation carries: every rank's (blocks x ranks) contribution counts, in
    one (ranks x blocks x ranks) array; a send's counts are taken when its step begins and
    kept, a round's sends together, until the matching receive lands."""

    def __init__(self, schedules: list[Schedule]):
        self.schedules = schedules
        p = len(schedules)
        self.state = np.zeros((p, p, p), dtype=np.int32)
        ranks = np.arange(p)
        if schedules[0].collective == "all_gather":
            self.state[ranks, ranks, ranks] = 1
        else:
            self.state[ranks, :, ranks] = 1
        self.batches: dict[int, list] = {}    # a round's sends: [their blocks' counts, messages not yet landed]
        self.batch = self.offset = None       # per send message: its batch, its first block's row there
        self.entered = 0                      # batches made

    def enter(self, msgs: Messages, ranks: np.ndarray, steps: np.ndarray) -> None:
        """Ranks[i] begins its step steps[i]: its sends take their blocks' counts."""
        if self.batch is None:
            self.batch, self.offset = np.full(msgs.rank.size, -1), np.zeros(msgs.rank.size, np.int64)
        _, rows = msgs.of(ranks, steps)
        rows = rows[msgs.kind[rows] == Kind.SEND]
        if not rows.size:
            return
        holder, block = msgs.blocks(rows)
        counts = self.state[holder, block]
        if self.schedules[0].collective == "all_gather" and not counts.any(axis=1).all():
            row = rows[np.repeat(np.arange(rows.size), msgs.count[rows])[~counts.any(axis=1)][0]]
            raise ScheduleError(f"{msgs.where(msgs.rank[row], msgs.step[row])}: sends blocks it does not hold")
        key = self.entered = self.entered + 1
        self.batches[key] = [counts, rows.size]
        self.batch[rows], self.offset[rows] = key, np.cumsum(msgs.count[rows]) - msgs.count[rows]

    def land(self, msgs: Messages, ranks: np.ndarray, steps: np.ndarray) -> None:
        """Ranks[i] completes its step steps[i]: its receives land (copied or added)."""
        _, rows = msgs.of(ranks, steps)
        rows = rows[msgs.kind[rows] != Kind.SEND]
        if not rows.size:
            return
        sent = msgs.partner[rows]
        holder, block = msgs.blocks(rows)
        message = np.repeat(np.arange(rows.size), msgs.count[rows])
        batch = self.batch[sent][message]
        at = self.offset[sent][message] + block - msgs.first[rows][message]
        counts = np.empty((block.size, len(self.schedules)), np.int32)
        for key in np.unique(batch).tolist():
            mine = batch == key
            counts[mine] = self.batches[key][0][at[mine]]
            self.batches[key][1] -= int(np.count_nonzero(self.batch[sent] == key))
            if not self.batches[key][1]:
                del self.batches[key]
        adds = msgs.kind[rows][message] == Kind.RECV_REDUCE
        self.state[holder[~adds], block[~adds]] = counts[~adds]
        self.state[holder[adds], block[adds]] += counts[adds]

    def finish(self) -> np.ndarray:
        return self.state


def simulate(schedules: list[Schedule], model=None) -> np.ndarray:
    """Execute all ranks' schedules symbolically, in rounds (see the module's docstring);
    return every rank's final provenance, (ranks x blocks x ranks). `model`: what the
    messages carry and how they land (default: Provenance; verify_compressed's carries
    encodings)."""
    msgs = messages(schedules)
    model = model or Provenance(schedules)
    pos = np.zeros(len(schedules), np.int64)
    live = np.flatnonzero(msgs.nsteps > 0)
    model.enter(msgs, live, pos[live])
    while live.size:
        owner, rows = msgs.of(live, pos[live])
        partner = msgs.partner[rows]
        posted = (partner >= 0) & (pos[msgs.rank[partner]] >= msgs.step[partner])
        waiting = np.bincount(owner[~posted], minlength=live.size) > 0
        done = live[~waiting]
        if not done.size:
            lost = rows[partner < 0]
            raise ScheduleError(
                f"{schedules[0].algorithm} {schedules[0].collective} p={len(schedules)}: deadlock, ranks "
                f"{live[:8].tolist()} stuck at steps {pos[live[:8]].tolist()}" +
                (f"; unmatched messages of ranks {sorted(set(msgs.rank[lost].tolist()))[:8]}" if lost.size else ""))
        model.land(msgs, done, pos[done])
        pos[done] += 1
        entering = done[pos[done] < msgs.nsteps[done]]
        model.enter(msgs, entering, pos[entering])
        live = live[pos[live] < msgs.nsteps[live]]
    return model.finish()


def verify(collective: str, algorithm: str, p: int) -> None:
    """Raise ScheduleError unless `algorithm` computes `collective` correctly on p ranks."""
    verify_schedules([schedule(collective, algorithm, p, r) for r in range(p)])


def verify_schedules(schedules: list[Schedule], final: np.ndarray | None = None) -> None:
    """Raise ScheduleError unless these per-rank schedules compute their collective (from
    `final`, the simulation's result, when given)."""
    final = simulate(schedules) if final is None else final
    collective, algorithm, p = schedules[0].collective, schedules[0].algorithm, len(schedules)
    if collective == "all_gather":
        bad = (final != np.eye(p, dtype=final.dtype)).any(axis=2)   # block b: rank b's contribution once
    else:
        bad = (final != 1).any(axis=2)                              # every contribution once
        if collective == "reduce_scatter":
            bad &= np.eye(p, dtype=bool)                            # only a rank's own block counts
    if bad.any():
        r, b = np.argwhere(bad)[0]
        raise ScheduleError(
            f"{algorithm} {collective} p={p}: rank {r} block {b} ends with contributions "
            f"{dict((c, int(n)) for c, n in enumerate(final[r, b]) if n)}")


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
        self.sent: dict[int, tuple] = {}                      # a send message's row -> its tokens

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

    def enter(self, msgs: Messages, ranks: np.ndarray, steps: np.ndarray) -> None:
        for r, index in zip(ranks.tolist(), steps.tolist()):
            for b in self.plans[r].steps[index].encode:
                if b in self.frozen[r]:
                    self._fail(r, f"step {index} encodes block {b}, which it holds only encoded")
                if self.schedules[r].collective == "all_gather" and not self.state[r][b].any():
                    self._fail(r, f"step {index} encodes block {b}, which it does not hold")
                self._encode(r, b)
            for row in self._rows(msgs, r, index):
                if msgs.kind[row] == Kind.SEND:
                    blocks = range(msgs.first[row], msgs.first[row] + msgs.count[row])
                    missing = [b for b in blocks if b not in self.enc[r]]
                    if missing:
                        self._fail(r, f"step {index} sends blocks {missing} with no valid encoding")
                    self.sent[row] = tuple(self.enc[r][b] for b in blocks)

    def land(self, msgs: Messages, ranks: np.ndarray, steps: np.ndarray) -> None:
        for r, index in zip(ranks.tolist(), steps.tolist()):
            step = self.plans[r].steps[index]
            for b in step.thaw:
                self.state[r][b] = self._decode(r, self.enc[r].pop(b))
                self.frozen[r].discard(b)
            for row in self._rows(msgs, r, index):
                kind = msgs.kind[row]
                if kind == Kind.SEND:
                    continue
                tokens = self.sent.pop(msgs.partner[row])
                for b, token in zip(range(msgs.first[row], msgs.first[row] + msgs.count[row]), tokens):
                    if kind == Kind.RECV and step.unpack:
                        self.state[r][b] = self._decode(r, token)
                        self.enc[r].pop(b, None)
                    elif kind == Kind.RECV:
                        self.enc[r][b] = token
                        self.frozen[r].add(b)
                    else:
                        if b in self.frozen[r]:
                            self._fail(r, f"step {index} reduces into block {b}, held only encoded and not thawed")
                        self.state[r][b] = self.state[r][b] + self._decode(r, token)
                        self.enc[r].pop(b, None)

    @staticmethod
    def _rows(msgs: Messages, r: int, index: int) -> range:
        g = msgs.base[r] + index
        return range(msgs.start[g], msgs.start[g + 1])

    def finish(self) -> np.ndarray:
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
