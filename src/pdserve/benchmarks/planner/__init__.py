"""The planner's own cost, and its policies played out: a decode round's
plan-build cost against a minimal scheduler (`bench planner`), retraction
and the host cache in a tight pool (`bench retraction`), fused against P/D
splits across request rates (`bench disagg`), all in the simulator on the
real planner, and the simulator itself against a real deployment
(`bench sim-accuracy`)."""
