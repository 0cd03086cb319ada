"""Generated gRPC modules for the client API (router.proto) and the control
plane (control.proto). Regenerate with `make proto`."""
