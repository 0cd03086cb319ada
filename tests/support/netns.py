"""Two network namespaces joined by a link the test can degrade or cut, for
chaos tests that put Ray nodes on either side (tests/chaos/test_chaos_network.py).

    root namespace                          nsA                nsB
    ----------------------------------      ---------------    ---------------
    side  <-- veth (client access) ----->   side (10.x.y.1)
    emulator: raw sockets on aR and bR
      aR  <-- veth ----------------------->  a (10.x.z.1)
      bR  <-- veth ------------------------------------------>  b (10.x.z.2)

The kernel here has no netem (CONFIG_NET_SCH_NETEM is off, and iptables is
not installed), so the link is emulated in user space: a process in the root
namespace reads each frame that one side sends (AF_PACKET on the root end of
its veth) and writes it to the other side's veth after a delay, or drops it
with a probability. Loss 1.0 is a partition by drop: no RST, no ICMP, the
sockets stay open and stall, as behind a cut cable or a firewall that drops.
Every frame between the two namespaces, whatever the protocol (Ray's gRPC,
the engines' gRPC, UCX over TCP, ARP), crosses it.

The frames keep their virtio-net header (PACKET_VNET_HDR), so checksum
offload and segmentation offload survive the hop; segmentation offload is
also turned off on the namespace ends, so a loss probability applies to
frames of at most the MTU, not to 64 KiB bursts.

`unavailable()` says why namespaces cannot be made here (not root, no `ip`,
a sandbox that refuses `ip netns add`), so a test skips with that reason.
Everything is named with a per-run suffix and removed by `Topology.close`,
which also kills what still runs inside the namespaces.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import os
import random
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
PACKET_OUTGOING = 4
SIOCETHTOOL = 0x8946
ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO = 0x1F, 0x24, 0x2C
FRAME_MAX = 65536 + 64


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why this machine cannot run the namespace tests (None: it can): checked
    by doing it, making a namespace and a veth pair and removing them."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root or in a VM"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"pdprobe{secrets.token_hex(3)}"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` is refused here: {made.stderr.strip()}"
        veth = _ip("link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b",
                   check=False)
        if veth.returncode != 0:
            return f"veth pairs cannot be made here: {veth.stderr.strip()}"
        try:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            s.close()
        except OSError as e:
            return f"raw packet sockets (AF_PACKET) are refused: {e}"
        return None
    finally:
        _ip("link", "del", f"{probe}a", check=False)
        _ip("netns", "del", probe, check=False)


# ---- the emulator (runs in a process of its own: `python netns_support.py link A B`) ------

@dataclass
class Impairment:
    """What the link does to each frame, in each direction."""
    delay_s: float = 0.0
    loss: float = 0.0           # 1.0: a partition (every frame dropped)


@dataclass
class _Direction:
    src: socket.socket
    dst: socket.socket
    queue: collections.deque = field(default_factory=collections.deque)
    ready: threading.Condition = field(default_factory=threading.Condition)
    sent: int = 0
    dropped: int = 0


class LinkEmulator:
    """Forwards frames between interfaces `a` and `b` (root ends of two veth
    pairs), each direction delayed and thinned by the current Impairment.
    A constant delay keeps the order, so each direction is one FIFO."""

    def __init__(self, a: str, b: str, seed: int = 0):
        self.impairment = Impairment()
        self.rng = random.Random(seed)
        sa, sb = self._open(a), self._open(b)
        self.dirs = [_Direction(sa, sb), _Direction(sb, sa)]

    @staticmethod
    def _open(ifname: str) -> socket.socket:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        with contextlib.suppress(OSError):          # older kernels: filtered in _receive
            s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        s.bind((ifname, 0))
        return s

    def start(self) -> None:
        for d in self.dirs:
            threading.Thread(target=self._receive, args=(d,), daemon=True).start()
            threading.Thread(target=self._send, args=(d,), daemon=True).start()

    def _receive(self, d: _Direction) -> None:
        while True:
            frame, addr = d.src.recvfrom(FRAME_MAX)
            if addr[2] == PACKET_OUTGOING:
                continue                        # our own write to this interface
            imp = self.impairment
            if imp.loss and self.rng.random() < imp.loss:
                d.dropped += 1
                continue
            with d.ready:
                d.queue.append((time.monotonic() + imp.delay_s, frame))
                d.ready.notify()

    def _send(self, d: _Direction) -> None:
        while True:
            with d.ready:
                while not d.queue:
                    d.ready.wait()
                due, frame = d.queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with d.ready:
                d.queue.popleft()
            if self.impairment.loss >= 1.0:
                d.dropped += 1                  # queued before the cut: lost with it
                continue
            try:
                d.dst.send(frame)
                d.sent += 1
            except OSError:                     # the interface went away (teardown)
                d.dropped += 1

    def serve_commands(self, inp, out) -> None:
        """`set DELAY_S LOSS` (a reply `ok`), `counts` (sent and dropped per
        direction), until stdin closes."""
        for line in inp:
            words = line.split()
            if words[:1] == ["set"]:
                self.impairment = Impairment(float(words[1]), float(words[2]))
                out.write("ok\n")
            elif words[:1] == ["counts"]:
                out.write(" ".join(f"{d.sent} {d.dropped}" for d in self.dirs) + "\n")
            else:
                out.write(f"error: unknown command {line.strip()!r}\n")
            out.flush()


def _no_offload(ifname: str) -> None:
    """Turn off TSO, GSO and GRO on `ifname` (this namespace), so each frame
    is at most the MTU: legacy ethtool ioctls, as `ethtool -K` would."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for cmd in (ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO):
            buf = bytearray(struct.pack("II", cmd, 0))      # struct ethtool_value
            cbuf = (ctypes.c_char * len(buf)).from_buffer(buf)
            ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(cbuf))
            with contextlib.suppress(OSError):      # not supported: the vnet header copes
                fcntl.ioctl(s, SIOCETHTOOL, ifreq)


