"""kdsync/spark — the data pipeline on PySpark.

* `kafka_source`: a Spark 4 Python data source ("kdsync-kafka") that reads a
  topic's partitions in parallel offset ranges with confluent-kafka;
* `audit`: `kdsync audit`, the checker of real clusters and of sim traces;
* `archive`: `kdsync archive | compact | restore`, the ordered log on Parquet.

Importing this package does not import pyspark; each module does when used.
"""
