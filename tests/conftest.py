import os

# Everything a test moves stays on the loopback interface (UCX included).
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hypothesis import HealthCheck, settings

# `make test` runs the default profile; HYPOTHESIS_PROFILE=deep digs further.
settings.register_profile("default", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=5000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
