"""Every rank of a tensor-parallel engine its own NIXL agent for per-rank KV
transfer (transfer/tp/rank_agent.py), driven from rank 0 over the ranks' pipes.

Rank 0 says what each rank's agent does with typed messages (`TpKvStart`,
`TpKvConnect`, `TpKvAccept`, `TpKvPost`, `TpKvForget`), in order with the
rounds (TpLeader's turn), and polls them (`TpKvPoll`): each worker answers
on its pipe with its agent's `TpKvPolled` (its pieces' ends, the writes
whose every piece reached it). The workers keep no clock: rank 0 decides
when to poll, and a write is done on P when every P rank's pieces ended,
landed on D when every D rank reported it.

engine/tp/transfer.py gives an engine's transport these agents; the
transport's side of a write is transfer/tp/rank_writes.py."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass

from pdserve.transfer.kv_layout import KvLayout
from pdserve.transfer.tp.rank_agent import KvRankAgent, KvRankMeta, RankPolled


@dataclass(frozen=True)
class TpKvStart:
    """Start an agent `name`#rank over the rank's caches; answer its meta."""
    name: str
    layout: KvLayout


@dataclass(frozen=True)
class TpKvConnect:
    """P: prepare the pieces of agent `name` to the D engine `peer`."""
    name: str
    peer: str
    layout: KvLayout
    metas: tuple


@dataclass(frozen=True)
class TpKvAccept:
    """D: learn what the P engine `peer` writes to agent `name`'s rank."""
    name: str
    peer: str
    layout: KvLayout
    metas: tuple


@dataclass(frozen=True)
class TpKvPost:
    """P: post agent `name`'s pieces of a write."""
    name: str
    peer: str
    tag: str
    src: tuple
    dst: tuple
    notif: bytes


@dataclass(frozen=True)
class TpKvForget:
    name: str
    peer: str


@dataclass(frozen=True)
class TpKvPoll:
    """Answer agent `name`'s news (`TpKvPolled`) on the pipe."""
    name: str


TpKvPolled = RankPolled        # a rank's answer to TpKvPoll


log = logging.getLogger("pdserve.tp")

TP_KV_MESSAGES = (TpKvStart, TpKvConnect, TpKvAccept, TpKvPost, TpKvForget, TpKvPoll)


def rank_agent_name(name: str, rank: int) -> str:
    return f"{name}#{rank}"


def serve_kv(msg, rank: int, caches: list, agents: dict, conn) -> TpKvPolled | None:
    """A rank's side of one message (a worker's answers go on `conn`; rank
    0's, `conn` None, is returned)."""
    if isinstance(msg, TpKvStart):
        agent = KvRankAgent(rank_agent_name(msg.name, rank), rank, [c.data for c in caches],
                            msg.layout)
        agents[msg.name] = agent
        if conn is not None:
            conn.send_bytes(pickle.dumps(agent.meta(), protocol=pickle.HIGHEST_PROTOCOL))
    elif isinstance(msg, TpKvConnect):
        agents[msg.name].connect(msg.peer, msg.layout, list(msg.metas))
    elif isinstance(msg, TpKvAccept):
        agents[msg.name].accept(msg.peer, msg.layout, list(msg.metas))     # bookkeeping only
    elif isinstance(msg, TpKvPost):
        failed = agents[msg.name].post(msg.peer, msg.tag, list(msg.src), list(msg.dst),
                                       msg.notif)
        agents[msg.name].failed_at_post += failed
    elif isinstance(msg, TpKvForget):
        try:
            agents[msg.name].forget(msg.peer)
        except Exception as e:      # a dead peer's leftovers must not take a live rank down
            log.warning("rank %d: forgetting %s: %s", rank, msg.peer, e)
    elif isinstance(msg, TpKvPoll):
        agent = agents[msg.name]
        ends, landed, dropped = agent.poll()
        ends = agent.failed_at_post + ends
        agent.failed_at_post = []
        polled = TpKvPolled(rank, tuple(ends), tuple(landed), dropped)
        if conn is None:
            return polled
        conn.send_bytes(pickle.dumps(polled, protocol=pickle.HIGHEST_PROTOCOL))
    else:
        raise TypeError(f"rank {rank}: unknown KV message {type(msg).__name__}")
    return None


class TpKvRanks:
    """Rank 0's handle on every rank's agent `name` of one TpLeader."""

    def __init__(self, leader, name: str, layout: KvLayout):
        self.leader, self.name, self.layout = leader, name, layout
        self.agents: dict = {}          # rank 0's own, by name
        self.metas = tuple(self._each(TpKvStart(name, layout), answer=KvRankMeta))

    def connect(self, peer: str, layout: KvLayout, metas) -> None:
        self._each(TpKvConnect(self.name, peer, layout, tuple(metas)))

    def accept(self, peer: str, layout: KvLayout, metas) -> None:
        self._each(TpKvAccept(self.name, peer, layout, tuple(metas)))

    def post(self, peer: str, tag: str, src, dst, notif: bytes) -> None:
        self._each(TpKvPost(self.name, peer, tag, tuple(tuple(g) for g in src),
                            tuple(tuple(g) for g in dst), notif))

    def forget(self, peer: str) -> None:
        self._each(TpKvForget(self.name, peer))

    def poll(self) -> list[TpKvPolled]:
        """Every rank's news, rank 0's first."""
        return self._each(TpKvPoll(self.name), answer=TpKvPolled)

    def close(self) -> None:
        for a in self.agents.values():
            a.close()
        self.agents.clear()

    def _each(self, msg, answer=None) -> list:
        """`msg` to every worker, then rank 0's own side; the workers'
        answers (of type `answer`) after rank 0's, in rank order."""
        lead = self.leader
        with lead._turn:
            lead._send(msg)
            mine = serve_kv(msg, 0, lead.caches, self.agents, None)
            if answer is None:
                return []
            out = [mine if answer is TpKvPolled else self.agents[self.name].meta()]
            for rank, conn in enumerate(lead.conns, start=1):
                if not conn.poll(lead.spec.timeout_s):
                    from pdserve.kernels.tensor_parallel import TpLost

                    lead._lose(TpLost(f"tensor-parallel rank {rank} did not answer "
                                      f"{type(msg).__name__} in {lead.spec.timeout_s:g} s"))
                try:
                    got = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError) as e:
                    from pdserve.kernels.tensor_parallel import TpLost

                    lead._lose(TpLost(f"tensor-parallel rank {rank}: its pipe broke: {e}"))
                if not isinstance(got, answer):
                    raise TypeError(f"rank {rank} answered {type(got).__name__}, not "
                                    f"{answer.__name__}")
                out.append(got)
            return out
