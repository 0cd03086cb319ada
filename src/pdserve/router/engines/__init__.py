"""The router's side of its engines: which are alive and what each was told
of the others (membership.py), which serve a request (pairing.py), and the
one event stream per engine the router reads (link.py)."""
