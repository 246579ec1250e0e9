package dev.hebrus.flywheel.capture;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import org.apache.avro.generic.GenericRecord;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * The consent rule of {@code streams.consent}, fail closed: an owner (pseudonym) may be
 * captured at {@code wall_time_ms} only if its latest ledger entry is a grant whose scopes
 * hold {@code capture} and {@code granted_at_ms <= wall_time_ms < expires_at_ms}. The ledger
 * is the compacted topic {@code <prefix>flywheel.consent.ledger.v1}, keyed by owner pseudonym,
 * values {@code ConsentRecord.v1}; a tombstone, an undecodable value or a key that differs
 * from the record's owner leaves the owner with no consent. Read without a consumer group
 * (assign + seek), from where the last read stopped to the end; re-read when older than
 * {@link #MAX_AGE_MS} and, at most every {@link #MISS_RETRY_MS}, when an owner is refused.
 * A ledger that cannot be read refuses everything for {@link #DOWN_RETRY_MS}.
 */
public final class ConsentGate implements AutoCloseable {
    static final long MAX_AGE_MS = 5_000;
    static final long MISS_RETRY_MS = 2_000;
    static final long DOWN_RETRY_MS = 5_000;
    private static final Duration TIMEOUT = Duration.ofSeconds(15);

    private final String topic;
    private final KafkaConsumer<byte[], byte[]> consumer;
    private final SchemaCatalog.Entry schema;
    private final Map<String, GenericRecord> entries = new HashMap<>();
    private final Map<String, Long> misses = new HashMap<>();
    private List<TopicPartition> partitions;
    private long loadedAt = Long.MIN_VALUE / 2;
    private long downUntil = Long.MIN_VALUE / 2;

    public ConsentGate(Properties client, String topic) throws java.io.IOException {
        this.topic = topic;
        this.schema = SchemaCatalog.load("ConsentRecord", 1);
        Properties props = new Properties();
        props.putAll(client);
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class.getName());
        props.remove(ConsumerConfig.GROUP_ID_CONFIG);
        this.consumer = new KafkaConsumer<>(props);
    }

    /** Whether {@code owner} (a pseudonym) has a live capture grant at {@code atMs}. */
    public synchronized boolean allows(String owner, long atMs) {
        long now = System.currentTimeMillis();
        if (now < downUntil) {
            return false;
        }
        try {
            if (now - loadedAt >= MAX_AGE_MS) {
                load();
            }
            if (covered(owner, atMs)) {
                return true;
            }
            if (now - misses.getOrDefault(owner, Long.MIN_VALUE / 2) >= MISS_RETRY_MS) {
                misses.put(owner, now);
                load();
                return covered(owner, atMs);
            }
            return false;
        } catch (RuntimeException exc) {
            downUntil = now + DOWN_RETRY_MS;
            System.err.println("flywheel-capture: consent ledger " + topic
                + " unreadable, refusing capture for 5 s: " + exc);
            return false;
        }
    }

    private boolean covered(String owner, long atMs) {
        GenericRecord e = entries.get(owner);
        if (e == null || !"grant".equals(String.valueOf(e.get("action")))) {
            return false;
        }
        boolean capture = false;
        for (Object scope : (List<?>) e.get("scopes")) {
            capture |= "capture".equals(String.valueOf(scope));
        }
        Object from = e.get("granted_at_ms");
        Object until = e.get("expires_at_ms");
        return capture && from != null && until != null
            && (Long) from <= atMs && atMs < (Long) until;
    }

    private void load() {
        if (partitions == null) {
            List<PartitionInfo> infos = consumer.partitionsFor(topic, TIMEOUT);
            if (infos == null || infos.isEmpty()) {
                throw new IllegalStateException("the consent ledger " + topic + " does not exist");
            }
            partitions = new ArrayList<>();
            infos.forEach(p -> partitions.add(new TopicPartition(p.topic(), p.partition())));
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
        }
        Map<TopicPartition, Long> ends = consumer.endOffsets(partitions, TIMEOUT);
        long deadline = System.currentTimeMillis() + TIMEOUT.toMillis();
        while (!reached(ends)) {
            if (System.currentTimeMillis() > deadline) {
                throw new IllegalStateException("timed out reading the consent ledger " + topic);
            }
            for (ConsumerRecord<byte[], byte[]> rec : consumer.poll(Duration.ofMillis(200))) {
                apply(rec.key(), rec.value());
            }
        }
        loadedAt = System.currentTimeMillis();
    }

    private boolean reached(Map<TopicPartition, Long> ends) {
        for (TopicPartition tp : partitions) {
            if (consumer.position(tp, TIMEOUT) < ends.getOrDefault(tp, 0L)) {
                return false;
            }
        }
        return true;
    }

    private void apply(byte[] key, byte[] value) {
        String owner = key == null ? null : new String(key, StandardCharsets.UTF_8);
        if (value == null) {
            if (owner != null) {
                entries.remove(owner);
            }
            return;
        }
        GenericRecord entry;
        try {
            entry = schema.decode(value);
        } catch (Exception exc) {
            if (owner != null) {
                entries.remove(owner);  // an unreadable latest entry: no consent
            }
            return;
        }
        String named = String.valueOf(entry.get("owner"));
        if (owner != null && !owner.equals(named)) {
            entries.remove(owner);
            return;
        }
        entries.put(named, entry);
    }

    @Override
    public void close() {
        consumer.close(Duration.ofSeconds(5));
    }
}
