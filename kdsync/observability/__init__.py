"""How a member shows what it does: structured logs (`logs`), Prometheus
metrics (`metrics`), per-stage latency and the latency trace
(`stage_latency`), the stall detector (`stalls`) and the developer's
profiling switch (`profiler`)."""
