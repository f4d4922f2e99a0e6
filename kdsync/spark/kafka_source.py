"""A Spark 4 Python data source that reads Kafka topics with confluent-kafka.

Spark's JVM connector (spark-sql-kafka) is not on every machine, so kdsync
brings its own batch source::

    spark.dataSource.register(KafkaDataSource)      # spark_session() does it
    df = (spark.read.format("kdsync-kafka")
          .option("bootstrap.servers", "127.0.0.1:9092")
          .option("topic", "test-global")
          .load())

Columns: cluster, topic, partition, offset, timestamp (ms, long), key, value
(binary), headers (array<struct<key string, value binary>>).

Options (all optional except a topic and a bootstrap):
  bootstrap.servers      brokers; any other librdkafka property is passed as
                         `kafka.<property>` (e.g. `kafka.security.protocol`)
  cluster                the name put in the `cluster` column (default "")
  clusters               instead of bootstrap.servers: JSON {"name": "brokers"}
                         to read several clusters in one scan (one planning
                         pass, one Spark stage)
  topic                  the topic, or a comma list of topics
  partitions             comma list of partitions (default: all)
  startingOffsets        JSON {"partition": offset} (default: low watermark)
  endingOffsets          JSON {"partition": offset}, exclusive (default: EOF)
  maxRecordsPerRange     split size of a partition into parallel ranges
                         (default 500000)
  timeoutSeconds         a range that sees neither its end nor EOF in this
                         long fails the task (default 120)

Theory of operation: the driver asks each partition for its watermarks and
cuts [start, high) into ranges of at most maxRecordsPerRange offsets; each
range is a Spark task that assigns one consumer to its start offset and
stops at its end offset.  The *last* range of a partition (and any range when
there is no endingOffsets) has no end: it reads until the broker reports
partition EOF.  That keeps the result complete on brokers whose
ListOffsets(latest) under-reports the tail (Tansu after multi-record batches),
and skips offset gaps (transaction markers, compaction) naturally.
"""

from __future__ import annotations

import itertools
import json

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

FORMAT = "kdsync-kafka"

HEADER_TYPE = ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())]))

SCHEMA = StructType([
    StructField("cluster", StringType(), False),
    StructField("topic", StringType(), False),
    StructField("partition", IntegerType(), False),
    StructField("offset", LongType(), False),
    StructField("timestamp", LongType(), True),
    StructField("key", BinaryType(), True),
    StructField("value", BinaryType(), True),
    StructField("headers", HEADER_TYPE, True),
])



class KafkaSourceError(ValueError):
    """A bad option or an unreachable broker (a user error: one clear line)."""


def kafka_conf(options) -> dict:
    """librdkafka properties from data source options (`bootstrap.servers`
    as is, every `kafka.X` as `X`)."""
    conf = {}
    for k, v in dict(options).items():
        kl = k.lower()
        if kl == "bootstrap.servers":
            conf["bootstrap.servers"] = v
        elif kl.startswith("kafka."):
            conf[kl[len("kafka."):]] = v
    return conf


