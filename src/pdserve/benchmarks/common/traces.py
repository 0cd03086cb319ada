"""Where the benchmarks that replay a real trace find it by default: the
project's `shared/data/traces`, beside the checkout, read relative to the
working directory (run them from the checkout's root, or pass `--trace`).
Nothing in the installed package points outside it."""

from __future__ import annotations

from pathlib import Path

SHARED_TRACES = Path("..") / "shared" / "data" / "traces"
MOONCAKE_CONV = SHARED_TRACES / "mooncake" / "conversation_trace.jsonl"
AZURE_CONV = SHARED_TRACES / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def trace_file(given: str | Path | None, default: Path) -> Path:
    """`given`, or the default trace; an error that says what to pass when
    the file is not there."""
    path = Path(given) if given else default
    if not path.is_file():
        raise SystemExit(f"pdserve bench: trace {str(path)!r} does not exist (relative paths are "
                         f"read from {Path.cwd()}); pass --trace FILE")
    return path
