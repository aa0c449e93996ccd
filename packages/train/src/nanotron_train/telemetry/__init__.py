"""What a parallel run shows the dashboard beyond rank 0's metrics: per-rank step
time split and memory, stragglers, the pipeline timeline, events, samples and system metrics.
`session.Telemetry` is what the trainer holds; each other module has one job."""
