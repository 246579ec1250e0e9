package dev.hebrus.flywheel.capture;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.BinaryNode;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.common.serialization.ByteArraySerializer;

/**
 * What a JVM decode runtime embeds: the Java twin of {@code streams.publisher.RuntimePublisher}.
 *
 * <p>Callers pass records with raw owner, thread and sequence ids and plaintext tokens, as
 * JSON objects with the fields of {@code RuntimeIdentity.v3}, {@code TranscriptTurn.v1}
 * ({@code token_ids}) and {@code RouteObservation.v2} (with the routes as the runtime's arrays:
 * {@code expert_ids} and {@code weights}, one list of {@code top_k} values per row of
 * {@code layers}). Turns and observations are refused (not published, counted) when their
 * owner has no live capture grant ({@link ConsentGate}); otherwise ids become pseudonyms
 * ({@link Pseudonyms}), tokens and routes are sealed under the owner's data key
 * ({@link Sealer}), and {@code TranscriptTurn.v2} / {@code RouteObservation.v3} are produced,
 * keyed {@code <owner pseudonym>/<thread pseudonym>}, by an idempotent producer with
 * {@code acks=all}. Identities are keyed by their {@code identity_id}. Not thread-safe
 * beyond its synchronized methods.
 */
public final class CapturePublisher implements AutoCloseable {
    /** Topic names (a catalogue prefix plus the project's topic names). */
    public record Topics(String identities, String transcripts, String observations, String consent) {
        public static Topics withPrefix(String prefix) {
            return new Topics(prefix + "flywheel.capture.identities.v1",
                prefix + "flywheel.capture.transcripts.v1",
                prefix + "flywheel.capture.observations.v1",
                prefix + "flywheel.consent.ledger.v1");
        }
    }

    private record Geometry(int layers, int topK, int experts) {
    }

    private final Topics topics;
    private final String producerId;
    private final OwnerKeyStore keys;
    private final Pseudonyms names;
    private final ConsentGate consent;
    private final KafkaProducer<byte[], byte[]> producer;
    private final SchemaCatalog.Entry identitySchema;
    private final SchemaCatalog.Entry turnSchema;
    private final SchemaCatalog.Entry observationSchema;
    private final Map<String, Geometry> geometries = new HashMap<>();
    private long nextCounter;
    private final Map<String, AtomicLong> counts = new HashMap<>();
    private final AtomicReference<String> firstError = new AtomicReference<>();

