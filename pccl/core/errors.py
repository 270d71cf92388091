"""Exceptions raised by pccl, in pure Python so that they import without MPI or the native
module (which raises these same classes)."""


class CollectiveTimeout(TimeoutError):
    """Peers did not complete a collective: they did not arrive within the communicator's
    timeout, or (PeerLost) their connection broke. Raised by every executor, naming the
    peers it was waiting on and (through the Communicator) the collective; the
    communicator's message state is then unknown: create a new communicator."""


class PeerLost(CollectiveTimeout):
    """A peer's connection broke in the middle of a collective (the peer died): raised as
    soon as the transport notices, without waiting out the timeout."""


def during(error: CollectiveTimeout, what: str) -> CollectiveTimeout:
    """`error` (same class) with the operation it interrupted named at the end: nested
    communicators (a plan's levels) each add theirs, innermost first."""
    return type(error)(f"{error}; during {what}")


def rank_name(rank: int, world_ranks) -> str:
    """"rank 0", or "rank 0 (world rank 3)" on a sub-communicator (a plan's level) whose
    ranks are not the launcher's."""
    return f"rank {rank}" if world_ranks[rank] == rank else f"rank {rank} (world rank {world_ranks[rank]})"


def waited_peers(pending, world_ranks) -> str:
    """"receive from 1, 3; send to 2" for the (peer, is_send) pairs still pending, each peer
    with its world rank where that differs (a sub-communicator's ranks are not the
    launcher's); csrc/comm.cpp's MpiComm::waited_peers words it alike."""
    parts = []
    for send, verb in ((False, "receive from"), (True, "send to")):
        peers = list(dict.fromkeys(p for p, s in pending if s == send))
        if peers:
            parts.append(verb + " " + ", ".join(
                f"{p}" if world_ranks[p] == p else f"{p} (world rank {world_ranks[p]})" for p in peers))
    return "; ".join(parts)
