package dev.hebrus.flywheel.capture;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.io.BufferedReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.HashMap;
import java.util.Map;
import java.util.Properties;
import java.util.UUID;

/**
 * {@code java -cp 'flywheel-capture.jar:dependency/*' dev.hebrus.flywheel.capture.Main
 * --bootstrap-servers HOST:PORT --input RECORDS.jsonl [--prefix P] [--kafka-properties FILE]
 * [--producer-id ID]}
 *
 * <p>Publishes each input line, {@code {"kind": "identities"|"transcripts"|"observations",
 * "record": {...}}} (raw ids, plaintext tokens, routes as per-row lists), through a
 * {@link CapturePublisher}, then prints one JSON line of counters. The Kafka properties
 * default to the runtime role's librdkafka file, {@code $FLYWHEEL_HOME/kafka/security/runtime.properties};
 * the owner key store to {@link OwnerKeyStore#defaultDirectory()}. Exit status 0 when every
 * record was delivered or refused for consent, 1 when any failed, 2 on bad arguments.
 */
public final class Main {
    private Main() {
    }

    public static void main(String[] argv) throws Exception {
        Map<String, String> args = parse(argv);
        if (args == null || !args.containsKey("bootstrap-servers") || !args.containsKey("input")) {
            System.err.println("usage: Main --bootstrap-servers HOST:PORT --input FILE.jsonl "
                + "[--prefix P] [--kafka-properties FILE] [--producer-id ID]");
            System.exit(2);
        }
        String home = System.getenv().getOrDefault("FLYWHEEL_HOME", ".flywheel");
        Path propsFile = Paths.get(args.getOrDefault("kafka-properties",
            Paths.get(home, "kafka", "security", "runtime.properties").toString()));
        Properties client = ClientProperties.fromLibrdkafka(propsFile, args.get("bootstrap-servers"));
        String producerId = args.getOrDefault("producer-id",
            "java-" + ProcessHandle.current().pid() + "-" + UUID.randomUUID().toString().substring(0, 8));
        OwnerKeyStore keys = new OwnerKeyStore(OwnerKeyStore.defaultDirectory(), true);
        ObjectMapper json = new ObjectMapper();
        Map<String, Long> stats;
        String error;
        try (CapturePublisher publisher = new CapturePublisher(client,
                CapturePublisher.Topics.withPrefix(args.getOrDefault("prefix", "")), producerId, keys);
             BufferedReader in = Files.newBufferedReader(Paths.get(args.get("input")), StandardCharsets.UTF_8)) {
            for (String line; (line = in.readLine()) != null; ) {
                if (!line.isBlank()) {
                    publish(publisher, json.readTree(line));
                }
            }
            publisher.flush();
            stats = publisher.stats();
            error = publisher.firstError();
        }
        ObjectNode out = json.createObjectNode();
        stats.forEach(out::put);
        out.put("first_error", error);
        System.out.println(out);
        System.exit(stats.get("failed") == 0 && error == null ? 0 : 1);
    }

    private static void publish(CapturePublisher publisher, JsonNode line) throws Exception {
        ObjectNode record = (ObjectNode) line.path("record");
        switch (line.path("kind").asText()) {
            case "identities" -> publisher.publishIdentity(record);
            case "transcripts" -> publisher.publishTurn(record);
            case "observations" -> publisher.publishObservation(record);
            default -> throw new IllegalArgumentException("unknown kind " + line.path("kind"));
        }
    }

    private static Map<String, String> parse(String[] argv) {
        Map<String, String> out = new HashMap<>();
        for (int i = 0; i < argv.length; i += 2) {
            if (!argv[i].startsWith("--") || i + 1 >= argv.length) {
                return null;
            }
            out.put(argv[i].substring(2), argv[i + 1]);
        }
        return out;
    }
}
