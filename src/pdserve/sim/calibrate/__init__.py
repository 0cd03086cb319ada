"""`pdserve calibrate`: a sweep of the real engine's rounds fitted to a cost
profile (sweep.py), and that profile scaled to what a serving deployment
times (served.py)."""
