"""`pdserve plan`: the search over P:D splits and chunk sizes (search.py),
one probe of a candidate and where probes run (probe.py), and what the
command prints and writes (report.py)."""
