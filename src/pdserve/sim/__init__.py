"""Modelling a deployment: the simulator, its cost model, plan search and
calibration.

`simulation.py` runs the real planners of fused or P/D engines on virtual
time, with `executor.SimExecutor` charging each round what the cost model
(`cost_model.py` roofline presets, or a measured `cost_profile.py`) says it
takes; `trace.py` reads request traces, `fault_plan.py` injects failures,
`report.py` summarises. `plan_search.py` (with `plan_probe.py` and
`plan_report.py`) searches deployments by simulation for `pdserve plan`;
`calibrate.py`, `calibrate_served.py`, `profile_fit.py` and `host_load.py`
time the real engine and fit a profile for `pdserve calibrate`.
"""
