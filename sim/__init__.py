"""kdsync-sim: a SimPy simulator that runs the real ordering core (`kdsync.core`)
through network, process and clock faults, from scenario files.

Modules: `scenario` (YAML format, validation), `network` (links, partitions),
`members` (Kafka model per cluster and the node adapter), `runner` (one run),
`checkers` (invariants judged from outside the nodes), `swarm` (seeded random
runs), `cli` (the `kdsync-sim` command).
"""
