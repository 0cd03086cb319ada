"""`pdserve up` on a Ray cluster someone else started, with each role pinned
to nodes by a custom resource (which `pdserve up` has no flag for): what
tests/chaos/test_chaos_network.py runs inside a network namespace.

    python tests/support/placed_serve.py --config CFG --address HEAD:PORT \
        --node-ip IP --host IP --placement prefill=p_node decode=d_node

Prints the line `pdserve up` prints once it serves ("pdserve: serving gRPC on
ADDR"), serves until SIGTERM, then stops the engines (no drain: a test
tears down) and exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--address", required=True, help="the Ray head's GCS address")
    ap.add_argument("--node-ip", required=True, help="this process's Ray node address")
    ap.add_argument("--host", required=True, help="the router's bind address")
    ap.add_argument("--placement", nargs="+", default=[], metavar="ROLE=RESOURCE")
    args = ap.parse_args()

    import ray

    from pdserve.cluster.actors import NAMESPACE
    from pdserve.cluster.deploy import Deployment
    from pdserve.config import load_with_flags
    from pdserve.config.flags import Flags

    cfg, _ = load_with_flags(args.config, Flags())
    placement = dict(p.split("=", 1) for p in args.placement)
    # the node's address given, not guessed from a route out (Deployment's own
    # ray.init would guess): the namespace may have several
    ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False,
             _node_ip_address=args.node_ip)
    dep = Deployment(cfg, address=args.address, placement=placement, loopback=False)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        address = dep.start(host=args.host, port=0)
        for info in dep.infos:
            print(f"pdserve: {info['engine']} ({info['role']}) at {info['address']} on node "
                  f"{info['node_id'][:8]}", flush=True)
        print(f"pdserve: serving gRPC on {address} (placed)", flush=True)
        done.wait()
    finally:
        dep.stop()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
