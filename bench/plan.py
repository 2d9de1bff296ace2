"""The plan of a benchmark run: how much of everything it measures (`--quick` shrinks the
counts, never the kinds). Built by `bench.cli` from the flags; read by every section."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Plan:
    """How much of everything a run measures, and which sections it runs (in registry order)."""

    quick: bool = False
    sections: tuple[str, ...] = ()
    bots: int = 100
    classes: int = 100
    zipf_s: float = 1.0
    concurrency: tuple[int, ...] = (1, 4, 16, 32)
    closed_min_requests: int = 40  # measured requests per closed-loop point: at least this,
    closed_requests_per_client: int = 10  # and this many per client
    poisson_rate: float | None = None  # None: 70 % of the mixed policy's 16-client throughput
    poisson_requests: int = 150
    trunk_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    trunk_runs: int = 7
    matmul_n: int = 2048
    matmul_runs: int = 7
    scale_levels: tuple[int, ...] = (10, 100, 1000, 10000)
    scale_touch_max: int = 2000
    store_bots: int = 10000  # the `store` section's bots, of store_classes classes each
    store_classes: int = 10
    cold_samples: int = 50
    fanout_bots: int = 10
    fanout_requests: int = 20
    rebuild_reps: int = 3
    full_models: int = 4
    full_models_requests: int = 64
    full_models_concurrency: int = 16
    images: int = 64
    int8_samples: int = 64  # images the run's INT8 trunk is calibrated on (bench.int8)
    int8_held_out: int = 100  # and held out for its fidelity report
    overload_uploads: int = 300
    soak_s: float = 300.0
    soak_clients: int = 8
    fairness_noisy_clients: int = 48  # closed-loop clients of the noisy tenant
    # The fairness servers' --max-batch-size. 8, not the run's 16: on a CPU batch 8 runs as
    # many images/s as 16, and with 48 one-image clients a 16-row batch leaves the FIFO queue
    # only 3 batches deep, where no work-conserving scheduler can wait less than 2 (the batch
    # running when a quiet client sends, then its own): the gain would be bounded at 2/3.2
    # by the batch size, not measured from the scheduler.
    fairness_batch_size: int = 8
    fairness_warmup_s: float = 10.0  # flood load before its window
    fairness_s: float = 30.0  # the flood's window, per scheduler
    quota_s: float = 20.0  # the quota's window, from the limited client's first 429
    deadlines_s: float = 30.0  # the deadlines section's flood window, per scheduler
    deadlines_alone_s: float = 10.0  # its quiet tenant alone
    deadlines_saturation_s: float = 20.0  # its saturation floods' window, per server
    deadlines_trace_s: float = 60.0  # its bursty trace, per mode
    # The cancellation servers' --max-batch-size: 8, as fairness's, so that 16 one-image
    # clients keep a batch queued behind the one running (a give-up can be withdrawn only
    # while its row waits).
    cancellation_batch_size: int = 8
    cancellation_warmup_s: float = 10.0  # load before each 16-client window
    cancellation_s: float = 30.0  # each 16-client load's window
    isolation_alone_s: float = 15.0  # the isolation section's victim alone
    isolation_s: float = 12.0  # each attack of the isolation section
    seed: int = 0
    max_batch_size: int = 16
    max_wait_ms: float | None = None  # None: the server's default
    progress: bool = True

    @classmethod
    def quick_plan(cls, **overrides) -> Plan:
        values = dict(quick=True, concurrency=(1, 16), closed_min_requests=16,
                      closed_requests_per_client=4, poisson_requests=24, trunk_runs=5,
                      matmul_runs=5, scale_levels=(10, 100, 1000), cold_samples=20, store_bots=1000,
                      fanout_requests=8, rebuild_reps=2, full_models_requests=24, images=48,
                      overload_uploads=100, soak_s=60.0,
                      fairness_warmup_s=5.0, fairness_s=20.0, quota_s=10.0,
                      deadlines_s=15.0, deadlines_alone_s=6.0, deadlines_trace_s=20.0,
                      deadlines_saturation_s=10.0,
                      cancellation_warmup_s=5.0, cancellation_s=15.0,
                      isolation_alone_s=8.0, isolation_s=6.0,
                      int8_samples=32, int8_held_out=32)
        values.update(overrides)
        return cls(**values)

    def closed_requests(self, concurrency: int) -> int:
        """Measured requests of a closed-loop point (after `concurrency` warm-up requests)."""
        return max(self.closed_min_requests, self.closed_requests_per_client * concurrency)

    def to_json(self) -> dict:
        """The plan as bench.json's `meta.plan` records it (progress bars are no measurement)."""
        return {k: v for k, v in asdict(self).items() if k != "progress"}
