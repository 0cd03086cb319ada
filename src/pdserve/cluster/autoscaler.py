"""The P/D autoscaler: a Ray actor that watches the router and adds or
drains engines, one step at a time (the policy is autoscale.py).

Each look (`autoscale.interval_s`) reads the router's Stats (each engine's
requests, pages and the rules holding its waiting requests, plus the
router's arrivals and its TTFT and ITL histograms, from which the p95 of
the interval since the last look is taken) and its ServerInfo (which
engines are alive and not draining). An add starts an engine actor, which
asks Ray for the GPU it needs (so on a cluster Ray's autoscaler adds a
node), then tells the router to serve it. A removal drains the engine
through the router (it finishes what it holds; the router retires it),
off the look loop, so the next looks see it pending and act on nothing.
`events` keeps what happened, for `history()`. How an engine actor starts
is given to it (`start_engine`, cluster/actors.py's), so this module does
not import the actors it runs among.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from pdserve.cluster.autoscale_policy import EngineView, Observation, PolicyState, decide

log = logging.getLogger("pdserve.autoscaler")

# (cfg, role, index, device, gpus_per_engine, options, *, host, control) ->
# (engine name, its actor): cluster/actors.py's start_engine
StartEngine = Callable[..., tuple[str, Any]]


def p95_since(bounds, now_counts, before_counts) -> float | None:
    """The 95th percentile of what a cumulative histogram gained between two
    reads (the upper bound of the bucket it falls in); None if nothing."""
    if not now_counts:
        return None
    gained = [a - (before_counts[i] if i < len(before_counts) else 0)
              for i, a in enumerate(now_counts)]
    total = gained[-1]
    if total <= 0:
        return None
    for bound, n in zip(list(bounds) + [float("inf")], gained):
        if n >= 0.95 * total:
            return bound
    return float("inf")


class Autoscaler:
    def __init__(self, router_address: str, cfg, device: str = "cpu", gpus_per_engine: float = 0,
                 options: dict | None = None, host: str | None = None, api_key: str | None = None,
                 control=None, *, start_engine: StartEngine):
        """`control`: the deployment's ControlPlane (proto/control_tls.py),
        which issues the engines it adds their leaves; None: plaintext;
        `start_engine`: how it starts an engine actor it adds."""
        self.address = router_address
        self.start_engine = start_engine
        self.control = control
        self.cfg = cfg
        self.policy = cfg.autoscale
        self.device, self.gpus, self.options, self.host = device, gpus_per_engine, options, host
        self.api_key = api_key
        self.state = PolicyState()
        self.events: list[dict] = []
        self._pending: threading.Thread | None = None
        self._seen: set[str] = set()          # every engine name the router ever served
        # the handles of the engines it started: an actor whose last handle
        # goes is destroyed by Ray, so they live here as long as this does
        self._actors: dict = {}
        self._last_load = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    # ---- the loop -------------------------------------------------------------------
    def _run(self) -> None:
        from pdserve.client import Client

        client = Client(self.address, timeout=30, api_key=self.api_key)
        start = time.monotonic()
        while not self._stop.wait(self.policy.interval_s):
            try:
                obs = self.observe(client, time.monotonic() - start)
                action = decide(self.policy, obs, self.state)
                if action is not None:
                    self.act(client, action, obs)
            except Exception as e:            # a look that failed is logged; the next one tries
                log.exception("autoscaler look failed")
                self.events.append({"t": round(time.monotonic() - start, 2), "kind": "error",
                                    "why": f"{type(e).__name__}: {e}"})
        client.close()

    def observe(self, client, now: float) -> Observation:
        # an action that ends while this look reads the router counts as
        # pending: the engines read before it ended do not show its engine
        pending = self.busy()
        info = client.server_info()
        self._seen.update(e["name"].removeprefix("pdserve:") for e in info["engines"])
        resp = client.stats_response()
        stats = {s.name.removeprefix("pdserve:"): s for s in resp.engines}
        views = []
        for e in info["engines"]:
            name = e["name"].removeprefix("pdserve:")
            if e.get("draining"):
                continue               # on its way out (or gone): not counted
            # an engine that missed a few looks (slow to answer under load,
            # or restarting) is still there: counting it out would add another
            view = EngineView(name, e["role"], alive=e["alive"])
            s = stats.get(name)            # an engine too busy to answer counts, unread
            view.known = s is not None
            if s is not None:
                view.running, view.used_pages = s.running, s.used_pages
                view.total_pages = max(s.total_pages, 1)
                for w in s.waiting_requests:
                    view.waiting[w.reason] = view.waiting.get(w.reason, 0) + 1
            views.append(view)
        load, last = resp.load, self._last_load
        self._last_load = load
        ttft = p95_since(load.ttft_bounds, load.ttft_counts, last.ttft_counts if last else [])
        itl = p95_since(load.itl_bounds, load.itl_counts, last.itl_counts if last else [])
        arrivals = (load.arrivals - last.arrivals) / self.policy.interval_s if last else 0.0
        return Observation(now, views, ttft, itl, arrivals, pending or self.busy())

    def act(self, client, action, obs: Observation) -> None:
        self.events.append({"t": round(obs.now, 2), "kind": action.kind, "role": action.role,
                            "engine": action.engine, "why": action.why,
                            "engines": sorted(e.name for e in obs.engines)})
        log.info("autoscaler: %s %s %s (%s)", action.kind, action.role, action.engine,
                 action.why)
        if action.kind == "add":
            self._pending = threading.Thread(target=self._add, args=(action.role, obs),
                                             daemon=True)
        else:
            self._pending = threading.Thread(target=self._drain, args=(action.engine,),
                                             daemon=True)
        self._pending.start()

    # ---- actions (off the loop: the looks go on and see them pending) -------------------
    def _add(self, role: str, obs: Observation) -> None:
        import ray

        from pdserve.client import Client

        index = self._next_index(role)
        self.events.append({"t": None, "kind": "starting", "role": role,
                            "engine": f"{role}-{index}", "why": ""})
        name, actor = self.start_engine(self.cfg, role, index, self.device, self.gpus,
                                        self.options, host=self.host, control=self.control)
        self._actors[name] = actor
        try:
            address = ray.get(actor.info.remote(), timeout=600)["address"]
            with Client(self.address, timeout=120, api_key=self.api_key) as c:
                c.add_engine(name, role, address)
        except Exception as e:            # the router never served it: it goes
            ray.kill(actor, no_restart=True)
            self._actors.pop(name, None)
            self.events.append({"t": None, "kind": "error", "role": role, "engine": name,
                                "why": f"adding {name} failed: {type(e).__name__}: {e}"})
            log.warning("autoscaler: adding %s failed: %s", name, e)

    def _drain(self, engine: str) -> None:
        from pdserve.client import Client

        try:
            with Client(self.address, timeout=self.policy.drain_deadline_s + 60,
                        api_key=self.api_key) as c:
                c.drain(engine, self.policy.drain_deadline_s)
        except Exception as e:
            self.events.append({"t": None, "kind": "error", "role": "", "engine": engine,
                                "why": f"draining {engine} failed: {type(e).__name__}: {e}"})
            log.warning("autoscaler: draining %s failed: %s", engine, e)

    def _next_index(self, role: str) -> int:
        """A fresh index: never one a live, drained or starting engine had."""
        i = 0
        while f"{role}-{i}" in self._seen:
            i += 1
        self._seen.add(f"{role}-{i}")
        return i

    # ---- queries ----------------------------------------------------------------------
    def history(self) -> list[dict]:
        """Every action taken (and failed look), oldest first."""
        return list(self.events)

    def busy(self) -> bool:
        return self._pending is not None and self._pending.is_alive()

    def stop(self) -> None:
        """No more looks. An action under way is left to finish or to be cut
        short by the deployment stopping its engines."""
        self._stop.set()
        self._thread.join(self.policy.interval_s + 30)