    public CapturePublisher(Properties client, Topics topics, String producerId, OwnerKeyStore keys)
            throws IOException {
        this.topics = topics;
        this.producerId = producerId;
        this.keys = keys;
        this.names = new Pseudonyms(keys);
        this.identitySchema = SchemaCatalog.load("RuntimeIdentity", 3);
        this.turnSchema = SchemaCatalog.load("TranscriptTurn", 2);
        this.observationSchema = SchemaCatalog.load("RouteObservation", 3);
        for (String name : new String[] {"enqueued", "delivered", "failed", "refused_no_consent"}) {
            counts.put(name, new AtomicLong());
        }
        this.consent = new ConsentGate(client, topics.consent());
        Properties props = new Properties();
        props.putAll(client);
        props.put(ProducerConfig.CLIENT_ID_CONFIG, "flywheel-publisher-" + producerId);
        props.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, "true");
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        props.put(ProducerConfig.LINGER_MS_CONFIG, "5");
        props.put(ProducerConfig.COMPRESSION_TYPE_CONFIG, "lz4");
        props.put(ProducerConfig.DELIVERY_TIMEOUT_MS_CONFIG, "120000");
        props.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        props.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, ByteArraySerializer.class.getName());
        this.producer = new KafkaProducer<>(props);
    }

    /** Publishes a {@code RuntimeIdentity.v3}; turns and observations may then name it. */
    public synchronized void publishIdentity(ObjectNode identity) throws IOException {
        byte[] value = identitySchema.encode(identity);
        String id = identity.path("identity_id").asText();
        geometries.put(id, new Geometry(identity.path("routed_layer_count").asInt(),
            identity.path("top_k").asInt(), identity.path("expert_count").asInt()));
        send(topics.identities(), id.getBytes(StandardCharsets.UTF_8), value, identitySchema);
    }

    /** Seals and publishes a turn (raw ids, {@code token_ids}); false when consent refuses it. */
    public synchronized boolean publishTurn(ObjectNode turn) throws IOException {
        ObjectNode record = stamped(turn);
        geometry(record);
        String rawOwner = record.path("owner").asText();
        if (!consented(rawOwner, record)) {
            return false;
        }
        pseudonymize(record);
        OwnerKeyStore.DataKey key = keys.liveKey(record.path("owner").asText());
        long[] tokens = new long[record.path("token_ids").size()];
        for (int i = 0; i < tokens.length; i++) {
            tokens[i] = record.path("token_ids").get(i).asLong();
        }
        record.remove("token_ids");
        record.set("sealed_token_ids", BinaryNode.valueOf(Sealer.seal(key, Sealer.packInt32(tokens),
            "token_ids", Sealer.turnContext(record))));
        record.put("key_generation", key.generation());
        return enqueue(topics.transcripts(), record, turnSchema);
    }

    /** Seals and publishes an observation (raw ids, {@code token_id}, per-row routes). */
    public synchronized boolean publishObservation(ObjectNode obs) throws IOException {
        ObjectNode record = stamped(obs);
        byte[] routes = packRoutes(record, geometry(record));
        String rawOwner = record.path("owner").asText();
        if (!consented(rawOwner, record)) {
            return false;
        }
        pseudonymize(record);
        OwnerKeyStore.DataKey key = keys.liveKey(record.path("owner").asText());
        byte[] context = Sealer.observationContext(record);
        record.set("sealed_token_id", BinaryNode.valueOf(Sealer.seal(key,
            Sealer.packInt32(record.path("token_id").asLong()), "token_id", context)));
        record.set("sealed_routes", BinaryNode.valueOf(Sealer.seal(key, routes, "routes", context)));
        record.remove("token_id");
        record.remove("expert_ids");
        record.remove("weights");
        record.put("key_generation", key.generation());
        return enqueue(topics.observations(), record, observationSchema);
    }

    /** Counters: enqueued, delivered, failed, refused_no_consent. */
    public Map<String, Long> stats() {
        Map<String, Long> out = new HashMap<>();
        counts.forEach((k, v) -> out.put(k, v.get()));
        return out;
    }

    public String firstError() {
        return firstError.get();
    }

    public void flush() {
        producer.flush();
    }

    @Override
    public void close() {
        producer.close(Duration.ofSeconds(30));
        consent.close();
    }

    private ObjectNode stamped(ObjectNode in) {
        ObjectNode out = in.deepCopy();
        if (!out.hasNonNull("producer_id")) {
            out.put("producer_id", producerId);
        }
        if (!out.hasNonNull("wall_time_ms")) {
            out.put("wall_time_ms", System.currentTimeMillis());
        }
        return out;
    }

    private Geometry geometry(JsonNode record) {
        Geometry g = geometries.get(record.path("identity_id").asText());
        if (g == null) {
            throw new IllegalArgumentException("unknown_identity: publish the RuntimeIdentity "
                + record.path("identity_id").asText() + " first");
        }
        return g;
    }

    private boolean consented(String rawOwner, JsonNode record) {
        String owner = names.owner(rawOwner);
        if (consent.allows(owner, record.path("wall_time_ms").asLong())) {
            return true;
        }
        counts.get("refused_no_consent").incrementAndGet();
        return false;
    }

    private void pseudonymize(ObjectNode record) {
        String owner = record.path("owner").asText();
        record.put("thread", names.thread(owner, record.path("thread").asText()));
        record.put("sequence_id", names.sequence(owner, record.path("sequence_id").asText()));
        record.put("owner", names.owner(owner));
    }

    /** int32 LE byte length of the ids, uint16 LE expert ids, float32 LE weights (row-major). */
    static byte[] packRoutes(JsonNode record, Geometry g) {
        JsonNode ids = record.path("expert_ids");
        JsonNode weights = record.path("weights");
        int rows = record.path("layers").size();
        int k = record.path("top_k").asInt();
        if (rows != g.layers() || k != g.topK() || ids.size() != rows || weights.size() != rows) {
            throw new IllegalArgumentException("route_shape: expected " + g.layers() + " rows of top_k "
                + g.topK() + " (layers, expert_ids, weights), got layers=" + rows + " top_k=" + k);
        }
        ByteBuffer out = ByteBuffer.allocate(4 + rows * k * 6).order(ByteOrder.LITTLE_ENDIAN);
        out.putInt(rows * k * 2);
        for (JsonNode row : ids) {
            for (int j = 0; j < k; j++) {
                int e = row.path(j).asInt(-1);
                if (row.size() != k || e < 0 || e >= g.experts()) {
                    throw new IllegalArgumentException("expert_out_of_range: " + row);
                }
                out.putShort((short) e);
            }
        }
        for (JsonNode row : weights) {
            for (int j = 0; j < k; j++) {
                out.putFloat((float) row.path(j).asDouble());
            }
        }
        return out.array();
    }

    private boolean enqueue(String topic, ObjectNode record, SchemaCatalog.Entry schema)
            throws IOException {
        boolean stamp = !record.hasNonNull("counter");
        if (stamp) {
            record.put("counter", nextCounter);
        }
        byte[] value = schema.encode(record);
        nextCounter += stamp ? 1 : 0;
        String key = record.path("owner").asText() + "/" + record.path("thread").asText();
        send(topic, key.getBytes(StandardCharsets.UTF_8), value, schema);
        return true;
    }

    private void send(String topic, byte[] key, byte[] value, SchemaCatalog.Entry schema) {
        ProducerRecord<byte[], byte[]> rec = new ProducerRecord<>(topic, null, key, value, schema.headers);
        counts.get("enqueued").incrementAndGet();
        producer.send(rec, (meta, exc) -> {
            if (exc == null) {
                counts.get("delivered").incrementAndGet();
            } else {
                counts.get("failed").incrementAndGet();
                firstError.compareAndSet(null, topic + ": " + exc);
            }
        });
    }
}
