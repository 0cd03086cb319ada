import os

# Everything a test moves stays on the loopback interface: UCX, and Ray's
# own addresses (this switch makes Ray take 127.0.0.1 as every node's IP,
# which multi-node clusters on one machine need; ray reads it at import).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from hypothesis import HealthCheck, settings

# `make test` runs the default profile: derandomized, so CI sees the same
# examples every run; HYPOTHESIS_PROFILE=deep draws fresh ones and digs further.
settings.register_profile("default", max_examples=300, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
# derandomize is spelled out: a profile inherits the registered "default"
# one, which would make every deep run replay the same examples
settings.register_profile("deep", max_examples=5000, deadline=None, derandomize=False,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
