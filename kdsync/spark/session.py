"""One place that builds the SparkSession every kdsync job uses."""

from __future__ import annotations

import os
import sys


def spark_session(master: str = "local[*]", app: str = "kdsync", conf: dict[str, str] | None = None):
    """Return a SparkSession on `master` with the kdsync Kafka data source
    registered.  Workers run this interpreter (so they import kdsync and
    confluent-kafka from the same environment).  An already-running session
    is reused (its master cannot change in-process)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", os.environ.get("KDSYNC_SPARK_SHUFFLE_PARTITIONS", "8"))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", os.environ.get("KDSYNC_SPARK_DRIVER_MEMORY", "4g"))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.python.worker.reuse", "true")
    )
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("KDSYNC_SPARK_LOG_LEVEL", "ERROR"))
    from kdsync.spark.kafka_source import KafkaDataSource

    spark.dataSource.register(KafkaDataSource)
    return spark
