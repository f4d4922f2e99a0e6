#!/usr/bin/env bash
# One Apache Kafka broker per site, KRaft mode (combined broker+controller,
# single node), listening on the private address; the source topic created.
# Usage: kafka.sh PRIVATE_IP KAFKA_VERSION [SOURCE_TOPIC]
set -euo pipefail
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
IP="${1:?usage: kafka.sh PRIVATE_IP KAFKA_VERSION [TOPIC]}"
VERSION="${2:?usage: kafka.sh PRIVATE_IP KAFKA_VERSION [TOPIC]}"
TOPIC="${3:-test}"
SCALA=2.13
NAME="kafka_${SCALA}-${VERSION}"
URL="https://archive.apache.org/dist/kafka/${VERSION}/${NAME}.tgz"

apt_install default-jre-headless curl
id kafka >/dev/null 2>&1 || useradd --system --home /var/lib/kafka --shell /usr/sbin/nologin kafka
if [ ! -x "/opt/$NAME/bin/kafka-server-start.sh" ]; then
    log "downloading $URL"
    tmp="$(mktemp -d)"
    curl -fsSL -o "$tmp/$NAME.tgz" "$URL"
    curl -fsSL -o "$tmp/$NAME.tgz.sha512" "$URL.sha512"
    # Apache publishes "file: HEX HEX ..." in upper case over several lines.
    want="$(cut -d: -f2- "$tmp/$NAME.tgz.sha512" | tr -d ' \n\r' | tr 'A-F' 'a-f')"
    got="$(sha512sum "$tmp/$NAME.tgz" | cut -d' ' -f1)"
    [ "$want" = "$got" ] || { echo "checksum mismatch for $NAME.tgz" >&2; exit 1; }
    tar -xzf "$tmp/$NAME.tgz" -C /opt
    rm -rf "$tmp"
fi
ln -sfn "/opt/$NAME" /opt/kafka

mkdir -p /etc/kafka /var/lib/kafka/data
cat >/etc/kafka/server.properties <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:9093
listeners=PLAINTEXT://${IP}:9092,CONTROLLER://127.0.0.1:9093
advertised.listeners=PLAINTEXT://${IP}:9092
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=/var/lib/kafka/data
num.partitions=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
auto.create.topics.enable=false
PROPS
if [ ! -f /var/lib/kafka/data/meta.properties ]; then
    /opt/kafka/bin/kafka-storage.sh format -t "$(/opt/kafka/bin/kafka-storage.sh random-uuid)" \
        -c /etc/kafka/server.properties
fi
chown -R kafka:kafka /var/lib/kafka

cat >/etc/systemd/system/kafka.service <<UNIT
[Unit]
Description=Apache Kafka ${VERSION} (KRaft, single node)
After=network-online.target
Wants=network-online.target

[Service]
User=kafka
Environment=KAFKA_HEAP_OPTS=-Xmx1g -Xms1g
ExecStart=/opt/kafka/bin/kafka-server-start.sh /etc/kafka/server.properties
Restart=on-failure
LimitNOFILE=100000

[Install]
WantedBy=multi-user.target
UNIT
systemctl daemon-reload
systemctl enable --now kafka.service

log "waiting for the broker at ${IP}:9092"
for _ in $(seq 120); do
    /opt/kafka/bin/kafka-topics.sh --bootstrap-server "${IP}:9092" --list >/dev/null 2>&1 && break
    sleep 1
done
/opt/kafka/bin/kafka-topics.sh --bootstrap-server "${IP}:9092" --create --if-not-exists \
    --topic "$TOPIC" --partitions 1 --replication-factor 1
