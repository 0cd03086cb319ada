"""A deployment on Ray: engines and the router host as Ray actors
(`actors.py`, the one place `ray.remote` is applied), starting and stopping
a deployment (`deploy.py`), a local Ray of our own (`local_ray.py`), and the
autoscaler (`autoscaler.py` acting on the pure `autoscale_policy.py`)."""