def _consumer(conf: dict):
    from confluent_kafka import Consumer

    from kdsync.observability.logs import client_log

    c = dict(conf)
    c.setdefault("group.id", "kdsync-spark")
    c.update({"enable.auto.commit": False, "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    c.setdefault("log_level", 3)
    c.setdefault("logger", client_log())  # never raw %3|... lines (kdsync.observability.logs)
    c.setdefault("fetch.max.bytes", 52428800)
    return Consumer(c)


class OffsetRange(InputPartition):
    """Offsets [start, end) of one partition; end None = to partition EOF.
    `cluster` names the cluster (a key of the reader's cluster map)."""

    def __init__(self, topic: str, partition: int, start: int, end: int | None, cluster: str = ""):
        super().__init__((cluster, topic, partition, start, end))
        self.topic, self.partition, self.start, self.end, self.cluster = topic, partition, start, end, cluster


def _offsets_option(raw: str | None, name: str) -> dict[int, int]:
    if not raw:
        return {}
    try:
        return {int(k): int(v) for k, v in json.loads(raw).items()}
    except (ValueError, AttributeError) as e:
        raise KafkaSourceError(f"kdsync-kafka: option {name} must be JSON like {{\"0\": 42}}: {e}") from None


def plan_ranges(topic: str, watermarks: dict[int, tuple[int, int]], starting: dict[int, int],
                ending: dict[int, int], max_records: int, cluster: str = "") -> list[OffsetRange]:
    """Cut each partition into ranges.  `watermarks` maps partition -> (low,
    high) as the broker reported them; `high` may be too low, so unless an
    explicit end is given the last range of each partition is open (reads to
    EOF).  Pure function (tested without a broker)."""
    out: list[OffsetRange] = []
    for p in sorted(watermarks):
        low, high = watermarks[p]
        start = max(low, starting.get(p, low))
        if p in ending:
            end = ending[p]
            s = start
            while s < end:
                e = min(end, s + max_records)
                out.append(OffsetRange(topic, p, s, e, cluster))
                s = e
            continue
        s = start
        while high - s > max_records:
            out.append(OffsetRange(topic, p, s, s + max_records, cluster))
            s += max_records
        out.append(OffsetRange(topic, p, s, None, cluster))
    return out


class KafkaDataSource(DataSource):
    """`spark.read.format("kdsync-kafka")`: batch read of one Kafka topic."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self):
        return SCHEMA

    def reader(self, schema):
        return KafkaReader(self.options)


class KafkaReader(DataSourceReader):
    def __init__(self, options):
        opts = {k.lower(): v for k, v in dict(options).items()}
        base = kafka_conf(options)
        if "clusters" in opts:
            try:
                names = {str(k): str(v) for k, v in json.loads(opts["clusters"]).items()}
            except (ValueError, AttributeError) as e:
                raise KafkaSourceError(f"kdsync-kafka: option clusters must be JSON like "
                                       f"{{\"dc1\": \"host:9092\"}}: {e}") from None
            self.confs = {n: {**base, "bootstrap.servers": b} for n, b in names.items()}
        elif "bootstrap.servers" in base:
            self.confs = {opts.get("cluster", ""): base}
        else:
            raise KafkaSourceError("kdsync-kafka: option bootstrap.servers (or clusters) is required")
        self.topics = [t.strip() for t in (opts.get("topic") or "").split(",") if t.strip()]
        if not self.topics:
            raise KafkaSourceError("kdsync-kafka: option topic is required")
        self.partitions_opt = [int(x) for x in opts.get("partitions", "").split(",") if x.strip()]
        self.starting = _offsets_option(opts.get("startingoffsets"), "startingOffsets")
        self.ending = _offsets_option(opts.get("endingoffsets"), "endingOffsets")
        self.max_records = int(opts.get("maxrecordsperrange", 500_000))
        self.timeout = float(opts.get("timeoutseconds", 120))

    def partitions(self):
        from confluent_kafka import KafkaException, TopicPartition

        ranges = []
        for cluster, conf in self.confs.items():
            c = _consumer(conf)
            try:
                try:
                    md = c.list_topics(timeout=15)
                except KafkaException as e:
                    raise KafkaSourceError(f"kdsync-kafka: cannot reach {conf['bootstrap.servers']}: {e}") from None
                for topic in self.topics:
                    t = md.topics.get(topic)
                    if t is None or t.error is not None or not t.partitions:
                        continue  # no such topic: no rows
                    parts = sorted(t.partitions)
                    if self.partitions_opt:
                        parts = [p for p in parts if p in set(self.partitions_opt)]
                    marks = {}
                    for p in parts:
                        low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=15, cached=False)
                        marks[p] = (max(low, 0), max(high, 0))
                    ranges += plan_ranges(topic, marks, self.starting, self.ending, self.max_records, cluster)
            finally:
                c.close()
        return ranges or [OffsetRange(self.topics[0], -1, 0, 0)]

    def read(self, partition: OffsetRange):
        import pyarrow as pa

        from kdsync.kafka.topic import PartitionEndError, read_to_eof

        r = partition
        if r.partition < 0 or (r.end is not None and r.end <= r.start):
            return
        arrow_schema = pa.schema([
            pa.field("cluster", pa.string(), False),
            pa.field("topic", pa.string(), False),
            pa.field("partition", pa.int32(), False),
            pa.field("offset", pa.int64(), False),
            pa.field("timestamp", pa.int64()),
            pa.field("key", pa.binary()),
            pa.field("value", pa.binary()),
            pa.field("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ])
        c = _consumer(self.confs[r.cluster])
        header = arrow_schema.field("headers").type.value_type
        offsets: list[int] = []
        stamps: list[int | None] = []
        keys: list[bytes | None] = []
        values: list[bytes | None] = []
        headers: list = []  # per record: its list of (key, value) tuples, or None

        def flush():
            # the (key, value) tuples flattened and converted by Arrow, with list offsets: no
            # Python object per header (a dict each cost more than reading the record)
            n = len(offsets)
            flat = list(itertools.chain.from_iterable(h for h in headers if h))
            ends = itertools.accumulate((len(h) if h else 0 for h in headers), initial=0)
            hs = pa.ListArray.from_arrays(pa.array(list(ends), pa.int32()), pa.array(flat, header))
            batch = pa.RecordBatch.from_arrays(
                [pa.array([r.cluster] * n, pa.string()), pa.array([r.topic] * n, pa.string()),
                 pa.array([r.partition] * n, pa.int32()), pa.array(offsets, pa.int64()),
                 pa.array(stamps, pa.int64()), pa.array(keys, pa.binary()), pa.array(values, pa.binary()), hs],
                schema=arrow_schema)
            for v in (offsets, stamps, keys, values, headers):
                v.clear()
            return batch

        try:
            for m in read_to_eof(c, r.topic, r.partition, r.start, r.end, timeout=self.timeout, idle=True,
                                 strict=True, batch=5000, poll=0.5):
                ts_type, ts = m.timestamp()
                offsets.append(m.offset())
                stamps.append(ts if ts_type else None)
                keys.append(m.key())
                values.append(m.value())
                headers.append(m.headers())
                if len(offsets) >= 20000:
                    yield flush()
            if offsets:
                yield flush()
        except TimeoutError:
            raise TimeoutError(f"kdsync-kafka: {r.topic}[{r.partition}] range {r.start}.."
                               f"{r.end if r.end is not None else 'EOF'} got no data for {self.timeout}s") from None
        except PartitionEndError as e:
            # an explicit end beyond EOF: the records are not there (yet)
            raise KafkaSourceError(f"kdsync-kafka: {e}") from None
        finally:
            c.close()


def read_topic(spark, conf: dict | str, topic: str | list[str], clusters: dict[str, str] | None = None,
               **options):
    """DataFrame of `topic` (a name or a list) at the brokers of `conf` (a
    bootstrap string or librdkafka properties), or at each of `clusters`
    (name -> bootstrap; `conf` then only adds properties).  See the module
    docstring for columns and options."""
    conf = {"bootstrap.servers": conf} if isinstance(conf, str) else dict(conf or {})
    topics = [topic] if isinstance(topic, str) else list(topic)
    reader = spark.read.format(FORMAT).option("topic", ",".join(topics))
    if clusters:
        conf.pop("bootstrap.servers", None)
        reader = reader.option("clusters", json.dumps(clusters))
    for k, v in conf.items():
        reader = reader.option(k if k == "bootstrap.servers" else f"kafka.{k}", str(v))
    for k, v in options.items():
        reader = reader.option(k, v if isinstance(v, str) else json.dumps(v) if isinstance(v, dict) else str(v))
    return reader.load()
