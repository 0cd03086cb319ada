"""What an engine round costs the simulator: the roofline model from model
and GPU presets (roofline.py), a profile measured on a real device
(profile.py), and the fit of one to timed rounds (fit.py)."""
