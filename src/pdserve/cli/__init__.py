"""The `pdserve` command: `main.py` dispatches to one module per command,
each owning its options; `pdserve bench NAME` imports only the chosen
benchmark."""
