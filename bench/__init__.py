"""`make bench`: the benchmark that compares kdsync's ordering protocols
(derecho, sequencer, mirror) on latency, throughput and ordering guarantees,
and writes results/ (report.md, *.png, *.csv).  Entry point: `python -m bench.run`."""
