"""`pdserve drain ENGINE`: the engine takes no new request, finishes what it
holds (or aborts it at the deadline), then stops."""

from __future__ import annotations

from pdserve.benchmarks.common.options import client_key, client_key_argument
from pdserve.cli.remote import said


def add_arguments(p) -> None:
    p.add_argument("engine", help="the engine, as ServerInfo names it (decode-0 or "
                                  "pdserve:decode-0)")
    p.add_argument("--address", required=True, help="the router, HOST:PORT")
    p.add_argument("--deadline", type=float,
                   help="seconds to wait before aborting what is left (default 60)")
    client_key_argument(p)


def run(args) -> int:
    from pdserve.client import Client

    def go():
        r = Client(args.address, api_key=client_key(args)).drain(args.engine, args.deadline)
        how = (f"the deadline passed: {r['aborted']} request(s) aborted ('engine drained: "
               "deadline passed')" if r["deadline_passed"] else "every request finished")
        print(f"pdserve: {r['engine']} drained and stopped in {r['seconds']:.1f} s: "
              f"{r['requests_at_start']} request(s) live at the start, {how}; "
              f"{r['refused']} new request(s) sent elsewhere; {r['used_pages']} pages held at "
              "the stop")
        return 0
    return said(go)