# ---- the topology ---------------------------------------------------------------------

class Topology:
    """Namespaces `a` and `b` on one emulated link (`a_ip`, `b_ip`, a /24 of
    their own), and a side veth from the root namespace into `a` for clients
    (`side_ip` in `a`, reached from here without crossing the link). Use as
    a context manager; `close` undoes everything, whatever state it is in."""

    def __init__(self):
        tag = secrets.token_hex(3)
        self.tag = tag
        self.a, self.b = f"pdca{tag}", f"pdcb{tag}"
        # interface names: at most 15 characters
        self.if_a, self.if_a_root = f"pa{tag}", f"pA{tag}"
        self.if_b, self.if_b_root = f"pb{tag}", f"pB{tag}"
        self.if_side, self.if_side_root = f"ps{tag}", f"pS{tag}"
        x, y = _free_subnets()
        self.a_ip, self.b_ip = f"10.{x}.{y}.1", f"10.{x}.{y}.2"
        self.side_root_ip, self.side_ip = f"10.{x}.{y + 1}.1", f"10.{x}.{y + 1}.2"
        self._emulator: subprocess.Popen | None = None
        self._made: list[str] = []

    def __enter__(self) -> "Topology":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        for ns in (self.a, self.b):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "set", "lo", "up", ns=ns)
        for inner, root, ns, ip in ((self.if_a, self.if_a_root, self.a, self.a_ip),
                                    (self.if_b, self.if_b_root, self.b, self.b_ip)):
            _ip("link", "add", root, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("addr", "add", f"{ip}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            # Ray (and anything else) finding "its" address by a route out:
            # the link's address, the only way out of the namespace
            _ip("route", "add", "default", "dev", inner, ns=ns)
            subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, "no-offload",
                            inner], check=True, timeout=30)
            _ip("link", "set", root, "up")
        # clients in the root namespace reach namespace a by a link of their own
        _ip("link", "add", self.if_side_root, "type", "veth", "peer", "name", self.if_side)
        _ip("link", "set", self.if_side, "netns", self.a)
        _ip("addr", "add", f"{self.side_ip}/24", "dev", self.if_side, ns=self.a)
        _ip("link", "set", self.if_side, "up", ns=self.a)
        _ip("addr", "add", f"{self.side_root_ip}/24", "dev", self.if_side_root)
        _ip("link", "set", self.if_side_root, "up")
        self._emulator = subprocess.Popen(
            [sys.executable, __file__, "link", self.if_a_root, self.if_b_root],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.impair(Impairment())

    # ---- faults --------------------------------------------------------------------------
    def impair(self, imp: Impairment) -> None:
        """From now on, every frame in each direction: dropped with
        probability `imp.loss`, else delivered `imp.delay_s` later."""
        self._command(f"set {imp.delay_s} {imp.loss}")

    def partition(self) -> None:
        self.impair(Impairment(loss=1.0))

    def heal(self) -> None:
        self.impair(Impairment())

    def counts(self) -> str:
        """Frames sent and dropped, a->b then b->a."""
        return self._command("counts")

    def _command(self, line: str) -> str:
        p = self._emulator
        assert p is not None and p.poll() is None, "the link emulator is not running"
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()
        reply = p.stdout.readline().strip()
        if reply.startswith("error") or not reply:
            raise RuntimeError(f"link emulator: {line!r} -> {reply!r}")
        return reply

    # ---- processes in the namespaces -----------------------------------------------------
    def popen(self, ns: str, cmd: list[str], **kw) -> subprocess.Popen:
        """`cmd` run in namespace `ns` (in a session of its own)."""
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], start_new_session=True,
                                **kw)

    def close(self) -> None:
        """Kill what runs in the namespaces (by pid: only what this topology
        started lives there), stop the emulator, delete the namespaces (their
        veths go with them) and any root end left."""
        for ns in self._made:
            _kill_namespace(ns)
        if self._emulator is not None and self._emulator.poll() is None:
            self._emulator.kill()
            self._emulator.wait(10)
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        for dev in (self.if_a_root, self.if_b_root, self.if_side_root):
            _ip("link", "del", dev, check=False)
        self._made = []


def _kill_namespace(ns: str, wait_s: float = 10.0) -> None:
    """SIGTERM each process in `ns`, SIGKILL what is left after `wait_s`."""
    def pids() -> list[int]:
        r = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
    for sig, wait in ((signal.SIGCONT, 0.0), (signal.SIGTERM, wait_s), (signal.SIGKILL, 5.0)):
        left = pids()
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids() and time.monotonic() < deadline:
            time.sleep(0.2)


def _free_subnets() -> tuple[int, int]:
    """Two adjacent /24s under 10.0.0.0/8 that no address or route here uses."""
    used = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True,
                          text=True).stdout + subprocess.run(
        ["ip", "-4", "addr"], capture_output=True, text=True).stdout
    rng = random.Random()
    for _ in range(100):
        x, y = rng.randrange(100, 250), rng.randrange(0, 250, 2)
        if f"10.{x}." not in used:
            return x, y
    raise RuntimeError("no free 10.x.0.0/16 for the test's namespaces")


def main(argv: list[str]) -> int:
    if argv[:1] == ["link"]:
        em = LinkEmulator(argv[1], argv[2])
        em.start()
        em.serve_commands(sys.stdin, sys.stdout)
        return 0
    if argv[:1] == ["no-offload"]:
        _no_offload(argv[1])
        return 0
    print(f"usage: {sys.argv[0]} link IF_A IF_B | no-offload IF", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
