"""A TCP proxy a test owns, to make a link stall without closing: a
partition that sends no RST, a peer whose host froze. `stall()` stops
forwarding in both directions while both sockets stay open (what it read
is held, then nothing more is read, so the kernel's windows fill); a
connection made while stalled is accepted and forwards nothing either.
`close()` closes every socket, as a healed link's RST or a dead host's
timeout would end them."""

from __future__ import annotations

import socket
import threading


class StallProxy:
    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0                 # accepted so far
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._closed = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="stall-proxy").start()

    def stall(self) -> None:
        self._forwarding.clear()

    def close(self) -> None:
        self._closed = True
        self._forwarding.set()               # the pumps wake and find the sockets gone
        with self._lock:
            socks, self._socks = self._socks, []
        for s in [self._listener, *socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
                self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            self._forwarding.wait()
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data or self._closed:
                try:
                    dst.shutdown(socket.SHUT_WR)     # the other side hears the close
                except OSError:
                    pass
                return
            self._forwarding.wait()          # stalled: held, and nothing more read
            try:
                dst.sendall(data)
            except OSError:
                return
