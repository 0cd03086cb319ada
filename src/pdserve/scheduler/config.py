"""Engine configuration: one frozen, validated object.

Every field a user can set is checked here, with an error that names the
field, says what was wrong and what to change.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

# ConfigError and the shared checks: every config section imports them from here
from pdserve.scheduler.config_checks import ConfigError, check_keys, check_positive_int
from pdserve.scheduler.speculation import SpecConfig


class WritePolicy(enum.StrEnum):
    """When a page stored to the host tier is also written to disk."""
    WRITE_THROUGH = "write_through"                       # every one, as it is stored
    WRITE_THROUGH_SELECTIVE = "write_through_selective"   # once host hits reach write_hits


class PrefetchPolicy(enum.StrEnum):
    """How long a request whose prefix the disk holds waits for its read."""
    BEST_EFFORT = "best_effort"       # not at all: admission takes what the probe found
    WAIT_COMPLETE = "wait_complete"   # until every page of the prefix is read
    TIMEOUT = "timeout"               # until then, or prefetch_timeout_s


@dataclass(frozen=True)
class DiskCacheConfig:
    """engine.disk_cache: the disk (L3) KV tier below the host tier."""
    path: str = ""                      # a directory (local NVMe, tmpfs); engines may share it
    max_bytes: int = 1 << 30            # files kept, least recently used evicted beyond
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_hits: int = 2                 # write_through_selective: host hits before a write
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    prefetch_timeout_s: float = 1.0     # timeout: the longest a request waits for its read
    min_hit_tokens: int = 0             # a disk hit shorter than this is not read
    write_backlog: int = 1024           # pages queued to write beyond which write-through skips

    def __post_init__(self) -> None:
        w = "engine.disk_cache"
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"{w}.path must name a directory, got {self.path!r}")
        for name, low in (("max_bytes", 1), ("write_hits", 1), ("min_hit_tokens", 0),
                          ("write_backlog", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{w}.{name} must be an integer >= {low}, got {v!r}")
        for name, kind in (("write_policy", WritePolicy), ("prefetch_policy", PrefetchPolicy)):
            v = getattr(self, name)
            if v not in {k.value for k in kind}:
                raise ConfigError(f"{w}.{name} must be one of "
                                  f"{', '.join(k.value for k in kind)}; got {v!r}")
            object.__setattr__(self, name, kind(v))
        t = self.prefetch_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"{w}.prefetch_timeout_s must be a number of seconds > 0, "
                              f"got {t!r}")

    @classmethod
    def from_dict(cls, data) -> "DiskCacheConfig":
        return cls(**check_keys(data, "engine.disk_cache",
                                {f.name for f in dataclasses.fields(cls)}))


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16                 # tokens per KV page
    total_pages: int = 4096             # device pool per engine
    host_pages: int = 0                 # L2 host cache (0 = none)
    max_scheduled_tokens: int = 2048    # chunked-prefill token budget a round
    max_batch_size: int = 256           # requests in one forward
    enable_mixed_prefill_decode: bool = True
    safe_steps: int = 4096              # admission headroom window (spec §4)
    max_context_tokens: int = 131072    # the model's context limit
    decode_input_tokens: int = 1        # decode slot reserved on completion
    sliding_pages: int = 0              # pool of each sliding-window group (0: sized for max_batch_size)
    sliding_replay: bool = False        # sliding windows recomputed after a hit, never cached (§1.3)
    state_slots: int = 0                # state slots of a snapshot-state group (0: sized for max_batch_size)
    state_block: int = 0                # tokens between state checkpoints (0: one page; §1.2)
    state_checkpoints: bool = True      # cache state checkpoints for prefix hits (false: none)
    host_state_slots: int = 0           # with host_pages: the state group's L2 slots (0: state_slots)
    overlap: bool = False               # build round N+1's plan while round N's forward runs (overlap.py)
    disk_cache: DiskCacheConfig | None = None   # the disk (L3) tier (None: none)
    capture: str = "auto"               # decode steps captured at load: auto, off or on (kernels/capture.py)
    cpu_threads: int = 0                # a CPU engine's torch threads (0: auto, cluster/cpu_threads.py)
    tensor_parallel_size: int = 1       # ranks (processes, GPUs) one engine's model is split over
    tensor_parallel_timeout_s: float = 60.0   # a collective's bound: a stopped rank downs it
    tensor_parallel_check: bool = False # debug: the ranks compare digests of each round's view
    speculative: SpecConfig | None = None   # speculative decoding (speculation.py; None: off)
    # liveness (engine/watchdog.py): a loop or output thread that makes no
    # progress this long is reported unhealthy (the router moves its
    # requests), and this long the engine exits for Ray to restart (0: never)
    stall_unhealthy_s: float = 5.0
    stuck_loop_restart_s: float = 60.0
    # structured outputs (engine/grammar.py): a request whose grammar takes
    # longer than this to compile is refused (400 / INVALID_ARGUMENT)
    grammar_compile_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        positive = (
            "page_size", "total_pages", "max_scheduled_tokens",
            "max_batch_size", "safe_steps", "max_context_tokens",
            "decode_input_tokens",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"engine.{name} must be a positive integer, got {value!r}"
                )
        if isinstance(self.sliding_pages, bool) or not isinstance(self.sliding_pages, int) \
                or self.sliding_pages < 0:
            raise ConfigError(
                f"engine.sliding_pages must be an integer >= 0 (0 sizes each sliding-window "
                f"group's pool for max_batch_size requests), got {self.sliding_pages!r}"
            )
        for name, zero in (("state_slots", "sizes the pool for max_batch_size requests"),
                           ("state_block", "means one page"),
                           ("host_state_slots", "gives L2 as many state slots as the device")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"engine.{name} must be an integer >= 0 (0 {zero}), "
                                  f"got {value!r}")
        if self.state_block % self.page_size:
            raise ConfigError(f"engine.state_block={self.state_block} must be a multiple of "
                              f"engine.page_size={self.page_size}: a state checkpoint sits on "
                              "a page boundary, where the prefix cache can name it")
        if self.state_block > self.max_scheduled_tokens:
            raise ConfigError(f"engine.state_block={self.state_block} exceeds "
                              f"max_scheduled_tokens={self.max_scheduled_tokens}: a chunk that "
                              "does not finish its prompt ends on a state block boundary, so "
                              "no long prompt could advance; lower state_block or raise "
                              "max_scheduled_tokens")
        if isinstance(self.host_pages, bool) or not isinstance(self.host_pages, int) \
                or self.host_pages < 0:
            raise ConfigError(
                f"engine.host_pages must be an integer >= 0 (0 disables the host "
                f"cache), got {self.host_pages!r}"
            )
        if not isinstance(self.state_checkpoints, bool):
            raise ConfigError(f"engine.state_checkpoints must be true or false, got "
                              f"{self.state_checkpoints!r}")
        if self.capture not in ("auto", "off", "on"):
            raise ConfigError(f"engine.capture is {self.capture!r}; use auto (CUDA graphs on a "
                              "GPU, eager on CPU), off, or on (also torch.compile on CPU)")
        if isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int) \
                or self.cpu_threads < 0:
            raise ConfigError(f"engine.cpu_threads must be an integer >= 0 (0: one, as "
                              f"Ray gave engines), got {self.cpu_threads!r}")
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"engine.overlap must be true or false, got {self.overlap!r}")
        if not isinstance(self.sliding_replay, bool):
            raise ConfigError(f"engine.sliding_replay must be true or false, got "
                              f"{self.sliding_replay!r}")
        if not isinstance(self.enable_mixed_prefill_decode, bool):
            raise ConfigError(
                "engine.enable_mixed_prefill_decode must be true or false, got "
                f"{self.enable_mixed_prefill_decode!r}"
            )
        if self.max_scheduled_tokens < self.page_size:
            raise ConfigError(
                f"engine.max_scheduled_tokens={self.max_scheduled_tokens} is below "
                f"engine.page_size={self.page_size}: a chunk that does not finish "
                "its prompt must end on a page boundary, so no long prompt could "
                "ever advance; raise max_scheduled_tokens to at least page_size"
            )
        if isinstance(self.disk_cache, dict):
            object.__setattr__(self, "disk_cache", DiskCacheConfig.from_dict(self.disk_cache))
        if self.disk_cache is not None:
            if not isinstance(self.disk_cache, DiskCacheConfig):
                raise ConfigError("engine.disk_cache must be a mapping (path, max_bytes, "
                                  "write_policy, prefetch_policy, min_hit_tokens)")
            if not self.host_pages:
                raise ConfigError("engine.disk_cache needs a host tier: pages move disk -> "
                                  "host -> device and are written through from host; set "
                                  "engine.host_pages > 0")
        if self.speculative is not None:
            self._speculation()
        if self.total_pages * self.page_size <= self.decode_input_tokens:
            raise ConfigError(
                f"engine.total_pages={self.total_pages} x page_size={self.page_size} "
                "cannot hold even a one-token prompt and its decode slot; raise "
                "total_pages"
            )
        check_tensor_parallel(self)
        check_watchdog(self)
        t = self.grammar_compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError("engine.grammar_compile_timeout_s must be a number of seconds > 0 "
                              f"(how long a structured output's grammar may compile), got {t!r}")

    def _speculation(self) -> None:
        """engine.speculative, and the decode slot it implies: 1 + k."""
        spec = self.speculative
        if isinstance(spec, dict):
            spec = SpecConfig.from_dict(spec)
            object.__setattr__(self, "speculative", spec)
        if not isinstance(spec, SpecConfig):
            raise ConfigError("engine.speculative must be a mapping (method, "
                              "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)")
        width = 1 + spec.k
        if self.decode_input_tokens == 1:
            object.__setattr__(self, "decode_input_tokens", width)
        elif self.decode_input_tokens != width:
            raise ConfigError(f"engine.decode_input_tokens={self.decode_input_tokens} does not "
                              f"match engine.speculative.num_speculative_tokens={spec.k}: a "
                              f"verify feeds 1 + k = {width} tokens; leave decode_input_tokens "
                              "out (it follows k)")

    @classmethod
    def from_dict(cls, data: dict, where: str = "engine") -> "EngineConfig":
        data = dict(check_keys(data, where, {f.name for f in dataclasses.fields(cls)}))
        if isinstance(data.get("disk_cache"), dict):
            data["disk_cache"] = DiskCacheConfig.from_dict(data["disk_cache"])
        return cls(**data)

    @property
    def pool_tokens(self) -> int:
        return self.total_pages * self.page_size


def check_watchdog(cfg: EngineConfig, where: str = "engine") -> None:
    """engine.stall_unhealthy_s and engine.stuck_loop_restart_s: seconds,
    the restart later than the report (the router moves the requests off
    a stuck engine before it restarts, not after their client lost them)."""
    stall, restart = cfg.stall_unhealthy_s, cfg.stuck_loop_restart_s
    if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not stall > 0:
        raise ConfigError(f"{where}.stall_unhealthy_s must be a number of seconds > 0 (how "
                          f"long a stuck loop takes to be reported unhealthy), got {stall!r}")
    if isinstance(restart, bool) or not isinstance(restart, (int, float)) or restart < 0:
        raise ConfigError(f"{where}.stuck_loop_restart_s must be a number of seconds >= 0 (0: "
                          f"a stuck engine is never restarted), got {restart!r}")
    if restart and restart <= stall:
        raise ConfigError(f"{where}.stuck_loop_restart_s={restart:g} is not above "
                          f"stall_unhealthy_s={stall:g}: a stuck engine would restart before "
                          "it was reported unhealthy and its requests moved; raise "
                          "stuck_loop_restart_s, or set it to 0 (never restart)")


def check_tensor_parallel(cfg: EngineConfig, where: str = "engine") -> None:
    """engine.tensor_parallel_* and what a tensor-parallel engine does not
    run yet (engine/tp/leader.py): each refused by name."""
    t = cfg.tensor_parallel_size
    check_positive_int(t, f"{where}.tensor_parallel_size")
    s = cfg.tensor_parallel_timeout_s
    if isinstance(s, bool) or not isinstance(s, (int, float)) or s <= 0:
        raise ConfigError(f"{where}.tensor_parallel_timeout_s must be a number of seconds > 0, "
                          f"got {s!r}")
    if not isinstance(cfg.tensor_parallel_check, bool):
        raise ConfigError(f"{where}.tensor_parallel_check must be true or false, got "
                          f"{cfg.tensor_parallel_check!r}")
    if t == 1:
        return
    if cfg.speculative is not None:
        raise ConfigError(f"{where}.speculative with tensor_parallel_size {t}: a tensor-parallel "
                          "engine's worker ranks do not run verify rows yet; set speculative "
                          "off or tensor_parallel_size 1")
    for name, on in (("host_pages", cfg.host_pages), ("disk_cache", cfg.disk_cache)):
        if on:
            raise ConfigError(f"{where}.{name} with tensor_parallel_size {t}: a tensor-parallel "
                              "engine's host and disk tiers are not built yet (each rank would "
                              f"copy its own heads); set {name} off or tensor_parallel_size 1")
