"""What a run reports: metrics records and sinks, the dashboard client, profiling, sizes, log levels."""
