"""What several benchmark commands share, and no command owns: the options
they (and the `pdserve` command) define alike, where the project's traces
are, child processes (`pdserve up`, a peer server) started and stopped, and
the timing and table helpers their measurements print through.

Nothing here imports torch, Ray or gRPC at module level, and this file
imports none of its modules: `pdserve up --help` loads the options alone."""
