"""kdsync: keep several Kafka clusters in the same total order."""

__version__ = "0.1.0"
